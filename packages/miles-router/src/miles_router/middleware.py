"""The router-middleware chain.

A middleware is registered by name through ``miles_register_router_middlewares`` as a factory
``(options: dict) -> RouterMiddleware`` and listed in ``router.middlewares``; the chain wraps every
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

from miles.errors import ConfigError
from miles_contracts import RouterMiddleware, RouterRequest, RouterResponse

if TYPE_CHECKING:
    from miles.kernel import Kernel

STATE_QUERY = "query_string"
STATE_ATTEMPTS = "attempts"
STATE_TRIED = "tried_workers"
STATE_ROUTER_ABORT = "router_abort"
STATE_FANOUT = "fanout"

Handler = Callable[[RouterRequest], Awaitable[RouterResponse]]


@dataclass(frozen=True, slots=True)
class NamedMiddleware:
    name: str
    middleware: RouterMiddleware


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
    names: Sequence[str], options: Mapping[str, Mapping[str, Any]], kernel: Kernel | None = None
) -> list[NamedMiddleware]:
    """Instantiate the registered factories named in ``names`` (unknown names fail listing the
    registered ones and the packages that provide them)."""
    if not names:
        return []
    if kernel is None:
        from miles.kernel import Kernel

        kernel = Kernel.load()
    registry = kernel.router_middlewares()
    chain = []
    for name in names:
        factory = registry.get(name)
        try:
            middleware = factory(dict(options.get(name, {})))
        except (ValueError, TypeError) as exc:  # pydantic's ValidationError is a ValueError
            raise ConfigError(_option_errors(name, exc)) from None
        chain.append(NamedMiddleware(name, middleware))
    return chain


def _option_errors(name: str, exc: Exception) -> list[str]:
    where = f"router.middleware_options.{name}"
    details = getattr(exc, "errors", None)
    if not callable(details):
        return [f"{where}: {exc}"]
    return [f"{where}.{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in details()]
