"""Which chat family a model uses: named explicitly, named by its model bridge, or claimed by type.

Order: an explicit name (``tito.family`` / ``--family``); else the ``chat_family`` of the model
bridge that claims the model's ``config.json``; else the one family whose ``model_types`` lists the
config's exact ``model_type``. Anything else is an error listing the registered families.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from miles.errors import MilesError
from miles_contracts.chat import ChatFamily

if TYPE_CHECKING:
    from miles.kernel import Kernel


class FamilyNotFound(MilesError):
    pass


def resolve_family(name: str | None = None, model_dir: str | Path | None = None, *, kernel: Kernel) -> ChatFamily:
    """The chat family named ``name``, else the one of the model in ``model_dir``, among those
    ``kernel`` registers (the kernel of the process asking: its run's plugin selection)."""
    registry = kernel.chat_families()
    if name:
        return registry.get(name)
    if model_dir is None:
        raise FamilyNotFound(f"no chat family given and no model to infer it from; registered: {registry.describe() or 'none'}")
    config = _read_config(Path(model_dir))
    bridge = kernel.find_model_bridge(config)
    bridge_family = bridge.chat_family if bridge is not None else None
    if bridge_family:
        return registry.get(bridge_family)
    model_type = config.get("model_type")
    claims = [e.obj for e in registry.entries() if model_type in e.obj.model_types]
    if len(claims) == 1:
        return claims[0]
    raise FamilyNotFound(
        f"cannot tell the chat family of {model_dir} (model_type {model_type!r}; "
        f"{'several families claim it' if claims else 'no family or bridge claims it'}); "
        f"choose one with tito.family / --family; registered: {registry.describe() or 'none'}"
    )


def family_of_tokenizer(tokenizer: Any, name: str | None = None, *, kernel: Kernel) -> ChatFamily:
    """The family for a loaded HF tokenizer (its folder names the model), among ``kernel``'s."""
    source = getattr(tokenizer, "name_or_path", None)
    return resolve_family(name, source if source and Path(source).is_dir() else None, kernel=kernel)


def _read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        raise FamilyNotFound(f"{model_dir} has no config.json; name the chat family with tito.family / --family") from None
    except json.JSONDecodeError as exc:
        raise FamilyNotFound(f"{path} is not valid JSON ({exc}); name the chat family with tito.family / --family") from None
