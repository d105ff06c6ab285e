"""Third-party discovery end to end (issue 2, item 7).

The test writes three plugin packages as files -- a working model bridge for a made-up
architecture, one that fails to import, one with a misspelled hook -- builds each into a wheel
with ``uv build``, and installs them next to a kernel-only Miles (``miles-kernel`` +
``miles-contracts`` in a fresh virtual environment; the broken ones into separate ``--target``
folders put on ``PYTHONPATH`` only for the runs that need them). Then, in subprocesses:
``miles plugins`` lists the bridge; ``MILES_DISABLE_PLUGINS``, ``plugins.disable`` and
``plugins.enable`` (allow-list) are honoured; ``Kernel.model_bridge`` hands the architecture to
the plugin; and each broken plugin stops start-up with a message naming the plugin, its
distribution and how to disable it -- and disabling it as told works.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "docs" / "plugins" / "example-bridge"
pytestmark = pytest.mark.slow  # builds five wheels and a virtual environment: ~20-40 s on 2 cores

TOY_PLUGIN = '''
    """Miles plugin ``toy``: the bridge of the made-up ToyForCausalLM (every weight is a rename)."""

    from miles import hookimpl


    class ToyBridge:
        name = "toy"
        chat_family = None

        def _names(self, hf_config):  # HF name -> megatron-core name
            names = {"toy.embed.weight": "embedding.word_embeddings.weight",
                     "toy.norm.weight": "decoder.final_layernorm.weight"}
            for i in range(hf_config["num_layers"]):
                names[f"toy.blocks.{i}.down.weight"] = f"decoder.layers.{i}.mlp.linear_fc2.weight"
            return names

        def to_megatron(self, hf_state, hf_config):
            return {m: hf_state[h] for h, m in self._names(hf_config).items()}

        def to_hf(self, mcore_state, hf_config):
            return {h: mcore_state[m] for h, m in self._names(hf_config).items()}

        def megatron_config(self, hf_config):
            return {
                "transformer_config": {"num_layers": hf_config["num_layers"], "hidden_size": hf_config["hidden"],
                                       "num_attention_heads": 1, "ffn_hidden_size": hf_config["ffn"]},
                "gpt_model": {"vocab_size": hf_config["vocab"], "share_embeddings_and_output_weights": True},
                "layer_spec": {"function": "get_gpt_layer_local_spec", "kwargs": {}},
            }


    @hookimpl
    def miles_model_bridge(hf_config):
        return ToyBridge() if "ToyForCausalLM" in (hf_config.get("architectures") or []) else None
'''

BROKEN_IMPORT_PLUGIN = '''
    import miles_toy_dependency_that_is_not_installed  # noqa: F401
'''

TYPO_PLUGIN = '''
    from miles import hookimpl


    @hookimpl
    def miles_model_bridg(hf_config):  # misspelled: must fail loudly, never be silently ignored
        return None
'''

# Run inside the temporary environment: the kernel's Python API, driven by config files.
API_SCRIPT = '''
    import json, sys
    from pathlib import Path

    from miles.config import PluginsSection, read_yaml
    from miles.errors import PluginError
    from miles.kernel import Kernel
    from miles.plugins import PluginSelection

    TOY = {"architectures": ["ToyForCausalLM"], "model_type": "toy", "num_layers": 2, "hidden": 4, "ffn": 8, "vocab": 16}

    def selection(path):
        section = PluginsSection.model_validate(read_yaml(Path(path)).get("plugins") or {})
        return PluginSelection.from_settings(section.enable, section.disable)

    out = {}
    bridge = Kernel.load().model_bridge(TOY)
    out["claim"] = [bridge.name, type(bridge).__module__, bridge.megatron_config(TOY)["gpt_model"]["vocab_size"]]
    try:
        Kernel.load(selection(sys.argv[1])).model_bridge(TOY)
    except PluginError as exc:
        out["disabled"] = str(exc)
    kernel = Kernel.load(selection(sys.argv[2]))
    out["allow_list"] = {i.name: i.status for i in kernel.plugins()}
    out["allow_list_claim"] = kernel.model_bridge(TOY).name
    print(json.dumps(out))
'''


def _write_package(root: Path, dist: str, entry_point: str, source: str, version: str = "0.1.0") -> Path:
    module = dist.replace("-", "_")
    (root / "src" / module).mkdir(parents=True)
    (root / "src" / module / "__init__.py").write_text("")
    (root / "src" / module / "plugin.py").write_text(textwrap.dedent(source).lstrip())
    (root / "pyproject.toml").write_text(textwrap.dedent(f'''
        [project]
        name = "{dist}"
        version = "{version}"
        requires-python = ">=3.11"
        dependencies = ["miles-kernel"]

        [project.entry-points.miles]
        {entry_point} = "{module}.plugin"

        [build-system]
        requires = ["hatchling>=1.25"]
        build-backend = "hatchling.build"

        [tool.hatch.build.targets.wheel]
        packages = ["src/{module}"]
    ''').lstrip())
    return root


def _run(args: list[str], *, env: dict[str, str] | None = None, check: bool = True) -> subprocess.CompletedProcess[str]:
    result = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    if check and result.returncode != 0:
        raise AssertionError(f"{' '.join(args)} failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Kernel-only environment with the toy bridge installed; broken plugins in their own folders."""
    uv = shutil.which("uv")
    if uv is None:
        pytest.skip("needs uv (the workspace's tool; .ci/run installs it)")
    tmp = tmp_path_factory.mktemp("third_party")
    wheels = tmp / "wheels"
    packages = {
        "toy": _write_package(tmp / "toy", "miles-toy-bridge", "toy", TOY_PLUGIN, version="0.3.1"),
        "broken": _write_package(tmp / "broken", "miles-broken-import", "broken_import", BROKEN_IMPORT_PLUGIN),
        "typo": _write_package(tmp / "typo", "miles-typo-bridge", "typo_bridge", TYPO_PLUGIN),
    }
    for package in packages.values():
        _run([uv, "build", "--wheel", "-q", "-o", str(wheels), str(package)])
    venv = tmp / "venv"
    _run([uv, "venv", "-q", "--python", sys.executable, str(venv)])
    python = venv / "bin" / "python"
    toy_wheel = next(wheels.glob("miles_toy_bridge-*.whl"))
    _run([uv, "pip", "install", "-q", "--python", str(python), str(ROOT / "kernel"), str(ROOT / "contracts"), str(toy_wheel)])
    out = {"python": python, "miles": venv / "bin" / "miles"}
    # The tutorial's example package, and the model plugin it builds on (both pure Python at import).
    _run([uv, "build", "--wheel", "-q", "-o", str(wheels), str(EXAMPLE)])
    _run([uv, "build", "--wheel", "-q", "-o", str(wheels), str(ROOT / "plugins" / "miles-model-llama")])
    for key, pattern in (
        ("broken", "miles_broken_import-*.whl"), ("typo", "miles_typo_bridge-*.whl"),
        ("acme", "acme_miles-*.whl"), ("llama", "miles_model_llama-*.whl"),
    ):
        target = tmp / f"site-{key}"
        wheel = next(wheels.glob(pattern))
        _run([uv, "pip", "install", "-q", "--python", str(python), "--no-deps", "--target", str(target), str(wheel)])
        out[key] = target
    (tmp / "disable.yaml").write_text("plugins:\n  disable: [toy]\n")
    (tmp / "enable.yaml").write_text("plugins:\n  enable: [toy]\n")
    out["disable"], out["enable"] = tmp / "disable.yaml", tmp / "enable.yaml"
    return out


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in {"PYTHONPATH", "MILES_DISABLE_PLUGINS", "VIRTUAL_ENV"}}
    return {**env, **extra}


def _plugins_json(installed: dict[str, Path], *args: str, **env: str) -> dict[str, dict]:
    result = _run([str(installed["miles"]), "plugins", "--json", *args], env=_env(**env))
    return {p["name"]: p for p in json.loads(result.stdout)}


def test_miles_plugins_lists_the_installed_bridge(installed: dict[str, Path]) -> None:
    plugins = _plugins_json(installed)
    toy = plugins["toy"]
    assert (toy["distribution"], toy["version"], toy["status"]) == ("miles-toy-bridge", "0.3.1", "loaded")
    assert toy["hooks"] == ["miles_model_bridge"] and toy["module"] == "miles_toy_bridge.plugin"
    assert plugins["core"]["distribution"] == "miles-kernel"
    # The human table too: name, distribution, version, status, hooks on one row.
    table = _run([str(installed["miles"]), "plugins"], env=_env()).stdout
    row = next(line for line in table.splitlines() if line.startswith("toy "))
    assert row.split() == ["toy", "miles-toy-bridge", "0.3.1", "loaded", "model_bridge"]


def test_env_var_and_config_block_it(installed: dict[str, Path]) -> None:
    assert _plugins_json(installed, MILES_DISABLE_PLUGINS="toy")["toy"]["status"] == "blocked"
    assert _plugins_json(installed, "--config", str(installed["disable"]))["toy"]["status"] == "blocked"


def test_kernel_api_claims_blocks_and_allow_lists(installed: dict[str, Path]) -> None:
    script = textwrap.dedent(API_SCRIPT)
    result = _run([str(installed["python"]), "-c", script, str(installed["disable"]), str(installed["enable"])], env=_env())
    out = json.loads(result.stdout)
    assert out["claim"] == ["toy", "miles_toy_bridge.plugin", 16]
    assert "no model plugin recognises architecture ToyForCausalLM (model_type toy);" in out["disabled"]
    assert out["allow_list_claim"] == "toy"
    statuses = out["allow_list"]
    assert statuses["toy"] == "loaded" and statuses["core"] == "loaded"  # core is essential
    assert {s for name, s in statuses.items() if name not in {"toy", "core"}} == {"not enabled"}

    blocked = _run([str(installed["python"]), "-c", script, str(installed["disable"]), str(installed["enable"])],
                   env=_env(MILES_DISABLE_PLUGINS="toy"), check=False)
    assert blocked.returncode != 0 and "no model plugin recognises architecture" in blocked.stderr


def test_plugin_that_fails_to_import_names_itself_and_the_fix(installed: dict[str, Path]) -> None:
    broken = _run([str(installed["miles"]), "plugins"], env=_env(PYTHONPATH=str(installed["broken"])), check=False)
    assert broken.returncode == 2
    message = broken.stderr
    assert "plugin 'broken_import'" in message and "miles-broken-import 0.1.0" in message
    assert "ModuleNotFoundError" in message and "miles_toy_dependency_that_is_not_installed" in message
    assert "MILES_DISABLE_PLUGINS=broken_import" in message and "plugins.disable: [broken_import]" in message
    assert "Traceback" not in message  # an error message, not a crash
    # Doing what the message says works.
    fixed = _plugins_json(installed, PYTHONPATH=str(installed["broken"]), MILES_DISABLE_PLUGINS="broken_import")
    assert fixed["broken_import"]["status"] == "blocked" and fixed["toy"]["status"] == "loaded"


def test_misspelled_hook_names_itself_and_the_fix(installed: dict[str, Path]) -> None:
    typo = _run([str(installed["miles"]), "plugins"], env=_env(PYTHONPATH=str(installed["typo"])), check=False)
    assert typo.returncode == 2
    message = typo.stderr
    assert "plugin 'typo_bridge'" in message and "miles-typo-bridge 0.1.0" in message
    assert "miles_model_bridg" in message and "did you mean: miles_model_bridg -> miles_model_bridge" in message
    assert "MILES_DISABLE_PLUGINS=typo_bridge" in message
    fixed = _plugins_json(installed, PYTHONPATH=str(installed["typo"]), MILES_DISABLE_PLUGINS="typo_bridge")
    assert fixed["typo_bridge"]["status"] == "blocked"


def test_tutorial_package_installs_lists_and_fails_as_the_tutorial_shows(installed: dict[str, Path]) -> None:
    """docs/plugins/writing-a-plugin.md, section 6, against a real install of its example package."""
    text = (ROOT / "docs" / "plugins" / "writing-a-plugin.md").read_text()
    shown = dict(re.findall(r"<!-- output: (.+?) -->\n```\n(.*?)\n```", text, re.DOTALL))
    missing_dependency = _run([str(installed["miles"]), "plugins"], env=_env(PYTHONPATH=str(installed["acme"])), check=False)
    assert missing_dependency.returncode == 2
    assert missing_dependency.stderr.strip() == shown["import error"]

    both = os.pathsep.join([str(installed["acme"]), str(installed["llama"])])
    table = _run([str(installed["miles"]), "plugins"], env=_env(PYTHONPATH=both)).stdout.splitlines()
    header, acme = (line.split(maxsplit=4) for line in shown["miles plugins"].splitlines())
    assert table[0].split(maxsplit=4) == header
    assert next(line.split(maxsplit=4) for line in table if line.startswith("acme ")) == acme
