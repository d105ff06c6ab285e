"""Prompt -> token ids for the generators that tokenize on the rollout side."""

from __future__ import annotations

from typing import Any


def prompt_token_ids(tokenizer: Any, prompt: str | list[dict[str, Any]]) -> list[int]:
    """Chat-template a message list (with the generation prompt), or encode a plain string."""
    if isinstance(prompt, list):
        ids = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True)
        if hasattr(ids, "keys"):  # BatchEncoding in some transformers versions
            ids = ids["input_ids"]
        return list(ids)
    return list(tokenizer.encode(prompt, add_special_tokens=False))
