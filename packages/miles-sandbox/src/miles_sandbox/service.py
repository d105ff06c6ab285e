"""The sandbox service as a service of a run (registered as ``sandbox``, role ``sandbox``): started
with ``--config <run>/config.yaml`` (its ``sandbox`` section) beside the driver, when the run's
agent lists the role in :attr:`~miles_contracts.AgentSpec.services`. Its pid is in
``<run>/services.json`` like every service's; a killed one is restarted by the supervisor (leases
it held are gone: their next command gets 404, a tool error for that episode)."""

from __future__ import annotations

from miles_contracts import ServiceSpec
from miles_contracts.cluster import ServiceLaunch

SANDBOX = "sandbox"
"""The role of the sandbox service; its URL reaches agents as ``metadata["services"]["sandbox"]``."""


def sandbox_service_command(launch: ServiceLaunch) -> list[str]:
    from miles_sandbox.server import sandbox_command

    return sandbox_command(port=launch.endpoint.port, host=launch.endpoint.host, config_path=launch.config_path,
                           run_dir=launch.run_dir or None)


SANDBOX_SERVICE = ServiceSpec(SANDBOX, sandbox_service_command, config_sections=(SANDBOX,))
"""What this package registers as service ``sandbox``."""
