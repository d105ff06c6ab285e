"""Importing the kernel, listing plugins and the commands that only read plugins and config
(``miles --help``, ``miles config show``, a config error) must not pull in heavy frameworks:
each plugin declares its sections, commands and registered names without importing its heavy
code, which loads in the factory that uses it (docs/benchmarks/cli.md has the timings)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ["torch", "ray", "transformers", "fastapi", "megatron", "uvicorn", "httpx", "numpy", "safetensors",
         "starlette", "aiohttp", "openai", "datasets", "tokenizers", "sglang", "wandb", "mlflow", "tensorboard"]


def _imported_after(code: str) -> list[str]:
    script = (
        f"{code}\nimport json, sys\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules or any(k.startswith(m + '.') for k in sys.modules)]))"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_miles_imports_no_heavy_framework() -> None:
    assert _imported_after("import miles, miles.config, miles.kernel, miles.hookspecs, miles_contracts") == []


def test_loading_every_installed_plugin_stays_light() -> None:
    # `miles plugins` imports every plugin module: they must defer heavy imports to use time.
    assert _imported_after("from miles.kernel import Kernel; Kernel.load().plugins()") == []


@pytest.mark.parametrize("argv", [
    ["--help"],
    ["config", "show"],  # validates every section and every registered name (all registries collected)
    ["config", "show", "run.stpes=2"],  # a config error
    ["plugins"],
    ["bench", "--help"],
])
def test_commands_that_read_only_plugins_and_config_stay_light(argv: list[str]) -> None:
    run = ("import contextlib, io\nfrom miles.cli.main import main\n"
           "with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):\n"
           f"    try:\n        main({argv!r})\n    except SystemExit:\n        pass")
    assert _imported_after(run) == []
