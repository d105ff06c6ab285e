"""Long texts in a server that tokenizes: refuse what cannot fit before tokenizing it, and tokenize
the rest without stalling the event loop.

Both the embedded engine (``/generate`` with ``text``) and the session server (chat messages)
tokenize what clients send. Measured on the 2-core test machine with SmolLM2's tokenizer:
tokenizing costs ~1.3 us per character of English and ~7 us per emoji, so one 8 MB message held
the session server's event loop for 30 s under load, and a 30 MB ``text`` held the engine's
tokenizer lock for 157 s, while its event loop waited on that lock to decode the next finished
request's text (``/health`` included, everything stopped). Two measures:

* :func:`chars_per_token_bound`: no token stands for more characters than the longest entry of
  the vocabulary, so a text of ``n`` characters is at least ``n / bound`` tokens. A text whose
  lower bound already exceeds the context can be refused at once, without tokenizing it.
* :class:`TokenizerThread`: longer texts are tokenized on one worker thread, with a private copy
  of the tokenizer, through ``encode_batch_fast``. A thread alone would not help: the Rust
  binding's ``encode`` holds the GIL for the whole call (a 2.2 MB text took 7 s, during which
  another thread ran 3 times), ``encode_batch_fast`` releases it. The private copy keeps the
  caller's tokenizer (and any lock around it) free, and one thread caps long texts at one core,
  however many arrive at once (they queue). It runs at a lower priority (``WORKER_NICENESS``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import queue
import sys
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

LONG_TEXT_CHARS = 4096
"""Texts longer than this go to the worker thread; shorter ones cost less than the thread hop
(~5 ms at the rate above)."""

WORKER_NICENESS = 10
"""The worker thread's nice value (Linux): when the cores are busy, the scheduler gives it about a
tenth of what the event loop and the model get, so a long text slows other requests less (and
waits longer itself)."""

_COMPOSING_NORMALIZER = 3
"""How many input characters a normalizer may fold into one: Unicode composition turns a letter
and two combining marks, or a Hangul lead, vowel and tail, into one character."""

_SWALLOW_PROBES = (" " * 512, "\t" * 512, "\n" * 512, "\r\n" * 256, "\x00" * 512, "\x07" * 512,
                   "\u200b" * 512, "\ufeff" * 512, "\u0301" * 512, "\u3000" * 512)
"""Texts a tokenizer could drop or collapse (whitespace, control and zero-width characters,
stray combining marks), as BERT's normalizer and SentencePiece's whitespace folding do; for such a
tokenizer the length of a text says nothing about its token count."""


def chars_per_token_bound(tokenizer: PreTrainedTokenizerBase) -> int | None:
    """The most characters of input text one token of ``tokenizer`` can stand for, or None when
    that cannot be bounded (a slow tokenizer, or one that drops or collapses some characters).

    The longest vocabulary entry (added tokens included) bounds it: byte-level vocabularies store
    one character per byte, SentencePiece ones one per character (byte-fallback entries more). A
    normalizer may fold a few characters into one first (times ``_COMPOSING_NORMALIZER``). Checked
    on texts a tokenizer could swallow: if one comes out as fewer tokens than the bound allows,
    there is no bound.
    """
    if not tokenizer.is_fast:
        return None
    backend = tokenizer.backend_tokenizer
    longest = max((len(entry) for entry in backend.get_vocab(with_added_tokens=True)), default=1)
    bound = longest * (_COMPOSING_NORMALIZER if backend.normalizer is not None else 1)
    for probe in _SWALLOW_PROBES:
        tokens = len(backend.encode(probe, add_special_tokens=False).ids)
        if len(probe) > tokens * bound:
            return None
    return bound


def min_tokens(chars: int, bound: int | None) -> int:
    """The fewest tokens a text of ``chars`` characters can be, given :func:`chars_per_token_bound`
    (0 when there is no bound)."""
    return 0 if bound is None else math.ceil(chars / bound)


class TokenizerThread:
    """``await thread.encode(text)``: the token ids of ``text``, computed on a worker thread.

    The thread (a daemon: a server that stops does not wait for a text being tokenized) starts on
    the first call and builds its own copy of ``tokenizer``; texts queue, one at a time. A call
    whose caller went away (cancelled) before its turn is skipped. Any event loop may call it.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, *, add_special_tokens: bool, name: str) -> None:
        self._tokenizer = tokenizer
        self._add_special_tokens = add_special_tokens
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[str, asyncio.AbstractEventLoop, asyncio.Future[list[int]]]] = (
            queue.SimpleQueue())
        self._started = False
        self._start_lock = threading.Lock()

    async def encode(self, text: str) -> list[int]:
        loop = asyncio.get_running_loop()
        done: asyncio.Future[list[int]] = loop.create_future()
        self._start()
        self._jobs.put((text, loop, done))
        return await done

    def _start(self) -> None:
        with self._start_lock:
            if not self._started:
                threading.Thread(target=self._serve, name=self._name, daemon=True).start()
                self._started = True

    def _serve(self) -> None:
        if sys.platform == "linux":  # where nice is per thread: on a busy machine, small requests first
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), WORKER_NICENESS)
        encode = self._private_encoder()
        while True:
            text, loop, done = self._jobs.get()
            if done.cancelled():  # the caller is gone; nobody waits for these ids
                continue
            try:
                result: list[int] | BaseException = encode(text)
            except Exception as exc:  # handed to the caller, who reports it
                result = exc
            with contextlib.suppress(RuntimeError):  # RuntimeError: the caller's loop has closed
                loop.call_soon_threadsafe(_settle, done, result)

    def _private_encoder(self) -> Callable[[str], list[int]]:
        tokenizer = self._tokenizer
        special = self._add_special_tokens
        shared = lambda text: list(tokenizer.encode(text, add_special_tokens=special))  # noqa: E731
        if not tokenizer.is_fast:  # a pure-Python tokenizer holds the GIL anyway
            return shared
        from tokenizers import Tokenizer  # transformers' fast tokenizers are built on it

        try:
            copy = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
        except Exception:  # a backend that does not serialize: still off the event loop, with the GIL
            log.warning("%s: could not copy the tokenizer; long texts are tokenized with the shared one",
                        self._name, exc_info=True)
            return shared
        return lambda text: copy.encode_batch_fast([text], add_special_tokens=special)[0].ids


def _settle(done: asyncio.Future[Any], result: list[int] | BaseException) -> None:
    if done.done():
        return
    if isinstance(result, BaseException):
        done.set_exception(result)
    else:
        done.set_result(result)
