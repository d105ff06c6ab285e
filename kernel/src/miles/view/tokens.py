"""Token ids of a dumped row turned into what the page shows: text runs split by loss mask, with
the log-probs of every trained token.

A row's ``tokens`` are prompt + response; ``loss_mask`` and the log-prob lists cover the response
only (``response_tokens`` entries; ``miles_contracts.Sample``). Inside the response, mask 0 marks
what the model did not write (tool results, template tokens between turns), so the runs of equal
mask are the episode's turns and what came back between them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol


class Decoder(Protocol):
    """Turns token ids into text; :attr:`note` says where it came from (shown on the page)."""

    note: str

    def text(self, ids: list[int]) -> str: ...

    def pieces(self, ids: list[int]) -> list[str]: ...


class TokenizerDecoder:
    """Decodes with a ``tokenizers.Tokenizer`` (the fast path: no torch import) or a transformers
    tokenizer; special tokens are kept, they are where a chat template's turns begin and end."""

    def __init__(self, tokenizer: Any, source: str, *, fast: bool) -> None:
        self._tokenizer = tokenizer
        self._fast = fast
        self.note = f"tokens decoded with the tokenizer of {source}"

    def text(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=False))

    def pieces(self, ids: list[int]) -> list[str]:
        # one token at a time: a character split over two tokens shows as U+FFFD in each
        singles = [[i] for i in ids]
        if self._fast:
            return [str(p) for p in self._tokenizer.decode_batch(singles, skip_special_tokens=False)]
        return [str(p) for p in self._tokenizer.batch_decode(singles, skip_special_tokens=False)]


class IdDecoder:
    """The fallback when no tokenizer loads: ids as text, so the mask and log-probs still show."""

    def __init__(self, why: str) -> None:
        self.note = f"token ids shown, not text: {why}"

    def text(self, ids: list[int]) -> str:
        return " ".join(f"[{i}]" for i in ids)

    def pieces(self, ids: list[int]) -> list[str]:
        return [f"[{i}] " for i in ids]


def load_decoder(run_dir: Path, tokenizer: str | None, model: str | None) -> Decoder:
    """The tokenizer of the folder ``tokenizer`` (``"none"``: ids), else of the run's model
    resolved as ``miles train`` resolves it; ids when that fails (the reason goes on the page).

    A folder's ``tokenizer.json`` is read with ``tokenizers`` alone (under a second; importing
    transformers costs ten on a busy machine), other folders with transformers, kept offline:
    a report must not depend on the network."""
    if tokenizer == "none":
        return IdDecoder("--tokenizer none")
    name = tokenizer or model
    if name is None:
        return IdDecoder(f"{run_dir / 'config.yaml'} names no model.name; pass --tokenizer FOLDER")
    try:
        folder = Path(tokenizer) if tokenizer is not None else _model_folder(name)
        if (folder / "tokenizer.json").is_file():
            from tokenizers import Tokenizer

            return TokenizerDecoder(Tokenizer.from_file(str(folder / "tokenizer.json")), name, fast=True)
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from transformers import AutoTokenizer

        return TokenizerDecoder(AutoTokenizer.from_pretrained(folder), name, fast=False)
    except ImportError as exc:  # the kernel alone has neither library (a model or train plugin brings them)
        return IdDecoder(f"the tokenizer of {name!r} needs {exc.name or 'tokenizers'}, which is not installed")
    except Exception as exc:  # any failure to find or read it leaves ids, which still show everything else
        return IdDecoder(f"the tokenizer of {name!r} did not load ({type(exc).__name__}: {exc}); pass --tokenizer FOLDER")


def _model_folder(name: str) -> Path:
    from miles.kernel import Kernel

    return Kernel.load().resolve_model(name)


GAP_BANDS = (0.01, 0.1, 0.5)
"""|train - rollout| log-prob bands of the gap colours: <0.01 (agree), <0.1, <0.5, >=0.5."""


@dataclass(slots=True)
class TrainedToken:
    text: str
    token_id: int
    rollout_logprob: float | None
    train_logprob: float | None

    @property
    def gap_band(self) -> int | None:
        if self.rollout_logprob is None or self.train_logprob is None:
            return None
        gap = abs(self.train_logprob - self.rollout_logprob)
        return sum(gap >= edge for edge in GAP_BANDS)


@dataclass(slots=True)
class Run:
    """A stretch of the response with one mask value: a turn the model wrote (``trained``, its
    tokens one by one) or what came between (``text``)."""

    trained: bool
    text: str = ""
    tokens: list[TrainedToken] = field(default_factory=list)


@dataclass(slots=True)
class RowTokens:
    prompt_text: str
    prompt_cut: int  # leading prompt tokens not shown
    runs: list[Run]
    response_cut: int  # trailing response tokens not shown
    has_train_logprobs: bool


def row_tokens(row: dict[str, Any], decoder: Decoder, max_tokens: int) -> RowTokens | None:
    """The row's tokens split for display, or None when the dump holds no token ids
    (``run.dump_tokens`` was off) or they do not line up with the mask."""
    tokens, mask = row.get("tokens"), row.get("loss_mask")
    n = row.get("response_tokens")
    if not isinstance(tokens, list) or not isinstance(mask, list) or not isinstance(n, int):
        return None
    if not 0 <= n <= len(tokens) or len(mask) != n:
        return None
    rollout = _floats(row.get("rollout_logprobs"), n)
    train = _floats(row.get("train_logprobs"), n)
    prompt = tokens[: len(tokens) - n]
    shown_prompt = prompt[-max_tokens:] if max_tokens > 0 else []
    shown = min(n, max_tokens)
    response = tokens[len(tokens) - n:][:shown]
    runs: list[Run] = []
    start = 0
    while start < shown:
        end = start
        while end < shown and bool(mask[end]) == bool(mask[start]):
            end += 1
        ids = response[start:end]
        if mask[start]:
            pieces = decoder.pieces(ids)
            runs.append(Run(True, tokens=[
                TrainedToken(pieces[k], ids[k], rollout[start + k] if rollout else None, train[start + k] if train else None)
                for k in range(len(ids))
            ]))
        else:
            runs.append(Run(False, text=decoder.text(ids)))
        start = end
    return RowTokens(decoder.text(shown_prompt), len(prompt) - len(shown_prompt), runs, n - shown, bool(train))


def _floats(values: Any, n: int) -> list[float] | None:
    if not isinstance(values, list) or len(values) != n:
        return None
    return [float(v) if isinstance(v, (int, float)) else 0.0 for v in values]
