"""Importing the kernel (and listing plugins) must not pull in heavy frameworks."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ["torch", "ray", "transformers", "fastapi", "megatron"]


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
