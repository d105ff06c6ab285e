"""The TITO tokenizer: token ids of a conversation that grows, without re-tokenizing its past.

First turn: render the messages with the generation prompt and tokenize the text.
Later turns: the tokens so far are the previous prompt plus the ids the engine sampled (kept as they
are, never re-derived from text). Only the messages appended since that assistant turn are
tokenized: render the history without them (``before``) and with them plus the generation prompt
(``after``); ``after`` must start with ``before`` (the render-level check), and the text after it is
tokenized alone. The stored ids and the new ids are joined by the chat family's splice rules:
drop trailing tokens the template replaces (at most ``max_trim_tokens``), then close the turn with
whatever part of ``turn_end`` the model did not emit (ChatML: the ``\\n`` after ``<|im_end|>``).

Which history is rendered (``render_check``):

* ``"window"`` (default): the first message when it is a system message (templates render it
  specially, with the tools) and the last assistant turn. The cost per turn no longer grows with
  the conversation. It catches every break that involves the turn just generated -- which is where
  real templates break (``loop.last``, "after the last user message" rules) -- and
  ``miles verify-template`` checks that a template renders the same suffix from the window as from
  the whole history.
* ``"full"``: the whole history, twice per turn; also catches templates that re-render older turns.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Literal

from miles_contracts.chat import ChatFamily
from miles_models.long_texts import LONG_TEXT_CHARS, TokenizerThread, chars_per_token_bound, min_tokens

from miles_tito.errors import TemplateFailed, TemplateNotPrefixInvariant
from miles_tito.messages import ChatMessage, template_views
from miles_tito.render import ChatRenderer, TemplateRenderError, first_difference, message_at

RenderCheck = Literal["window", "full"]


def render_context(history: Sequence[Any], mode: RenderCheck) -> list[int]:
    """Indices of the history messages rendered around appended ones (see the module doc)."""
    last = len(history) - 1
    if mode == "full":
        return list(range(len(history)))
    return [0, last] if last > 0 and history[0].role == "system" else [last]


class TitoTokenizer:
    """Renders and tokenizes conversations of one chat family with one HF tokenizer."""

    def __init__(self, tokenizer: Any, family: ChatFamily, *, render_check: RenderCheck = "window") -> None:
        self.tokenizer = tokenizer
        self.family = family
        self.render_check = render_check
        self.renderer = ChatRenderer(family.template, family.template_kwargs)
        backend = getattr(tokenizer, "_tokenizer", None)
        # The Rust backend directly: the Python wrapper adds ~40 us per call, which is most of the
        # cost of tokenizing one appended tool message.
        self._backend = backend if getattr(tokenizer, "is_fast", False) and hasattr(backend, "encode") else None
        self.chars_per_token = chars_per_token_bound(tokenizer)
        self._long_texts = TokenizerThread(tokenizer, add_special_tokens=False, name="miles-tito-tokenize")
        self.turn_end_ids = self.encode(family.turn_end)
        self.stop_token_ids = self._single_token_ids(family.stop_tokens, "stop_tokens", required=True)
        self.trim_ids = frozenset(self._single_token_ids(family.trim_trailing, "trim_trailing", required=False))

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str) -> list[int]:
        if self._backend is not None:
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    async def encode_off_loop(self, text: str) -> list[int]:
        """:meth:`encode`, with a long text tokenized on a worker thread (see
        :mod:`miles_models.long_texts`): the event loop goes on serving other sessions meanwhile."""
        if len(text) <= LONG_TEXT_CHARS:
            return self.encode(text)
        return await self._long_texts.encode(text)

    def min_tokens(self, text: str) -> int:
        """The fewest tokens ``text`` can be, known without tokenizing it (0 when the tokenizer
        gives no bound)."""
        return min_tokens(len(text), self.chars_per_token)

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=False)

    def _single_token_ids(self, tokens: Sequence[str], what: str, *, required: bool) -> list[int]:
        ids = []
        for token in tokens:
            encoded = self.encode(token)
            if len(encoded) == 1:
                ids.append(encoded[0])
        if required and not ids:
            raise ValueError(
                f"chat family {self.family.name!r}: none of its {what} {list(tokens)} is a single token of this "
                f"tokenizer; the family does not fit this model (choose another with tito.family / --family)"
            )
        return ids

    # ------------------------------------------------------------------ rendering

    def render(
        self,
        messages: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None,
        *,
        add_generation_prompt: bool,
        extra: Mapping[str, Any] | None = None,
    ) -> str:
        try:
            return self.renderer.render(template_views(messages), tools, add_generation_prompt=add_generation_prompt, extra=extra)
        except TemplateRenderError as exc:
            raise TemplateFailed(f"{exc} (chat family {self.family.name!r})") from exc

    # ------------------------------------------------------------------ token ids of a turn

    def first_turn_ids(
        self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None, extra: Mapping[str, Any] | None = None
    ) -> list[int]:
        """Prompt ids of a conversation with no generated turn yet."""
        return self.encode(self.first_turn_text(messages, tools, extra))

    def first_turn_text(
        self, messages: Sequence[ChatMessage], tools: Sequence[Mapping[str, Any]] | None, extra: Mapping[str, Any] | None = None
    ) -> str:
        """The text whose ids :meth:`first_turn_ids` returns."""
        return self.render(messages, tools, add_generation_prompt=True, extra=extra)

    def appended_ids(
        self,
        history: Sequence[ChatMessage],
        history_ids: Sequence[int],
        appended: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None,
        extra: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], int]:
        """Prompt ids after ``appended`` messages: ``(ids, trimmed)``.

        :param history: the messages so far, ending with the assistant turn that ``history_ids`` ends with.
        :param history_ids: that turn's prompt ids plus its sampled ids.
        :returns: the spliced history ids followed by the new messages' ids and the generation
            prompt, and how many trailing history ids the splice dropped.
        :raises TemplateNotPrefixInvariant: appending re-rendered the history differently.
        """
        spliced, trimmed, text = self.appended_text(history, history_ids, appended, tools, extra)
        return spliced + self.encode(text), trimmed

    def appended_text(
        self,
        history: Sequence[ChatMessage],
        history_ids: Sequence[int],
        appended: Sequence[ChatMessage],
        tools: Sequence[Mapping[str, Any]] | None,
        extra: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], int, str]:
        """:meth:`appended_ids` before the new text is tokenized: ``(spliced history ids, trimmed,
        text of the appended messages and the generation prompt)``."""
        context = [history[i] for i in render_context(history, self.render_check)]
        before = self.render(context, tools, add_generation_prompt=False, extra=extra)
        after = self.render([*context, *appended], tools, add_generation_prompt=True, extra=extra)
        if not after.startswith(before):
            indices = render_context(history, self.render_check)
            raise TemplateNotPrefixInvariant(self._describe_break(context, indices, appended, before, after))
        spliced, trimmed = self.splice(history_ids)
        return spliced, trimmed, after[len(before) :]

    def splice(self, ids: Sequence[int]) -> tuple[list[int], int]:
        """Apply the family's splice rules to the ids of a finished turn: ``(ids, trimmed)``."""
        end = len(ids)
        while len(ids) - end < self.family.max_trim_tokens and end > 0 and ids[end - 1] in self.trim_ids:
            end -= 1
        out = list(ids[:end])
        closing = self.turn_end_ids
        for k in range(len(closing), 0, -1):
            if len(out) >= k and out[-k:] == closing[:k]:
                return out + closing[k:], len(ids) - end
        return out + closing, len(ids) - end

    # ------------------------------------------------------------------ diagnostics

    def _describe_break(
        self, context: Sequence[ChatMessage], indices: Sequence[int], appended: Sequence[ChatMessage], before: str, after: str
    ) -> str:
        at = first_difference(before, after)
        culprit = message_at(before, [m.content for m in context], at)
        roles = ", ".join(m.role for m in appended)
        return (
            f"chat family {self.family.name!r}: appending [{roles}] changed how messages[{indices[culprit]}] "
            f"({context[culprit].role}) renders: before {before[max(0, at - 30) : at + 30]!r}, "
            f"after {after[max(0, at - 30) : at + 30]!r}. The template is not prefix-invariant here; use a fixed "
            f"template (run `miles verify-template` on it)"
        )
