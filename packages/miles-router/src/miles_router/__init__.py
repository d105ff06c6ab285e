"""miles-router: an HTTP router in front of engines that speak SGLang's native API.

Least-in-flight selection with session affinity (``X-SMG-Routing-Key``), health checks with
quarantine and re-admission (weight-version aware), failover of requests whose engine died,
fan-out of abort / pause / weight updates, worker management and a middleware chain.

Run it with ``miles serve router --worker URL ... [--config FILE]``, as a process from
:func:`miles_router.server.router_command`, or in this process with
:class:`miles_router.server.RouterServer`. Design notes: ``docs/design/router.md``.
"""

from miles_router.server import RouterServer, router_command

__all__ = ["RouterServer", "router_command"]
