"""A run's token is written nowhere: not in its logs, not in the files of its run folder, not in
what the driver prints; and what it writes there only its user can read.

The run is a real ``miles train`` with ``rollout.engine: sglang``. SGLang needs a GPU, so its
``sglang.launch_server`` is a stand-in (a module on the ``PYTHONPATH`` that ``sglang.env`` gives
the engine) that does what SGLang does on a machine without one: it prints its arguments
(``server_args=ServerArgs(..., api_key=...)``, as SGLang logs them) and exits with an error. The
driver then fails the run and quotes the engine's log in its error, the path by which the token
reached the terminal before.
"""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from miles_contracts.wire.auth import new_token

STAND_IN = textwrap.dedent('''
    """Stand-in for sglang.launch_server on a machine without a GPU: prints its arguments as SGLang
    logs them at start-up, then fails as SGLang does there."""
    import sys
    args = sys.argv[1:]
    key = args[args.index("--api-key") + 1] if "--api-key" in args else None
    print(f"server_args=ServerArgs(model_path={args[args.index('--model-path') + 1]!r}, api_key={key!r})", flush=True)
    sys.exit("RuntimeError: No CUDA GPUs are available")
''')


@pytest.mark.slow
def test_a_failed_sglang_run_writes_its_token_nowhere(tiny_dense: Path, tmp_path: Path) -> None:
    site = tmp_path / "sg-site"
    (site / "sglang").mkdir(parents=True)
    (site / "sglang" / "__init__.py").write_text("")
    (site / "sglang" / "launch_server.py").write_text(STAND_IN)
    token = new_token()
    env = {**os.environ, "MILES_AUTH_TOKEN": token, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "miles.cli.main", "train", f"model.name={tiny_dense}", f"run.output_dir={tmp_path}",
         "run.name=leak", "rollout.engine=sglang", f"sglang.python={sys.executable}",
         f"sglang.env={{PYTHONPATH: {site}}}"],
        capture_output=True, text=True, timeout=300, env=env)
    run = tmp_path / "leak"
    engine_log = run / "logs" / "engine-0.log"
    # the engine did get the token, printed it, and the driver quoted its log in the error
    assert out.returncode == 2 and "service 'engine-0' exited with code 1" in out.stderr, out.stderr
    assert "api_key='[redacted]'" in engine_log.read_text() and "api_key='[redacted]'" in out.stderr
    assert token not in out.stdout and token not in out.stderr
    files = [path for path in run.rglob("*") if path.is_file()]
    assert engine_log in files and run / "config.yaml" in files
    assert [path for path in files if token.encode() in path.read_bytes()] == []
    private = [run / "config.yaml", *(run / "logs").iterdir()]
    assert {path.name: stat.S_IMODE(path.stat().st_mode) for path in private} == {p.name: 0o600 for p in private}
    assert stat.S_IMODE((run / "logs").stat().st_mode) == 0o700
