"""The session server as a service of a run (registered as ``session``): started behind the run's
router when the generator asks for it (the ``agentic`` generator's ``services``), with the ``tito``
section and the rollout limits spelled out as flags (:func:`miles_tito.server.cli.session_arguments`)."""

from __future__ import annotations

import sys

from miles_contracts import ServiceSpec
from miles_contracts.cluster import ROUTER, SESSION, ServiceLaunch


def session_command(launch: ServiceLaunch) -> list[str]:
    """argv of the run's session server, behind its router."""
    from miles_tito.server.cli import session_arguments

    routers = list(launch.upstream.get(ROUTER, ()))
    if not routers:
        raise ValueError("the session server needs the run's router URL")
    return [sys.executable, "-m", "miles_tito.server", "--host", launch.endpoint.host,
            "--port", str(launch.endpoint.port), "--router", routers[0], "--model", launch.model_path,
            *session_arguments(launch.config)]


SESSION_SERVICE = ServiceSpec(SESSION, session_command, needs=(ROUTER,), config_sections=("tito", "rollout"))
"""What this package registers as service ``session``."""
