"""What a conformance row measures in one episode, from the session server's final views."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from miles_contracts.wire.session import SessionView, TurnRecord

from miles_tito.conformance.script import ToolScript


@dataclass(slots=True)
class EpisodeCheck:
    """Counts over one episode (every session of it).

    :ivar turns: model turns recorded.
    :ivar token_exact: turns whose prompt holds the turn before it on its branch token for token
        (its prompt ids, then its sampled ids, less the family's allowed trailing trim); a session's
        first turn counts as exact.
    :ivar spurious_forks: branches the server opened for a reason the harness never gives (it
        changed no history): ``spurious``, and ``rewrite`` / ``compaction`` / ``retry`` unless the
        row allows them.
    :ivar tool_calls: calls the server returned to the harness.
    :ivar malformed: unreadable calls the server recorded (status ``malformed``).
    :ivar silently_dropped: calls the model wrote that are neither returned nor recorded as
        malformed, plus returned calls the harness never answered before its next turn.
    :ivar problems: what each miscount was, for the report.
    """

    turns: int = 0
    token_exact: int = 0
    spurious_forks: int = 0
    tool_calls: int = 0
    malformed: int = 0
    silently_dropped: int = 0
    problems: list[str] = field(default_factory=list)

    def add(self, other: EpisodeCheck) -> None:
        self.turns += other.turns
        self.token_exact += other.token_exact
        self.spurious_forks += other.spurious_forks
        self.tool_calls += other.tool_calls
        self.malformed += other.malformed
        self.silently_dropped += other.silently_dropped
        self.problems += other.problems


def check_episode(view: SessionView, script: ToolScript | None, turn_text: Callable[[TurnRecord], str],
                  allowed_forks: Iterable[str] = ()) -> EpisodeCheck:
    """Check the episode whose first session's final view (``DELETE`` answer, children included) is ``view``.

    :param script: how the server read turns (None: the family's own parser, no expectations).
    :param turn_text: the text the family parsed for a record (its decoded ids less the stop token).
    """
    check = EpisodeCheck()
    allowed = {"root", "subagent", *allowed_forks}
    for cause, count in view.forks.items():
        if cause not in allowed:
            check.spurious_forks += count
            check.problems.append(f"{count} fork(s) of cause {cause!r}")
    for session in (view, *view.children):
        _check_session(session, script, turn_text, check)
    return check


def _check_session(session: SessionView, script: ToolScript | None, turn_text: Callable[[TurnRecord], str],
                   check: EpisodeCheck) -> None:
    by_turn = {r.turn: r for r in session.records}
    answered = {str(m.get("tool_call_id")) for m in session.messages if m.get("role") == "tool"}
    last_on_branch = {r.branch: r.turn for r in session.records}
    for record in session.records:
        check.turns += 1
        if _extends_parent(record, by_turn, session.max_trim_tokens):
            check.token_exact += 1
        else:
            check.problems.append(f"session {session.session_id} turn {record.turn}: prompt does not extend turn "
                                  f"{record.parent_turn} token for token")
        calls = [c for c in record.message.get("tool_calls") or () if isinstance(c, dict)]
        check.tool_calls += len(calls)
        check.malformed += len(record.malformed_tool_calls)
        if record.format_error is not None and not record.malformed_tool_calls:
            check.silently_dropped += 1
            check.problems.append(f"turn {record.turn}: format error {record.format_error!r} with no malformed call kept")
        if script is not None and record.finish_reason != "length":
            expected = script.reading(turn_text(record))
            kept = {"call": len(calls) > 0, "malformed": bool(record.malformed_tool_calls), "answer": True}[expected]
            if not kept:
                check.silently_dropped += 1
                check.problems.append(f"turn {record.turn}: the model wrote a {expected} the session did not keep")
        # a returned call must be answered by a tool message, unless the episode stopped at that turn
        if record.rolled_back or last_on_branch.get(record.branch) == record.turn:
            continue
        for call in calls:
            if str(call.get("id")) not in answered:
                check.silently_dropped += 1
                check.problems.append(f"turn {record.turn}: tool call {call.get('id')} was never answered")


def _extends_parent(record: TurnRecord, by_turn: dict[int, TurnRecord], max_trim: int) -> bool:
    if record.parent_turn is None:
        return record.turn == 0 or record.shared_prefix > 0
    parent = by_turn.get(record.parent_turn)
    if parent is None:
        return False
    head = len(parent.input_ids)
    if record.input_ids[:head] != parent.input_ids:
        return False
    for trim in range(min(max_trim, len(parent.output_ids)) + 1):
        kept = parent.output_ids[:len(parent.output_ids) - trim]
        if record.input_ids[head:head + len(kept)] == kept:
            return True
    return False
