"""The router as a service of a run (registered as ``router`` through ``miles_register_services``):
started in front of the run's engines with ``--config <run>/config.yaml``, from which the process
reads its ``router`` section and loads its kernel (the run's ``plugins`` selection builds its
middleware chain); argv carries only the engines' URLs, the endpoint and the run's folder.

When an engine comes back at another address (its node left and the executor restarted it
elsewhere), the running router swaps the worker (``/remove_worker``, ``/add_worker``) instead of
being restarted, so requests in flight on the other engines are not lost.
"""

from __future__ import annotations

from miles_contracts import ServiceSpec
from miles_contracts.cluster import ENGINE, ROUTER, ServiceLaunch

_TIMEOUT_S = 30.0


def router_service_command(launch: ServiceLaunch) -> list[str]:
    """argv of the run's router, in front of the engines' URLs."""
    from miles_router.server import router_command

    return router_command(list(launch.upstream.get(ENGINE, ())), port=launch.endpoint.port,
                          host=launch.endpoint.host, config_path=launch.config_path, run_dir=launch.run_dir or None)


def follow_moved_engine(url: str, role: str, old: str, new: str) -> None:
    """Swap the router's worker ``old`` for ``new`` (an engine that came back elsewhere)."""
    import httpx
    from miles_contracts.wire.auth import auth_headers

    # control routes take the run's token
    with httpx.Client(timeout=_TIMEOUT_S, headers=auth_headers(), trust_env=False) as client:
        removed = client.post(f"{url}/remove_worker", params={"url": old})
        if removed.status_code not in (200, 404):  # 404: already gone
            removed.raise_for_status()
        client.post(f"{url}/add_worker", params={"url": new}).raise_for_status()


ROUTER_SERVICE = ServiceSpec(ROUTER, router_service_command, needs=(ENGINE,), config_sections=("router",),
                             upstream_moved=follow_moved_engine)
"""What this package registers as service ``router``."""
