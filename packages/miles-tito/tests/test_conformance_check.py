"""The conformance checker counts what it claims to (unit tests on hand-built session views): a turn
whose prompt re-derives its parent's tokens is not token-exact, an unanswered call and a format error
with no malformed call kept are silent drops, a fork the harness never asks for is spurious."""

from __future__ import annotations

from typing import Any

from miles_contracts.wire.session import MalformedToolCall, SessionView, TurnRecord
from miles_tito.conformance.check import check_episode
from miles_tito.conformance.script import ToolScript


def record(turn: int, input_ids: list[int], output_ids: list[int], parent: int | None, **extra: Any) -> TurnRecord:
    return TurnRecord(turn=turn, message_count=1, input_ids=input_ids, output_ids=output_ids,
                      output_logprobs=[0.0] * len(output_ids), finish_reason=extra.pop("finish_reason", "stop"),
                      message=extra.pop("message", {"role": "assistant", "content": "x"}), created_at=0.0,
                      parent_turn=parent, **extra)


def view(records: list[TurnRecord], messages: list[dict[str, Any]], forks: dict[str, int] | None = None) -> SessionView:
    return SessionView(session_id="s", family="chatml", created_at=0.0, records=records, messages=messages,
                       max_trim_tokens=1, forks=forks or {})


CALL = {"role": "assistant", "content": "", "tool_calls": [{"id": "c1", "type": "function",
                                                               "function": {"name": "f", "arguments": "{}"}}]}


def test_a_conforming_episode() -> None:
    turns = [record(0, [1, 2], [3, 4], None, message=CALL, finish_reason="tool_calls"),
             record(1, [1, 2, 3, 4, 5], [6], 0)]
    check = check_episode(view(turns, [CALL, {"role": "tool", "tool_call_id": "c1", "content": "1"}]), None, lambda r: "")
    assert (check.turns, check.token_exact, check.spurious_forks, check.silently_dropped, check.tool_calls) == (2, 2, 0, 0, 1)


def test_each_miscount_is_caught() -> None:
    malformed = MalformedToolCall(error="bad", span=(0, 1), text="x")
    turns = [record(0, [1, 2], [3, 4], None, message=CALL, finish_reason="tool_calls"),
             record(1, [1, 2, 9, 9, 5], [6], 0, format_error="not JSON"),  # re-derived tokens, error not kept
             record(2, [1, 2, 9, 9, 5, 6], [7], 1, format_error="bad", malformed_tool_calls=[malformed])]
    check = check_episode(view(turns, [CALL], forks={"spurious": 1, "rewrite": 1}), None, lambda r: "",
                          allowed_forks=("rewrite",))
    assert check.token_exact == 2 and check.spurious_forks == 1 and check.malformed == 1
    assert check.silently_dropped == 2  # c1 never answered, and turn 1's unreadable call not kept
    assert len(check.problems) == 4


def test_a_scripted_call_the_server_did_not_return_is_a_drop() -> None:
    script = ToolScript("f", {}, calls=1, malformed=0, period=1)  # every turn is meant to be a call
    check = check_episode(view([record(0, [1], [2], None)], []), script, lambda r: "text")
    assert check.silently_dropped == 1 and "did not keep" in check.problems[0]
