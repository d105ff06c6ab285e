"""Thread-safe text <-> token ids: the HTTP thread encodes prompts while the scheduler thread
decodes for stop strings, and a fast tokenizer must not be entered by two threads at once."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


class TextCodec:
    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self._lock = threading.Lock()

    def encode(self, text: str) -> list[int]:
        with self._lock:
            return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        with self._lock:
            # transformers types decode as str | list[str] (a list of lists gives a list); one list gives a str
            return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)  # type: ignore[return-value]
