"""The session server as a service of a run (registered as ``session``): started behind the run's
router when the generator asks for it (the ``agentic`` generator's ``services``), with the ``tito``
section and the rollout limits spelled out as flags (:func:`miles_tito.server.cli.session_arguments`)."""

from __future__ import annotations

import sys
from typing import ClassVar

from miles_contracts.cluster import ROUTER, SESSION, ServiceLaunch


class SessionServerService:
    role: ClassVar[str] = SESSION
    needs: ClassVar[tuple[str, ...]] = (ROUTER,)
    health_path: ClassVar[str | None] = "/health"
    config_sections: ClassVar[tuple[str, ...]] = ("tito", "rollout")

    def command(self, launch: ServiceLaunch) -> list[str]:
        from miles_tito.server.cli import session_arguments

        routers = list(launch.upstream.get(ROUTER, ()))
        if not routers:
            raise ValueError("the session server needs the run's router URL")
        return [sys.executable, "-m", "miles_tito.server", "--host", launch.endpoint.host,
                "--port", str(launch.endpoint.port), "--router", routers[0], "--model", launch.model_path,
                *session_arguments(launch.config)]
