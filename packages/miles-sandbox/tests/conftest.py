"""A sandbox service on a thread of the test process, with a template folder and small limits."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from miles_contracts.wire.auth import new_token

if shutil.which("bwrap") is None:  # CI installs it (.ci/run); without it nothing here can run
    pytest.skip("bubblewrap is not installed: apt-get install -y bubblewrap", allow_module_level=True)


@pytest.fixture(scope="session")
def templates(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from miles_sandbox.conformance import write_template

    root = tmp_path_factory.mktemp("templates")
    write_template(root)
    return root


@pytest.fixture(scope="session")
def token(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The run's token, where a run keeps it: this process's environment and a file of the run folder."""
    from miles_contracts.wire.auth import TOKEN_ENV

    value = new_token()
    (tmp_path_factory.mktemp("run") / "token").write_text(value)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TOKEN_ENV, value)
        yield value


@pytest.fixture(scope="session")
def sandbox_url(templates: Path, token: str) -> Iterator[str]:
    from miles_sandbox.config import SandboxLimits, SandboxSection
    from miles_sandbox.server import SandboxServer

    section = SandboxSection(templates_dir=str(templates), pool_size=2, acquire_timeout_s=20,
                             limits=SandboxLimits(wall_s=5, processes=32, output_bytes=64 << 10, workspace_mb=32))
    with SandboxServer(section, token=token) as server:
        yield server.url
