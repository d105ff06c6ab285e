"""The local model cache: ``$MILES_HOME/models/<name>/`` (default ``~/.cache/miles``).

A cached model is a Hugging Face folder (config.json, safetensors, tokenizer files, chat template)
plus ``miles-model.json``, written last: a folder without it is an interrupted conversion and is
ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

MARKER = "miles-model.json"


def miles_home() -> Path:
    return Path(os.environ.get("MILES_HOME") or Path.home() / ".cache" / "miles")


def models_dir() -> Path:
    return miles_home() / "models"


@dataclass(frozen=True, slots=True)
class CachedModel:
    name: str
    path: Path
    source: str
    size_bytes: int


def cached_path(name: str) -> Path | None:
    path = models_dir() / name
    return path if (path / MARKER).is_file() else None


def list_cached() -> list[CachedModel]:
    root = models_dir()
    out: list[CachedModel] = []
    if not root.is_dir():
        return out
    for path in sorted(root.iterdir()):
        marker = path / MARKER
        if not marker.is_file():
            continue
        info = json.loads(marker.read_text())
        size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
        out.append(CachedModel(path.name, path, info.get("source", "?"), size))
    return out


def write_marker(path: Path, name: str, source: str) -> None:
    (path / MARKER).write_text(json.dumps({"name": name, "source": source}, indent=2))
