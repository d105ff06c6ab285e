"""Checking a chat template for prefix invariance where TITO relies on it.

TITO splits a conversation right after an assistant turn and later renders it again with more
messages and the generation prompt. For every canned conversation, every split point ``s`` (just
after an assistant message) and every later generation point ``g`` (just before an assistant
message), the rendering of ``messages[:s]`` must be a string prefix of the rendering of
``messages[:g]`` with the generation prompt. A pair whose appended messages include a role the
family does not allow appending is skipped.

With a tokenizer, each TITO step (``g`` = the next generation point) is also checked at the token
level: tokenizing the prefix and the appended text separately should give the same ids as
tokenizing the whole. A difference there is reported but is not a break: TITO keeps the model's
own ids, so it never re-tokenizes across the boundary.

Unless ``render_check="full"``, each TITO step is also rendered the way TITO's default window mode
does it (first system message + last assistant turn + appended messages): the appended text must
equal the one rendered after the whole history, or the template needs ``tito.render_check: full``.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from miles_tito.messages import ChatMessage, template_views
from miles_tito.render import ChatRenderer, TemplateRenderError, first_difference, message_at
from miles_tito.tokenizer import RenderCheck, render_context
from miles_tito.verify.cases import CASES, Case


@dataclass(frozen=True, slots=True)
class Break:
    """``messages[:split]`` is not a prefix of the prompt for ``messages[generation]`` (kind
    ``prefix``), or the window rendering appends different text than the full one (``window``)."""

    kind: str
    case: str
    split: int
    generation: int
    message: int  # the history message that rendered differently
    role: str
    at: int  # character offset of the first difference
    before: str
    after: str


@dataclass(frozen=True, slots=True)
class TokenDifference:
    case: str
    split: int
    at_token: int


@dataclass(slots=True)
class Report:
    template: str
    checked: int = 0
    skipped: int = 0
    breaks: list[Break] = field(default_factory=list)
    token_differences: list[TokenDifference] = field(default_factory=list)
    render_errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.breaks and not self.render_errors

    def to_dict(self) -> dict[str, Any]:
        return {
            "template": self.template, "ok": self.ok, "checked": self.checked, "skipped": self.skipped,
            "breaks": [asdict(b) for b in self.breaks],
            "token_differences": [asdict(d) for d in self.token_differences],
            "render_errors": self.render_errors,
        }


def verify_template(
    template: str,
    *,
    label: str = "template",
    template_kwargs: Mapping[str, Any] | None = None,
    allowed_append_roles: Collection[str] = frozenset({"user", "tool", "system"}),
    tokenizer: Any = None,
    render_check: RenderCheck = "window",
    cases: Sequence[Case] = CASES,
) -> Report:
    report = Report(label)
    try:
        renderer = ChatRenderer(template, template_kwargs)
    except TemplateRenderError as exc:
        report.render_errors.append(str(exc))
        return report
    for case in cases:
        try:
            _check_case(renderer, case, set(allowed_append_roles), tokenizer, render_check, report)
        except TemplateRenderError as exc:
            report.render_errors.append(f"{case.name}: {exc}")
    return report


def _check_case(
    renderer: ChatRenderer, case: Case, allowed: set[str], tokenizer: Any, render_check: RenderCheck, report: Report
) -> None:
    messages = [ChatMessage.from_openai(m, i) for i, m in enumerate(case.messages)]
    views = template_views(messages)
    tools = list(case.tools) or None
    splits = [i + 1 for i, m in enumerate(messages) if m.role == "assistant"]
    generations = [i for i, m in enumerate(messages) if m.role == "assistant"]
    prefix = {s: renderer.render(views[:s], tools, add_generation_prompt=False) for s in splits}
    prompt = {g: renderer.render(views[:g], tools, add_generation_prompt=True) for g in generations}
    for s in splits:
        later = [g for g in generations if g > s]
        for g in later:
            if any(m.role not in allowed for m in messages[s:g]):
                # TITO never appends these roles after a turn, so neither this nor a later point applies.
                report.skipped += g == later[0]
                break
            report.checked += 1
            before, after = prefix[s], prompt[g]
            if not after.startswith(before):
                report.breaks.append(_break("prefix", case, messages, s, g, before, after))
                continue
            if g != later[0]:
                continue
            if tokenizer is not None:
                _check_tokens(tokenizer, case, s, before, after, report)
            if render_check == "window":
                _check_window(renderer, case, messages, views, tools, s, g, after[len(before) :], report)


def _check_window(
    renderer: ChatRenderer, case: Case, messages: list[ChatMessage], views: list[dict[str, Any]], tools: Any,
    s: int, g: int, full_suffix: str, report: Report,
) -> None:
    context = [views[i] for i in render_context(messages[:s], "window")]
    before = renderer.render(context, tools, add_generation_prompt=False)
    after = renderer.render([*context, *views[s:g]], tools, add_generation_prompt=True)
    if not after.startswith(before):
        report.breaks.append(_break("prefix", case, messages, s, g, before, after))
    elif after[len(before) :] != full_suffix:
        window_suffix = after[len(before) :]
        at = first_difference(window_suffix, full_suffix)
        report.breaks.append(Break(
            "window", case.name, s, g, s, messages[s].role, at,
            window_suffix[max(0, at - 40) : at + 40], full_suffix[max(0, at - 40) : at + 40],
        ))


def _break(kind: str, case: Case, messages: list[ChatMessage], s: int, g: int, before: str, after: str) -> Break:
    at = first_difference(before, after)
    culprit = message_at(before, [m.content for m in messages[:s]], at)
    return Break(
        kind, case.name, s, g, culprit, messages[culprit].role, at,
        before[max(0, at - 40) : at + 40], after[max(0, at - 40) : at + 40],
    )


def _check_tokens(tokenizer: Any, case: Case, s: int, before: str, after: str, report: Report) -> None:
    def encode(text: str) -> list[int]:
        return list(tokenizer.encode(text, add_special_tokens=False))

    whole = encode(after)
    pieces = encode(before) + encode(after[len(before) :])
    if whole != pieces:
        at = next((i for i, (a, b) in enumerate(zip(whole, pieces, strict=False)) if a != b), min(len(whole), len(pieces)))
        report.token_differences.append(TokenDifference(case.name, s, at))


def format_report(report: Report) -> str:
    lines = [f"{report.template}: {report.checked} split points checked, {report.skipped} skipped (roles not allowed)"]
    for error in report.render_errors:
        lines.append(f"  RENDER ERROR {error}")
    for b in (b for b in report.breaks if b.kind == "window"):
        lines.append(
            f"  WINDOW {b.case}: after messages[{b.split - 1}] the appended messages render differently after the "
            f"window than after the whole history (char {b.at}); use tito.render_check: full\n"
            f"        window: {b.before!r}\n        full:   {b.after!r}"
        )
    for b in (b for b in report.breaks if b.kind == "prefix"):
        lines.append(
            f"  BREAK {b.case}: split after messages[{b.split - 1}], prompt for messages[{b.generation}]: "
            f"messages[{b.message}] ({b.role}) renders differently at char {b.at}\n"
            f"        before: {b.before!r}\n        after:  {b.after!r}"
        )
    for d in report.token_differences:
        lines.append(f"  note {d.case}: split after messages[{d.split - 1}] tokenizes differently across the boundary (token {d.at_token}); TITO keeps the model's ids there")
    lines.append("OK: prefix-invariant at every split point" if report.ok else f"FAIL: {len(report.breaks)} break(s), {len(report.render_errors)} render error(s)")
    return "\n".join(lines)
