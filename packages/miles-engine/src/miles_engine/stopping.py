"""When a request stops, and the text it returns.

Order of checks after each token (SGLang's): a stop token (EOS and ``stop_token_ids``; neither
with ``ignore_eos``, as in SGLang), then a stop string in the generated text, then the length limit. Stop tokens
are masked by the sampler until ``min_new_tokens`` are out, so they cannot fire early.

Text: the generated ids decoded (``skip_special_tokens`` as asked); unless ``no_stop_trim``, a
matched stop string and everything after it is cut, and a matched stop token is not decoded.
``output_ids`` always keep every generated token, the stop token included.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from miles_contracts.wire.engine import FinishReason

from miles_engine.codec import TextCodec

if TYPE_CHECKING:
    from miles_engine.sequence import Sequence

# Tokens decoded beyond the longest stop string when looking for it: a stop string can span
# tokens, and a token can decode to nothing on its own (part of a UTF-8 character).
_STOP_TAIL_SLACK = 4


class StopChecker:
    def __init__(self, codec: TextCodec) -> None:
        self.codec = codec

    def __call__(self, seq: Sequence) -> FinishReason | None:
        token = seq.output_ids[-1]
        if token in seq.stop_ids:
            return FinishReason(type="stop", matched=token)
        stops = seq.params.stop_strings
        if stops:
            tail_tokens = max(len(s) for s in stops) + _STOP_TAIL_SLACK
            tail = self.codec.decode(seq.output_ids[-tail_tokens:], skip_special_tokens=seq.params.skip_special_tokens)
            for stop in stops:
                if stop in tail:
                    return FinishReason(type="stop", matched=stop)
        if len(seq.output_ids) >= seq.max_new_tokens:
            return FinishReason(type="length", length=len(seq.output_ids))
        return None

    def text(self, seq: Sequence) -> str:
        ids = seq.output_ids
        finish = seq.finish
        trim = not seq.params.no_stop_trim and finish is not None and finish.type == "stop"
        matched = finish.matched if trim and finish is not None else None  # what to trim, if anything
        if isinstance(matched, int) and ids and ids[-1] == matched:
            ids = ids[:-1]
        text = self.codec.decode(ids, skip_special_tokens=seq.params.skip_special_tokens)
        if isinstance(matched, str):
            cut = text.find(matched)
            if cut >= 0:
                text = text[:cut]
        return text
