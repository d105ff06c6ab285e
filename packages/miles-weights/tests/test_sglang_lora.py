"""The ``sglang_lora`` transport: trained adapters to SGLang engines as a PEFT folder, loaded by name.

SGLang needs a GPU, so the engine here is a STAND-IN: a real HTTP server on loopback that only
records the calls it gets (path, body, whether the run's token came with them) and answers them as
SGLang 0.5 does (``/load_lora_adapter`` -> ``{"success", "error_message", "loaded_adapters"}``).
It copies the folder it is told to load, so the test can load that copy with ``peft`` later. What
a real server does with the calls is checked by ``scripts/h200/sglang_lora.py`` on the H200.
"""

from __future__ import annotations

import json
import shutil
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import torch
from miles_contracts.lora import LoRASpec
from miles_contracts.wire.auth import TOKEN_ENV
from miles_weights.adapters import SGLangAdapterTransport
from miles_weights.errors import WeightCheckError, WeightSyncError
from miles_weights.sync import TransportOptions

TOKEN = "a-run-token-of-the-test-0123456789"
SPEC = LoRASpec(rank=4, alpha=8.0, target_modules=["q_proj", "down_proj"])


class StandinSGLang:
    """See the module docstring."""

    def __init__(self, copies: Path) -> None:
        self.calls: list[tuple[str, dict[str, Any], bool]] = []
        self.refuse_load = False
        self.loaded: dict[str, str] = {}
        self.copies = copies
        standin = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers.get("content-length", 0))) or b"{}")
                authorized = self.headers.get("Authorization") == f"Bearer {TOKEN}"
                standin.calls.append((self.path, body, authorized))
                status, answer = standin.answer(self.path, body)
                data = json.dumps(answer).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def answer(self, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        if path == "/load_lora_adapter":
            if self.refuse_load:
                return 400, {"success": False, "error_message": "LoRA adapter rank 4 exceeds --max-lora-rank 2"}
            shutil.copytree(body["lora_path"], self.copies / body["lora_name"], dirs_exist_ok=True)
            self.loaded[body["lora_name"]] = body["lora_path"]
            return 200, {"success": True, "error_message": "", "loaded_adapters": dict(self.loaded)}
        if path == "/unload_lora_adapter":
            if self.loaded.pop(body["lora_name"], None) is None:
                return 400, {"success": False, "error_message": f"LoRA adapter {body['lora_name']} is not loaded"}
            return 200, {"success": True, "error_message": "", "loaded_adapters": dict(self.loaded)}
        return 200, {"success": True, "message": "ok"}

    def paths(self) -> list[str]:
        return [path for path, _, _ in self.calls]


@pytest.fixture
def standin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[StandinSGLang]:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    (tmp_path / "copies").mkdir()
    server = StandinSGLang(tmp_path / "copies")
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


@pytest.fixture(scope="module")
def adapted(tiny_dir: Path) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The tiny model with adapters (B made non-zero, as after training) and those adapter tensors."""
    from miles_engine.lora import attach_lora
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32).eval()
    attach_lora(model, SPEC)
    generator = torch.Generator().manual_seed(0)
    adapters = {}
    for name, param in model.named_parameters():
        if ".lora_" in name:
            with torch.no_grad():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
            adapters[name] = param.detach().clone()
    return model, adapters


def _transport(tmp_path: Path, **options: Any) -> SGLangAdapterTransport:
    return SGLangAdapterTransport(tmp_path / "run" / "lora_adapters", SPEC, "tiny", TransportOptions(**options))


def test_each_sync_loads_its_adapter_while_paused_and_retires_the_one_before_last(
        standin: StandinSGLang, adapted: Any, tiny_dir: Path, tmp_path: Path) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model, adapters = adapted
    with _transport(tmp_path, pause_mode="in_place") as transport:
        for version in (1, 2, 3):
            report = transport.push(adapters.items(), targets=[standin.url], version=version)
            assert report.num_tensors == len(adapters) and report.version == version
    folder = str(tmp_path / "run" / "lora_adapters" / "v{}")
    load = [("/load_lora_adapter", {"lora_name": f"miles-v{v}", "lora_path": folder.format(v)}) for v in (1, 2, 3)]
    sync = ["/pause_generation", "/load_lora_adapter", "/update_weight_version", "/continue_generation"]
    assert standin.paths() == sync * 3 + ["/unload_lora_adapter"]  # v1 goes once v3 serves; v2 stays
    bodies = [(path, body) for path, body, _ in standin.calls]
    assert [c for c in bodies if c[0] == "/load_lora_adapter"] == load
    assert bodies[-1] == ("/unload_lora_adapter", {"lora_name": "miles-v1"})
    assert ("/update_weight_version", {"new_version": "3", "abort_all_requests": False}) in bodies
    assert all(authorized for _, _, authorized in standin.calls)  # every call carries the run's token
    assert sorted(p.name for p in (tmp_path / "run" / "lora_adapters").iterdir()) == ["v2", "v3"]

    # what SGLang was handed is a PEFT adapter that gives the trainer's model
    base = AutoModelForCausalLM.from_pretrained(str(tiny_dir), dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(base, str(standin.copies / "miles-v3")).eval()
    tokens = torch.tensor([[1, 5, 9, 3, 7, 2]])
    with torch.no_grad():
        torch.testing.assert_close(peft_model(input_ids=tokens).logits, model(input_ids=tokens).logits,
                                   rtol=0, atol=1e-5)


def test_a_refused_load_names_the_engine_and_leaves_it_paused(standin: StandinSGLang, adapted: Any,
                                                              tmp_path: Path) -> None:
    standin.refuse_load = True
    with _transport(tmp_path) as transport, pytest.raises(WeightSyncError) as error:
        transport.push(adapted[1].items(), targets=[standin.url], version=1)
    message = str(error.value)
    assert f"version 1: load LoRA adapter miles-v1 from {tmp_path}" in message
    assert f"engine {standin.url} rejected POST /load_lora_adapter with HTTP 400" in message
    assert "exceeds --max-lora-rank 2" in message  # SGLang's own reason
    assert standin.paths()[-1] == "/load_lora_adapter"  # never continued: nothing serves a half-loaded version


def test_version_0_is_the_base_and_a_version_pushed_again_is_reloaded(standin: StandinSGLang, adapted: Any,
                                                                      tmp_path: Path) -> None:
    identity = {name: torch.zeros_like(t) if ".lora_B." in name else t for name, t in adapted[1].items()}
    with _transport(tmp_path, pause_mode="in_place") as transport:
        with pytest.raises(ValueError, match="version 0 is the base model, but .* adapter"):
            transport.push(adapted[1].items(), targets=[standin.url], version=0)
        report = transport.push(identity.items(), targets=[standin.url], version=0)  # weights.check's first sync
        assert (report.num_tensors, report.num_bytes, standin.calls) == (len(identity), 0, [])
        transport.push(adapted[1].items(), targets=[standin.url], version=1)
        standin.loaded.clear()  # the engine restarted: the run pushes the version it serves again
        transport.push(adapted[1].items(), targets=[standin.url], version=1)
        # unloaded first (refused: the restarted engine lacks it; logged, not fatal), then loaded anew
        assert standin.paths()[-5:] == ["/pause_generation", "/unload_lora_adapter", "/load_lora_adapter",
                                        "/update_weight_version", "/continue_generation"]
        assert standin.loaded == {"miles-v1": str(tmp_path / "run" / "lora_adapters" / "v1")}


def test_the_run_builds_the_transport_only_for_lora_on_sglang(tmp_path: Path) -> None:
    from miles.config import build_config
    from miles.kernel import Kernel
    from miles_contracts import Process, RunContext

    kernel = Kernel.load()
    ctx = RunContext(build_config({"weights": {"transport": "sglang_lora"}}, kernel=kernel), kernel,
                     Process.trainer_rank(0), tmp_path)
    with pytest.raises(ValueError, match="train.lora is not set"):
        SGLangAdapterTransport.from_context(ctx)
    embedded = build_config({"weights": {"transport": "sglang_lora"}, "train": {"lora": {"rank": 4}}}, kernel=kernel)
    with pytest.raises(ValueError, match="rollout.engine is 'embedded'"):
        SGLangAdapterTransport.from_context(RunContext(embedded, kernel, Process.trainer_rank(0), tmp_path))
    on_sglang = build_config({"weights": {"transport": "sglang_lora"}, "train": {"lora": {"rank": 4}},
                              "rollout": {"engine": "sglang"}}, kernel=kernel)
    transport = SGLangAdapterTransport.from_context(RunContext(on_sglang, kernel, Process.trainer_rank(0), tmp_path))
    assert transport.directory == tmp_path.resolve() / "lora_adapters" and transport.spec.rank == 4


def test_check_mode_proves_the_folder_and_the_engines_answer(standin: StandinSGLang, adapted: Any,
                                                             tmp_path: Path) -> None:
    with _transport(tmp_path, check=True) as transport:
        report = transport.push(adapted[1].items(), targets=[standin.url], version=1)
        assert report.checked_engines == (standin.url,)
        assert "/weights_checker" not in standin.paths()  # the base is never noised
        standin.loaded.clear()
        standin.answer = lambda path, body: (200, {"success": True, "loaded_adapters": {}})  # type: ignore[method-assign]
        with pytest.raises(WeightCheckError, match=r"without miles-v2 among its loaded_adapters"):
            transport.push(adapted[1].items(), targets=[standin.url], version=2)
