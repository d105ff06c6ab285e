"""The served model's weights by name: load updates, checksum, fill with noise.

**Names an update may use.** Checkpoint names, as HF checkpoints store them and trainers send
them (FSDP's named weights are these): for most models the keys of the transformers model's
``state_dict()`` (``model.layers.0.mlp.gate_proj.weight`` ...). Where transformers fuses weights
at load time, an MoE layer's per-expert ``mlp.experts.<e>.gate_proj.weight`` / ``up_proj`` /
``down_proj`` (transformers 5 holds them as one ``experts.gate_up_proj [E, 2I, H]`` and one
``experts.down_proj [E, H, I]``), each checkpoint tensor is copied into its slice of the fused
parameter; this layout is confirmed against transformers' own reverse conversion when the store
is built. Also accepted: the runtime names of the fused tensors as a whole, and tied aliases
(``lm_head.weight`` when the head shares the input embedding), which load into the tensor they
share.

**Checksums and noise cover each synced byte once.** (With LoRA adapters attached
(:mod:`miles_engine.lora`) a sync carries the adapter tensors only, and so do checksums and noise.) :meth:`WeightStore.checksums` reports every
checkpoint name once and never a tied alias (its bytes are its partner's), which is what a trainer
sends: a tied head travels once, under the embedding's name. A tie the config declares but whose
tensors do not share storage is kept by copying after each update and noise fill.

Every update is checked whole (names, shapes) before the first tensor is copied, so a bad request
changes nothing. All methods run on the scheduler thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

log = logging.getLogger(__name__)

# transformers 5's fused MoE experts: runtime leaf name -> the checkpoint projections stacked along
# dim 1, in order ([E, 2I, H] = gate rows then up rows; [E, H, I] = down). Dim 0 is the expert.
FUSED_EXPERTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


class WeightUpdateError(ValueError):
    """An update names tensors the model lacks, or gives the wrong shape; nothing was changed."""


def parse_dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise WeightUpdateError(f"unknown dtype {name!r}; use torch names such as 'bfloat16' or 'float32'")
    return dtype


def noise_generator(seed: int) -> torch.Generator:
    """The generator of a noise fill. The seed is hashed first: a plain ``manual_seed(seed)`` would
    draw exactly the weights of a model initialised as ``randn(generator=manual_seed(seed)) * 0.02``
    (as ``miles bench weights`` builds its random models), and check mode could then not tell a
    restored tensor from one left as noise."""
    import torch

    salted = int.from_bytes(hashlib.sha256(f"miles-weight-noise:{seed}".encode()).digest()[:8], "little")
    return torch.Generator().manual_seed(salted & ((1 << 63) - 1))


def fused_expert_views(tensors: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """For each fused expert tensor in ``tensors`` (runtime name -> tensor), its checkpoint names
    and the views of it that hold them (writing a view writes the fused tensor)."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        base, _, leaf = name.rpartition(".")
        projections = FUSED_EXPERTS.get(leaf)
        if projections is None or not base.endswith(".experts") or tensor.dim() != 3:
            continue
        if tensor.shape[1] % len(projections):
            continue
        rows = tensor.shape[1] // len(projections)
        out[name] = {f"{base}.{expert}.{projection}.weight": tensor[expert, i * rows:(i + 1) * rows]
                     for expert in range(tensor.shape[0]) for i, projection in enumerate(projections)}
    return out


def _agrees_with_transformers(model: PreTrainedModel, tensors: dict[str, torch.Tensor],
                              views: dict[str, dict[str, torch.Tensor]]) -> bool:
    """Whether transformers' reverse conversion of one fused layer gives exactly these checkpoint
    names and bytes (one layer suffices: every layer is built by the same class)."""
    import torch

    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:  # a transformers without load-time conversions would not hold fused experts
        return True
    base = next(iter(views)).rpartition(".")[0]
    group = {name: tensors[name] for name in views if name.rpartition(".")[0] == base}
    expected = {ckpt: view for name in group for ckpt, view in views[name].items()}
    try:
        with torch.no_grad():
            reverted = revert_weight_conversion(model, dict(group))
    except Exception as exc:  # noqa: BLE001 (any failure means: do not trust the layout)
        log.warning("transformers' reverse conversion of %s failed (%s: %s)", base, type(exc).__name__, exc)
        return False
    return set(reverted) == set(expected) and all(
        tuple(reverted[n].shape) == tuple(v.shape) and torch.equal(reverted[n].to(v.device), v)
        for n, v in expected.items())


def _view_key(tensor: torch.Tensor) -> tuple:
    """Equal for two tensors that are the same bytes (same storage, offset, shape, strides, dtype)."""
    return (tensor.device, tensor.dtype, tensor.untyped_storage().data_ptr(), tensor.storage_offset(),
            tuple(tensor.shape), tuple(tensor.stride()))


class WeightStore:
    """The model's tensors by every name an update may use.

    :ivar stored: one runtime name per storage (tied aliases removed), in ``state_dict`` order;
        what the noise fill covers.
    :ivar checkpoint: the names checksums report, each a distinct region of bytes: ``stored`` with
        each fused expert tensor replaced by its per-expert checkpoint views.
    :ivar aliases: tied alias -> the stored name it loads into.
    :ivar targets: every accepted name -> the tensor (or view) an update copies into.
    """

    def __init__(self, model: PreTrainedModel) -> None:
        self.model = model
        runtime = {name: tensor.detach() for name, tensor in model.state_dict(keep_vars=True).items()}
        tied = {t: s for t, s in (getattr(model, "all_tied_weights_keys", None) or {}).items()
                if t in runtime and s in runtime}  # target (e.g. lm_head.weight) -> source
        self.aliases: dict[str, str] = {}
        owner: dict[tuple, str] = {}
        for name in sorted(runtime, key=lambda n: n in tied):  # stable: a tie's source names the storage
            key = _view_key(runtime[name])
            if key in owner:
                self.aliases[name] = owner[key]
            else:
                owner[key] = name
        self.stored = {name: tensor for name, tensor in runtime.items() if name not in self.aliases}
        # A tie the config declares whose tensors do not share storage: load and fill the source,
        # then copy it into the target, so the two stay equal as the model expects.
        self.followers: dict[str, list[torch.Tensor]] = {}
        for target, source in tied.items():
            source = self.aliases.get(source, source)
            if target in self.stored and source in self.stored and source != target \
                    and self.stored[target].shape == self.stored[source].shape:
                self.followers.setdefault(source, []).append(self.stored.pop(target))
                self.aliases[target] = source
        views = fused_expert_views(self.stored)
        if views and not _agrees_with_transformers(model, self.stored, views):
            log.warning("fused MoE experts do not match the known checkpoint layout; tensor updates must use "
                        "the runtime names (%s ...), or load checkpoints from disk", next(iter(views)))
            views = {}
        self.checkpoint: dict[str, torch.Tensor] = {}
        self._owner: dict[str, str] = {}  # accepted name -> the stored name whose bytes it writes
        for name, tensor in self.stored.items():
            for ckpt, view in views.get(name, {name: tensor}).items():
                self.checkpoint[ckpt] = view
                self._owner[ckpt] = name
        self.targets: dict[str, torch.Tensor] = dict(self.checkpoint)
        for name, tensor in self.stored.items():
            self.targets.setdefault(name, tensor)
            self._owner.setdefault(name, name)
        for alias, source in self.aliases.items():
            self.targets[alias] = self.stored[source]
            self._owner[alias] = source
        self.changed: set[int] = set()  # see take_changed
        # With LoRA the base is loaded once and never synced: check mode covers what a sync sends
        from miles_engine.lora import is_adapter_tensor

        adapters = {name for name in self.checkpoint if is_adapter_tensor(name)}
        self.synced: dict[str, torch.Tensor] = {n: t for n, t in self.checkpoint.items() if not adapters or n in adapters}
        self.noised: dict[str, torch.Tensor] = {n: t for n, t in self.stored.items() if not adapters or n in adapters}

    # ------------------------------------------------------------------ updates

    def check(self, shapes: Iterable[tuple[str, tuple[int, ...]]]) -> None:
        unknown, wrong = [], []
        for name, shape in shapes:
            target = self.targets.get(name)
            if target is None:
                unknown.append(name)
            elif tuple(target.shape) != tuple(shape):
                wrong.append(f"{name}: sent {list(shape)}, model has {list(target.shape)}")
        problems = []
        if unknown:
            problems.append(f"{len(unknown)} unknown tensor name(s) {_preview(unknown)} (the engine takes checkpoint "
                            f"names, e.g. {next(iter(self.checkpoint))!r}, the transformers model's state_dict names, "
                            "or tied aliases)")
        if wrong:
            problems.append(f"{len(wrong)} shape mismatch(es): {_preview(wrong)}")
        if problems:
            raise WeightUpdateError("weight update rejected, nothing was loaded: " + "; ".join(problems))

    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy each tensor into the model (cast to the model's dtype and device); returns how
        many. Call :meth:`check` first."""
        import torch

        count = 0
        touched: set[str] = set()
        try:
            with torch.no_grad():
                for name, tensor in named:
                    touched.add(self._owner[name])
                    self.targets[name].copy_(tensor, non_blocking=False)
                    count += 1
                self._copy_to_followers(touched)
        finally:  # what a failed load wrote before failing changed too
            self.changed.update(self.stored[name].untyped_storage().data_ptr() for name in touched)
            self.changed.update(f.untyped_storage().data_ptr() for name in touched for f in self.followers.get(name, ()))
        return count

    def take_changed(self) -> set[int]:
        """Storages (``untyped_storage().data_ptr()``) :meth:`load` wrote since the last call."""
        changed, self.changed = self.changed, set()
        return changed

    def load_checked(self, named: list[tuple[str, torch.Tensor]]) -> int:
        self.check((n, tuple(t.shape)) for n, t in named)
        return self.load(named)

    def load_from_disk(self, folder: str | Path) -> int:
        """Load every tensor of the safetensors files in ``folder``. Files in a naming this store
        takes (checkpoint or runtime names) load directly; any other Hugging Face layout goes
        through transformers' loader first."""
        from safetensors import safe_open

        files = _safetensors_files(Path(folder))
        names: dict[str, tuple[int, ...]] = {}
        for file in files:
            with safe_open(file, framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    names[key] = tuple(f.get_slice(key).get_shape())
        if all(name in self.targets for name in names):
            self.check(names.items())
            count = 0
            for file in files:
                with safe_open(file, framework="pt") as f:
                    count += self.load((key, f.get_tensor(key)) for key in f.keys())  # noqa: SIM118
            return count
        return self._load_checkpoint(folder)

    def _load_checkpoint(self, folder: str | Path) -> int:
        from transformers import AutoModelForCausalLM

        dtype = next(iter(self.stored.values())).dtype
        try:
            other = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map="cpu", use_safetensors=True)
        except Exception as exc:
            raise WeightUpdateError(f"cannot load {folder} as a checkpoint of this model: {exc}") from exc
        state = other.state_dict()
        self.check((n, tuple(t.shape)) for n, t in state.items())
        return self.load(state.items())

    # ------------------------------------------------------------------ check mode

    def checksums(self) -> dict[str, str]:
        """SHA-256 of each synced checkpoint tensor's raw bytes (contiguous, row-major, own dtype), by
        name; tied aliases are not listed (their bytes are their partner's)."""
        import torch

        out = {}
        for name, tensor in self.synced.items():
            raw = tensor.contiguous().reshape(-1).view(torch.uint8).cpu()
            out[name] = hashlib.sha256(raw.numpy().data).hexdigest()  # .data: the buffer, typed (no copy)
        return out

    def fill_noise(self, seed: int) -> int:
        """Overwrite every floating-point storage once with N(0, 0.02) noise drawn from
        :func:`noise_generator` (same bits on any device); returns how many tensors."""
        import torch

        generator = noise_generator(seed)
        seen: set[int] = set()
        with torch.no_grad():
            for tensor in self.noised.values():
                if tensor.data_ptr() in seen or not tensor.is_floating_point():
                    continue
                seen.add(tensor.data_ptr())
                noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * 0.02
                tensor.copy_(noise)
            self._copy_to_followers(self.followers)
        return len(seen)

    def _copy_to_followers(self, sources: Iterable[str]) -> None:
        for source in sources:
            for follower in self.followers.get(source, ()):
                follower.copy_(self.stored[source])


def confined(path: str | Path, allowed: list[Path]) -> Path:
    """``path`` resolved (symlinks, ``..``), if it lies inside one of the ``allowed`` folders
    (resolved already); a :class:`WeightUpdateError` naming them otherwise."""
    try:
        resolved = Path(path).expanduser().resolve()
    except (ValueError, RuntimeError, OSError) as exc:  # a NUL byte; "~user" of no such user
        raise WeightUpdateError(f"model_path {str(path)!r} is not a usable path on the engine's host: {exc}") from None
    if not any(resolved == root or resolved.is_relative_to(root) for root in allowed):
        roots = ", ".join(str(r) for r in allowed) or "none"
        raise WeightUpdateError(f"model_path {str(path)!r} is outside the folders this engine may load weights from "
                                f"({roots}); start the engine with --weight-dir <folder> (config engine.weight_dir) "
                                "to allow another")
    return resolved


def _safetensors_files(folder: Path) -> list[str]:
    if not folder.is_dir():
        raise WeightUpdateError(f"model_path {str(folder)!r} is not a folder on the engine's host")
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise WeightUpdateError(f"{index} is not a safetensors index ({type(exc).__name__}: {exc})") from None
        files = [_shard(folder, shard) for shard in shards]
    else:
        files = [_shard(folder, f.name) for f in sorted(folder.glob("*.safetensors"))]
    if not files:
        raise WeightUpdateError(f"no *.safetensors files in {folder}")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise WeightUpdateError(f"the index in {folder} names missing shards: {_preview(missing)}")
    return [str(f) for f in files]


def _shard(folder: Path, name: object) -> Path:
    """A shard an index names: a file name inside ``folder`` (no path, no link out of it)."""
    root = folder.resolve()
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise WeightUpdateError(f"the index in {folder} names shard {name!r}; shards must be plain file names in its folder")
    path = (folder / name).resolve()
    if path.parent != root:
        raise WeightUpdateError(f"shard {name!r} of the index in {folder} resolves outside the folder ({path})")
    return path


def _preview(items: list[str], limit: int = 5) -> str:
    shown = ", ".join(items[:limit])
    return shown + (f", ... ({len(items) - limit} more)" if len(items) > limit else "")
