"""The router-middleware chain.

A middleware is registered by name through ``miles_register_router_middlewares`` as a
:class:`~miles_contracts.RouterMiddlewareSpec` (``create(ctx, options) -> RouterMiddleware``, called
in the router process with its run context) and listed in ``router.middlewares``; the chain wraps every
request the router sends on to engines (single-engine requests and fan-outs alike), outermost
first. Router endpoints of its own (``/add_worker``, ``/list_workers``, ``/health``, ``/metrics``)
do not pass through it.

What the router leaves in ``RouterRequest.state`` for middlewares (keys below):
``query_string`` (raw query of the incoming URL), ``attempts`` (engines tried), ``tried_workers``
(their URLs, in order), ``router_abort`` (why the router answered with an abort itself), and
``fanout`` (True for requests sent to every worker).

A middleware that also has a ``snapshot() -> dict`` method is shown in ``GET /metrics`` under its
name; one with ``prometheus() -> str`` adds lines to ``GET /metrics?format=prometheus``.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from miles.errors import ConfigError, PluginError
from miles_contracts import MiddlewareReport, RouterMiddleware, RouterRequest, RouterResponse

if TYPE_CHECKING:
    from miles_contracts import RunContext

STATE_QUERY = "query_string"
STATE_ATTEMPTS = "attempts"
STATE_TRIED = "tried_workers"
STATE_ROUTER_ABORT = "router_abort"
STATE_FANOUT = "fanout"

Handler = Callable[[RouterRequest], Awaitable[RouterResponse]]


@dataclass(frozen=True, slots=True)
class NamedMiddleware:
    """One link of the chain; ``report`` is the middleware again when its spec says it reports to
    ``/metrics`` (``RouterMiddlewareSpec.reports``)."""

    name: str
    middleware: RouterMiddleware
    report: MiddlewareReport | None = None


def compose(chain: Sequence[NamedMiddleware], endpoint: Handler) -> Handler:
    """``chain[0]`` sees the request first and the response last; ``endpoint`` is innermost."""
    handler = endpoint
    for link in reversed(chain):
        handler = _bind(link.middleware, handler)
    return handler


def _bind(middleware: RouterMiddleware, call_next: Handler) -> Handler:
    async def handle(request: RouterRequest) -> RouterResponse:
        return await middleware(request, call_next)

    return handle


def build_middlewares(
    names: Sequence[str], options: Mapping[str, Mapping[str, Any]], ctx: RunContext
) -> list[NamedMiddleware]:
    """The chain ``names`` lists, each built by its registered spec in ``ctx.kernel`` (the router
    process's kernel, loaded for the run's ``plugins`` section) with its entry of ``options``.
    Unknown names fail listing the registered ones and the packages that provide them; bad
    options are a :class:`~miles.errors.ConfigError`."""
    if not names:
        return []
    registry = ctx.kernel.router_middlewares()
    chain = []
    for name in names:
        spec = registry.get(name)
        try:
            middleware = spec.create(ctx, dict(options.get(name, {})))
        except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            raise ConfigError(_option_errors(name, exc)) from None
        report = None
        if spec.reports:
            if not isinstance(middleware, MiddlewareReport):
                raise PluginError(f"router middleware {name!r} ({registry.entry(name).origin}) is registered with "
                                  f"reports=True, but {type(middleware).__name__} has no snapshot() and prometheus()")
            report = middleware
        chain.append(NamedMiddleware(name, middleware, report))
    return chain


def _option_errors(name: str, exc: Exception) -> list[str]:
    where = f"router.middleware_options.{name}"
    details = getattr(exc, "errors", None)
    if not callable(details):
        return [f"{where}: {exc}"]
    return [f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in details()]
