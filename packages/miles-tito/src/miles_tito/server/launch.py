"""The session server as a service of a run (registered as ``session``): started behind the run's
router when the generator asks for it (the ``agentic`` generator's ``services``), with
``--config <run>/config.yaml``, from which the process reads the ``tito`` section, the rollout
limits and the loop mode, and loads its kernel (the run's ``plugins`` selection, whose chat
families it resolves). argv carries only the router's URL, the model folder, the endpoint and the
run's folder."""

from __future__ import annotations

import sys

from miles_contracts import ServiceSpec
from miles_contracts.cluster import ROUTER, SESSION, ServiceLaunch


def session_command(launch: ServiceLaunch) -> list[str]:
    """argv of the run's session server, behind its router."""
    routers = list(launch.upstream.get(ROUTER, ()))
    if not routers:
        raise ValueError("the session server needs the run's router URL")
    argv = [sys.executable, "-m", "miles_tito.server", "--host", launch.endpoint.host,
            "--port", str(launch.endpoint.port), "--router", routers[0], "--model", launch.model_path,
            "--config", launch.config_path]
    if launch.run_dir:
        argv += ["--run-dir", launch.run_dir]
    return argv


SESSION_SERVICE = ServiceSpec(SESSION, session_command, needs=(ROUTER,), config_sections=("tito", "rollout", "run"))
"""What this package registers as service ``session``."""
