"""From a record (a row of a file, or a generated task) to a prompt ready to become a ``Sample``.

``data.template`` is a ``str.format`` string filled with the record's fields, where ``{prompt}``
is the prompt field (``data.prompt_key``). With ``data.apply_chat_template`` the prompt becomes an
OpenAI-style message list (``data.system_prompt`` first, when set and the record has no system
message of its own); without it, a plain string (the system prompt, when set, prepended with a
blank line). A record whose prompt is already a message list is used as is (a template cannot
apply to it).
"""

from __future__ import annotations

import json
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from miles_contracts import Sample

from miles.data.errors import DataError, RecordProblem

if TYPE_CHECKING:
    from miles.sections import DataSection

Prompt = str | list[dict[str, Any]]


@dataclass(frozen=True, slots=True)
class PromptRecord:
    """A validated prompt; :meth:`to_sample` makes a fresh ``Sample`` each time it is drawn."""

    prompt: Prompt
    label: str | None
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_sample(self, **extra_metadata: Any) -> Sample:
        prompt = [dict(m) for m in self.prompt] if isinstance(self.prompt, list) else self.prompt
        return Sample(prompt=prompt, label=self.label, metadata={**self.metadata, **extra_metadata})


@dataclass(frozen=True, slots=True)
class PromptSpec:
    """How records become prompts (the prompt-related keys of the ``data`` section)."""

    prompt_key: str = "prompt"
    label_key: str = "label"
    template: str | None = None
    system_prompt: str | None = None
    chat: bool = True

    def __post_init__(self) -> None:
        if self.template is not None:
            try:
                list(string.Formatter().parse(self.template))
            except ValueError as exc:
                raise DataError(
                    f"data.template is not a valid format string ({exc}): {self.template!r}; "
                    f"write fields as {{prompt}} and literal braces as {{{{ and }}}}"
                ) from None

    @classmethod
    def from_config(cls, config: DataSection, *, prompt_key: str | None = None, label_key: str | None = None) -> PromptSpec:
        return cls(
            prompt_key=prompt_key or config.prompt_key,
            label_key=label_key or config.label_key,
            template=config.template,
            system_prompt=config.system_prompt,
            chat=config.apply_chat_template,
        )

    def build(self, fields: Mapping[str, Any]) -> PromptRecord:
        """The prompt of one record; raises :class:`RecordProblem` saying what is wrong with it."""
        if self.prompt_key not in fields:
            raise RecordProblem(
                f"no prompt field {self.prompt_key!r} (data.prompt_key); the record has: {', '.join(map(str, fields)) or 'no fields'}"
            )
        raw = fields[self.prompt_key]
        if isinstance(raw, str):
            prompt = self._from_text(self._apply_template(raw, fields))
        elif isinstance(raw, list):
            prompt = self._from_messages(raw)
        else:
            raise RecordProblem(f"prompt field {self.prompt_key!r} is a {type(raw).__name__}; expected a string or a list of messages")
        metadata = fields.get("metadata") or {}
        if not isinstance(metadata, dict):
            raise RecordProblem(f"field 'metadata' is a {type(metadata).__name__}; expected an object")
        return PromptRecord(prompt=prompt, label=_label_text(fields.get(self.label_key)), metadata=dict(metadata))

    def _apply_template(self, text: str, fields: Mapping[str, Any]) -> str:
        if self.template is None:
            return text
        try:
            return self.template.format_map({**fields, "prompt": text})
        except KeyError as exc:
            raise RecordProblem(f"data.template uses {{{exc.args[0]}}} but the record has no such field") from None
        except (IndexError, ValueError, AttributeError) as exc:
            raise RecordProblem(f"data.template cannot be filled from this record: {exc}") from None

    def _from_text(self, text: str) -> Prompt:
        if not self.chat:
            return f"{self.system_prompt}\n\n{text}" if self.system_prompt else text
        messages = [{"role": "user", "content": text}]
        return ([{"role": "system", "content": self.system_prompt}] + messages) if self.system_prompt else messages

    def _from_messages(self, raw: list[Any]) -> Prompt:
        if not self.chat:
            raise RecordProblem("the prompt is a message list but data.apply_chat_template is false; set it to true")
        if self.template is not None:
            raise RecordProblem("data.template applies to string prompts, but this prompt is a message list")
        for i, message in enumerate(raw):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str) and "content" in message):
                raise RecordProblem(f"message {i} of the prompt is not an object with 'role' and 'content'")
        if not raw:
            raise RecordProblem("the prompt is an empty message list")
        messages = [dict(m) for m in raw]
        if self.system_prompt and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages


def _label_text(value: Any) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bool | int | float):
        return str(value)
    return json.dumps(value)
