"""Transport ``sglang_lora``: LoRA adapters to SGLang engines, as a PEFT folder SGLang loads by name.

Under ``train.lora`` the trainer's ``named_weights()`` are the adapter tensors alone
(``...q_proj.lora_A.weight``). SGLang cannot take those as weight updates (its model has no
parameters of those names); it serves adapters next to its base, loaded from a PEFT folder
(``miles_sglang.lora``). One sync of version ``v``:

::

    write <run>/lora_adapters/v<v>/ (adapter_config.json + adapter_model.safetensors)   engines still generate
    pause_generation
    POST /load_lora_adapter {"lora_name": "miles-v<v>", "lora_path": <that folder>}
    update_weight_version(v)
    continue_generation
    POST /unload_lora_adapter {"lora_name": "miles-v<v-2>"}, remove its folder

The pause, flush, version and continue are :class:`~miles_weights.sync.BucketedTransport`'s; this
transport adds the load while paused and the retirement after. Version 0 (the sync a run makes
before its first step under ``weights.check``) is the base: nothing is loaded, and the adapters
must still be the identity. A version pushed again (engines restarted) is unloaded and loaded
anew; an unload an engine refuses (it restarted without the adapter) is logged, not fatal. Engines and trainer share the
machine or a filesystem: the folder's path is what SGLang opens. A folder stays until its adapter
is unloaded (at most three), so an engine that reads it lazily still finds it.

Check mode (``weights.check``) cannot ask SGLang for what it loaded: ``/weights_checker`` covers
the model's parameters only, not its LoRA memory pool, and no route returns adapter tensors. What
is checked is every byte up to SGLang's door: the folder is read back and each tensor's checksum
compared with the trainer's, and SGLang must answer the load with the adapter among its
``loaded_adapters``. The base is never noised (the sync does not restore it).
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles_contracts.weights import TransferReport, WeightBucket

from miles_weights.checksums import TensorTally, compare_checksums, tensor_checksum
from miles_weights.engines import normalize_targets
from miles_weights.errors import WeightCheckError, WeightSyncError
from miles_weights.sync import BucketedTransport, TransportOptions

if TYPE_CHECKING:
    import torch
    from miles_contracts import RunContext
    from miles_contracts.lora import LoRASpec

log = logging.getLogger(__name__)

ADAPTERS_DIR = "lora_adapters"


@dataclass(slots=True)
class WrittenAdapter:
    """One version's PEFT folder, and what went into it."""

    path: Path
    num_tensors: int
    num_bytes: int


class SGLangAdapterTransport(BucketedTransport):
    """Adapters of ``spec`` to SGLang engines through PEFT folders under ``directory``."""

    name = "sglang_lora"

    def __init__(self, directory: Path | str, spec: LoRASpec, base_model: str | None,
                 options: TransportOptions | None = None) -> None:
        super().__init__(options)
        self.directory = Path(directory).expanduser().resolve()
        self.spec = spec
        self.base_model = base_model
        self._loaded: tuple[WrittenAdapter, dict[str, dict[str, Any]]] | None = None  # the last load, for check mode
        self._versions: dict[str, int] = {}  # engine -> the newest version loaded there

    @classmethod
    def from_context(cls, ctx: RunContext) -> SGLangAdapterTransport:
        """The transport of the run of ``ctx``: its ``train.lora``, ``model.name`` and run folder."""
        config = ctx.config
        if config.train.lora is None:
            raise ValueError("weights.transport sglang_lora syncs LoRA adapters, but train.lora is not set; set "
                             "train.lora, or pick another weights.transport (disk, shared_memory, broadcast)")
        if config.rollout.engine != "sglang":
            raise ValueError(f"weights.transport sglang_lora loads adapters into SGLang engines, but rollout.engine is "
                             f"{config.rollout.engine!r}; the embedded engine takes adapters from every other transport "
                             "(e.g. weights.transport: shared_memory)")
        directory = ctx.require_run_dir("the sglang_lora transport") / ADAPTERS_DIR
        return cls(directory, config.train.lora, config.model.name, TransportOptions.from_config(config))

    def push(self, tensors: Iterable[tuple[str, torch.Tensor]], *, targets: Sequence[str] | str,
             version: int) -> TransferReport:
        """Load version ``version``'s adapter on every engine in ``targets`` (see the module
        docstring). Version 0 is the base every engine starts with: nothing is loaded, and the
        adapters must still be the identity (every ``lora_B`` zero, as initialised)."""
        if version == 0:
            return self._base_version(tensors)
        report = super().push(tensors, targets=targets, version=version)
        self._retire(normalize_targets(targets), version)
        return report

    def _base_version(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> TransferReport:
        start = time.perf_counter()
        tally = TensorTally(tensors, checksums=False)
        moved = [name for name, tensor in tally if ".lora_B." in name and bool(tensor.count_nonzero())]
        if moved:
            raise ValueError(f"version 0 is the base model, but {len(moved)} adapter(s) already change it "
                             f"({moved[0]}, ...): push trained adapters as version 1 or later")
        return TransferReport(version=0, num_tensors=tally.count, num_bytes=0, seconds=time.perf_counter() - start,
                              num_buckets=0, paused_seconds=0.0, checked_engines=())

    # ------------------------------------------------------------------ the sync's steps

    @contextmanager
    def _staged(self, buckets: Iterator[WeightBucket], version: int) -> Iterator[WrittenAdapter]:
        from miles_engine.lora import write_peft_adapter

        tensors: dict[str, torch.Tensor] = {}
        for bucket in buckets:
            tensors.update(bucket.tensors)
        final = self.directory / f"v{version}"
        partial = self.directory / f".v{version}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        shutil.rmtree(final, ignore_errors=True)  # a version pushed again (a retried sync) is rewritten
        try:
            write_peft_adapter(partial, tensors, self.spec, self.base_model)
            partial.rename(final)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
        yield WrittenAdapter(final, len(tensors), sum(t.numel() * t.element_size() for t in tensors.values()))

    def _deliver(self, staged: WrittenAdapter, urls: list[str], version: int) -> int:
        from miles_sglang.lora import adapter_name, load_call

        again = [url for url in urls if self._versions.get(url, 0) >= version]
        if again:  # the same version once more (an engine restarted): SGLang refuses a name it holds
            self._unload(again, adapter_name(version), f"version {version}: unload the adapter pushed before")
        call = load_call(version, str(staged.path))
        answers = self._calls.post_all(urls, call.path, call.body,
                                       step=f"version {version}: load LoRA adapter {call.body['lora_name']} from {staged.path}")
        self._versions.update(dict.fromkeys(urls, version))
        self._loaded = (staged, answers)
        return 1

    def _retire(self, urls: list[str], version: int) -> None:
        from miles_sglang.lora import KEPT_VERSIONS, retire_calls

        for call in retire_calls(version):
            self._unload(urls, call.body["lora_name"], f"version {version}: unload LoRA adapter {call.body['lora_name']}")
        shutil.rmtree(self.directory / f"v{version - KEPT_VERSIONS}", ignore_errors=True)

    def _unload(self, urls: list[str], name: str, step: str) -> None:
        """Unload ``name``; an engine that does not hold it (restarted since) is only logged: an
        adapter left loaded costs host memory, not correctness."""
        futures = self._calls.submit(urls, "POST", "/unload_lora_adapter", {"lora_name": name}, step=step)
        for url, future in futures.items():
            try:
                future.result()
            except WeightSyncError as exc:
                log.warning("engine %s did not unload LoRA adapter %s: %s", url, name, exc)

    # ------------------------------------------------------------------ check mode

    def _fill_noise(self, urls: list[str], version: int) -> None:
        return None  # the base is not part of a sync: noising it could never be undone

    def _verify(self, urls: list[str], tally: TensorTally, version: int) -> tuple[str, ...]:
        """The folder read back equals what the trainer sent, and every engine says it loaded it."""
        from miles_engine.lora import PEFT_PREFIX, PEFT_WEIGHTS
        from miles_sglang.lora import adapter_name
        from safetensors.torch import load_file

        if self._loaded is None:
            raise RuntimeError("check mode: no adapter was loaded in this sync")
        staged, answers = self._loaded
        written = {name.removeprefix(PEFT_PREFIX): tensor_checksum(tensor)
                   for name, tensor in load_file(str(staged.path / PEFT_WEIGHTS)).items()}
        lines = []
        diff = compare_checksums(tally.checksums, written, None, not_floating=tally.not_floating)
        if not diff.ok:
            lines.append(f"  - the adapter folder {staged.path}: {diff.describe()}")
        name = adapter_name(version)
        for url, answer in answers.items():
            loaded = answer.get("loaded_adapters")
            if not isinstance(loaded, dict) or name not in loaded:
                lines.append(f"  - engine {url}: answered the load without {name} among its loaded_adapters ({loaded!r})")
        if lines:
            raise WeightCheckError(f"check mode: the sglang_lora sync of version {version} is not proven (engines stay "
                                   "paused):\n" + "\n".join(lines), {url: [] for url in urls})
        return tuple(urls)


__all__ = ["ADAPTERS_DIR", "SGLangAdapterTransport"]
