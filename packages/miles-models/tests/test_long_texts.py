"""The length bound that lets servers refuse a text without tokenizing it, and the worker thread
that tokenizes long texts with its own copy of the tokenizer."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from miles_models.long_texts import TokenizerThread, chars_per_token_bound, min_tokens

# Texts that pack the most characters into a token: runs of whitespace and punctuation are the
# longest entries of byte-level vocabularies.
DENSE_TEXTS = [" " * 5000, "\n" + " " * 5000, "#" * 5000, "=" * 5000, "-" * 5000, "\t" * 5000, "0" * 5000,
               "hello world " * 500, "\U0001f642" * 2000, "<|im_start|>" * 400]


@pytest.fixture(scope="module")
def tokenizer(tiny_dense: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_dense)


def test_the_bound_is_the_longest_vocabulary_entry_and_no_text_beats_it(tokenizer: Any) -> None:
    bound = chars_per_token_bound(tokenizer)
    assert bound == max(len(entry) for entry in tokenizer.get_vocab()) == 81  # "\n" and 80 spaces
    for text in DENSE_TEXTS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) >= min_tokens(len(text), bound), (text[:12], len(ids))


def test_a_tokenizer_that_drops_whitespace_has_no_bound() -> None:
    """BERT-style: the normalizer and pre-tokenizer drop spaces and control characters, so a text's
    length says nothing about its token count."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.WordPiece({"[UNK]": 0, "a": 1, "b": 2}, unk_token="[UNK]"))
    backend.normalizer = normalizers.BertNormalizer()
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    bert_like = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="[UNK]")
    assert chars_per_token_bound(bert_like) is None
    assert min_tokens(10**9, None) == 0


@pytest.mark.parametrize("special", [True, False])
def test_the_worker_thread_tokenizes_as_the_tokenizer_does(tokenizer: Any, special: bool) -> None:
    text = "<|im_start|>user\nHällo wörld \U0001f642 1234\t\n  spaced    out<|im_end|>\n" * 300
    thread = TokenizerThread(tokenizer, add_special_tokens=special, name="test-tokenize")

    async def both() -> list[list[int]]:
        return list(await asyncio.gather(thread.encode(text), thread.encode(text[:5000])))

    whole, part = asyncio.run(both())
    assert whole == tokenizer(text, add_special_tokens=special)["input_ids"]
    assert part == tokenizer(text[:5000], add_special_tokens=special)["input_ids"]
    assert asyncio.run(both()) == [whole, part]  # another event loop: the same thread serves it
