"""The trajectory graph of an episode: where a request goes (append, switch, fork by cause), the
rows it becomes, and a property test over random episodes: every model token trained exactly once,
never a token the model did not write, no fork from a client that only re-spells its history."""

from __future__ import annotations

import json
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from miles_contracts import Sample
from miles_contracts.wire.session import TurnRecord
from miles_tito.assembly import branch_sample
from miles_tito.conversation import Conversation, Episode
from miles_tito.messages import ChatMessage
from miles_tito.tokenizer import TitoTokenizer

IM_END = 2
SYSTEM = {"role": "system", "content": "Be brief."}


def msgs(items: list[dict[str, Any]]) -> list[ChatMessage]:
    return [ChatMessage.from_openai(m, i) for i, m in enumerate(items)]


def turn(conversation: Conversation, request: list[dict[str, Any]], answer: dict[str, Any], output: list[int]) -> TurnRecord:
    prepared = conversation.prepare(msgs(request), None)
    return conversation.commit(prepared, output_ids=output, output_logprobs=[-0.25] * len(output), finish_reason="stop",
                               weight_version=1, message=ChatMessage.from_openai(answer, len(request)))


def said(text: str) -> dict[str, Any]:
    return {"role": "assistant", "content": text}


def user(text: str) -> dict[str, Any]:
    return {"role": "user", "content": text}


def rows_of(*conversations: Conversation, train_retried: bool = False) -> list[Sample]:
    """Each branch's sample, as the agentic generator builds them from the sessions' records."""
    rows = []
    for conversation in conversations:
        for branch in conversation.branches:
            last = max((n for n in conversation.nodes if n.record.branch == branch.branch_id), key=lambda n: n.record.turn)
            path = [n.record for n in reversed(list(_ancestry(last)))]
            row = branch_sample(path, branch, max_trim_tokens=conversation.tito.family.max_trim_tokens,
                                train_retried=train_retried)
            if row is not None:
                rows.append(row)
    return rows


def _ancestry(node: Any) -> Any:
    while node is not None:
        yield node
        node = node.parent


def trained_counts(rows: list[Sample], conversations: tuple[Conversation, ...]) -> dict[tuple[str, int], int]:
    """How many rows train each turn's output (by session and turn), checking along the way that a
    row trains exactly its own turns' outputs and nothing else."""
    counts = {(c.session_id, r.turn): 0 for c in conversations for r in c.records}
    for row in rows:
        assert row.branch is not None
        conversation = next(c for c in conversations if c.session_id == row.branch.session_id)
        path_records = _path_of(conversation, row)
        trained = [0] * row.response_length
        for record, (start, end) in zip(path_records, row.metadata["tito"]["turn_spans"], strict=True):
            if all(row.loss_mask[start:end]) and end > start:
                counts[(conversation.session_id, record.turn)] += 1
                assert row.tokens[row.prompt_length + start: row.prompt_length + end] == record.output_ids[: end - start]
                trained[start:end] = [1] * (end - start)
            else:
                assert not any(row.loss_mask[start:end])
        assert row.loss_mask == trained  # nothing outside a turn's sampled ids: no tool, user, system token
    return counts


def _path_of(conversation: Conversation, row: Sample) -> list[TurnRecord]:
    n = len(row.metadata["tito"]["turn_spans"])
    for node in conversation.nodes:
        path = [x.record for x in reversed(list(_ancestry(node)))]
        if len(path) == n and path[-1].input_ids + path[-1].output_ids == row.tokens:
            return path
    raise AssertionError("no path of the session gives this row's tokens")


# ---------------------------------------------------------------------------------------------- cases


def test_appending_stays_on_one_branch_and_going_back_to_another_leaf_is_no_fork(chatml: TitoTokenizer) -> None:
    conversation = Conversation(chatml)
    turn(conversation, [SYSTEM, user("plan")], said("p"), [11, IM_END])
    turn(conversation, [SYSTEM, user("plan"), said("p"), user("step")], said("s"), [12, IM_END])
    # a compaction: the history replaced by a summary (shorter): a new root branch
    turn(conversation, [SYSTEM, user("summary: p, s")], said("c"), [13, IM_END])
    # the agent resumes the first context where it left it: an append to that branch's leaf
    turn(conversation, [SYSTEM, user("plan"), said("p"), user("step"), said("s"), user("go on")], said("g"), [14, IM_END])
    assert [r.branch for r in conversation.records] == [0, 0, 1, 0]
    assert [r.parent_turn for r in conversation.records] == [None, 0, None, 1]
    assert [(b.cause, b.parent_branch, b.fork_turn) for b in conversation.branches] == [
        ("root", None, None), ("compaction", 0, None)]
    assert conversation.episode.fork_counts() == {"compaction": 1}
    # the compaction's prompt, rendered from scratch, shares the system prompt's ids with turn 0
    records = conversation.records
    shared = records[2].shared_prefix
    assert 0 < shared < len(records[2].input_ids) and records[2].input_ids[:shared] == records[0].input_ids[:shared]
    assert records[3].shared_prefix == len(records[1].input_ids) + 2  # its parent's checkpoint, whole
    assert conversation.episode.tokens == sum(len(r.input_ids) - r.shared_prefix + len(r.output_ids) for r in records)


def test_the_episode_token_count_of_a_compacting_delegating_agent(chatml: TitoTokenizer) -> None:
    """``miles bench episode-tokens``' counting, small: every generated id trained once; the graph
    holds fewer tokens than the rows, which hold fewer than one sample per request."""
    from miles_tito.bench.episode_tokens import count_episode

    counts = count_episode(chatml, turns=7, output_tokens=8, tool_tokens=20, system_tokens=40, compact_every=3,
                           spawn_at=1, subagent_turns=2)
    assert counts["forks"] == {"compaction": 2, "subagent": 1} and counts["rows"] == 4 and counts["turns"] == 9
    assert counts["trained_tokens"] == counts["generated_tokens"]
    assert counts["generated_tokens"] < counts["graph_tokens"] < counts["row_tokens"] < counts["per_request_tokens"]


def test_an_edited_tool_result_forks_from_the_turn_before_it(chatml: TitoTokenizer) -> None:
    conversation = Conversation(chatml)
    first = turn(conversation, [user("q")], said("a1"), [11, IM_END])
    turn(conversation, [user("q"), said("a1"), user("r1")], said("a2"), [22, IM_END])
    edited = turn(conversation, [user("q"), said("a1"), user("a longer, edited r1")], said("a2b"), [33, IM_END])
    assert edited.parent_turn == first.turn and edited.branch == 1
    assert edited.input_ids[: len(first.input_ids) + 2] == first.input_ids + [11, IM_END]  # TITO from the fork point
    assert [(b.cause, b.parent_branch, b.fork_turn) for b in conversation.branches][1] == ("rewrite", 0, 0)
    rows = rows_of(conversation)
    assert [sum(r.loss_mask) for r in rows] == [4, 2]  # branch 0 trains a1 and a2; branch 1 only a2b
    assert set(trained_counts(rows, (conversation,)).values()) == {1}


def test_retrying_the_first_turn_keeps_the_attempt_as_a_retried_root(chatml: TitoTokenizer) -> None:
    conversation = Conversation(chatml)
    turn(conversation, [user("q")], said("a"), [11, IM_END])
    turn(conversation, [user("q")], said("b"), [12, IM_END])
    assert [(r.branch, r.rolled_back, r.parent_turn) for r in conversation.records] == [(1, True, None), (0, False, None)]
    assert [(b.cause, b.retried) for b in conversation.branches] == [("root", False), ("retry", True)]
    assert [r.branch.branch_id for r in rows_of(conversation) if r.branch] == [0]  # not trained by default
    assert [r.branch.branch_id for r in rows_of(conversation, train_retried=True) if r.branch] == [0, 1]


def test_a_client_that_respells_its_history_keeps_its_branch(chatml: TitoTokenizer) -> None:
    """Re-serialised tool-call JSON, re-flowed whitespace, dropped reasoning, content null: no fork."""
    conversation = Conversation(chatml)
    call = {"id": "call_1", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1, "y": [1, 2]}'}}
    stored = {"role": "assistant", "content": "Let me  compute\nthis.", "tool_calls": [call], "reasoning_content": "hm"}
    turn(conversation, [SYSTEM, user("  add  ")], stored, [11, IM_END])
    echo = {"role": "assistant", "content": "Let me compute this.", "tool_calls": [
        {**call, "function": {"name": "calc", "arguments": json.dumps({"y": [1, 2], "x": 1}, indent=2)}}]}
    turn(conversation, [SYSTEM, user("add"), echo, {"role": "tool", "tool_call_id": "call_1", "content": "3"}],
         said("3"), [12, IM_END])
    assert len(conversation.branches) == 1 and conversation.episode.fork_counts() == {}


def test_a_difference_of_spelling_only_is_counted_as_a_spurious_fork(chatml: TitoTokenizer) -> None:
    conversation = Conversation(chatml)
    turn(conversation, [user("q")], said("the answer is 42"), [11, IM_END])
    # whitespace inside a word is beyond what a match accepts, but no real change either
    turn(conversation, [user("q"), said("the ans wer is 42"), user("more")], said("x"), [12, IM_END])
    assert conversation.episode.fork_counts() == {"spurious": 1}


def test_a_sub_agent_session_joins_the_episode_with_its_lineage(chatml: TitoTokenizer) -> None:
    episode = Episode()
    main = Conversation(chatml, episode=episode, session_id="main")
    spawn = turn(main, [user("delegate")], said("ok"), [11, IM_END])
    helper = Conversation(chatml, episode=episode, session_id="helper", role="subagent", parent=(spawn.branch, spawn.turn))
    turn(helper, [user("sub-task")], said("done"), [21, IM_END])
    turn(main, [user("delegate"), said("ok"), user("helper says: done")], said("final"), [12, IM_END])
    assert [(b.branch_id, b.session_id, b.role, b.cause, b.parent_branch, b.fork_turn) for b in episode.branches] == [
        (0, "main", "agent", "root", None, None), (1, "helper", "subagent", "subagent", 0, 0)]
    rows = rows_of(main, helper)
    assert [(r.branch.role if r.branch else None, sum(r.loss_mask)) for r in rows] == [("agent", 4), ("subagent", 2)]


# ------------------------------------------------------------------------------------ property test

OPS = st.lists(st.sampled_from(["append", "tools", "compact", "retry", "rewrite", "respell", "subagent", "switch"]),
               min_size=1, max_size=14)


class EpisodeDriver:
    """Drives random client behaviour against conversations of one episode (fake model ids)."""

    def __init__(self, tito: TitoTokenizer) -> None:
        self.episode = Episode()
        self.tito = tito
        self.conversations = [Conversation(tito, episode=self.episode, session_id="s0")]
        self.current = 0
        self.next_id = 100
        self.histories: list[list[dict[str, Any]]] = [[SYSTEM, user("task")]]  # what each client would send next

    def output(self) -> list[int]:
        self.next_id += 1
        return [self.next_id % 1000 + 10, IM_END]

    def run(self, request: list[dict[str, Any]], *, calls: int = 0) -> None:
        conversation = self.conversations[self.current]
        tool_calls = [{"id": f"call_{self.next_id}_{k}", "type": "function",
                       "function": {"name": "calc", "arguments": json.dumps({"k": k})}} for k in range(calls)]
        answer = {"role": "assistant", "content": f"reply {self.next_id}", **({"tool_calls": tool_calls} if calls else {})}
        turn(conversation, request, answer, self.output())
        results = [{"role": "tool", "tool_call_id": c["id"], "content": f"result {k}"} for k, c in enumerate(tool_calls)]
        self.histories[self.current] = [*request, conversation.head.record.message, *(results or [user("next")])]  # type: ignore[union-attr]

    def step(self, op: str) -> None:
        conversation = self.conversations[self.current]
        history = self.histories[self.current]
        if op == "append" or conversation.head is None:
            self.run(history)
        elif op == "tools":
            self.run(history, calls=2)  # two calls in one turn, then two tool results
        elif op == "compact":
            self.run([SYSTEM, user(f"s{self.next_id % 100}")])  # shorter than any history it replaces
        elif op == "retry":
            self.run([m.to_openai() for m in conversation.head.prompt_messages])
        elif op == "rewrite":  # the message the last turn answered, edited (made longer), asked again
            prompt = [m.to_openai() for m in conversation.head.prompt_messages]
            self.run([*prompt[:-1], {**prompt[-1], "content": f"{prompt[-1]['content']} (edited, and longer)"}])
        elif op == "respell":
            self.run([_respelled(m) for m in history])
        elif op == "subagent" and len(self.conversations) < 4:
            parent = conversation.head
            child = Conversation(self.tito, episode=self.episode, session_id=f"s{len(self.conversations)}",
                                 role="subagent", parent=(parent.record.branch, parent.record.turn))
            self.conversations.append(child)
            self.histories.append([user(f"sub-task {self.next_id}")])
            self.current = len(self.conversations) - 1
            self.run(self.histories[self.current])
        else:  # switch back to another session (or stay)
            self.current = (self.current + 1) % len(self.conversations)
            self.run(self.histories[self.current])


def _respelled(message: dict[str, Any]) -> dict[str, Any]:
    """What a client may send back: content re-flowed, JSON re-serialised, reasoning dropped."""
    out = {**message, "content": "  ".join(str(message.get("content") or "").split()) or None}
    out.pop("reasoning_content", None)
    if message.get("tool_calls"):
        out["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.dumps(json.loads(c["function"]["arguments"]), indent=1)}}
                             for c in message["tool_calls"]]
    elif out["content"] is None:
        out["content"] = ""
    return out


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=OPS, train_retried=st.booleans())
def test_every_model_token_is_trained_exactly_once_on_random_episodes(chatml: TitoTokenizer, ops: list[str],
                                                                        train_retried: bool) -> None:
    driver = EpisodeDriver(chatml)
    driver.run(driver.histories[0])
    for op in ops:
        driver.step(op)
    conversations = tuple(driver.conversations)
    counts = trained_counts(rows_of(*conversations, train_retried=train_retried), conversations)
    for conversation in conversations:
        for record in conversation.records:
            expected = 0 if record.rolled_back and not train_retried else 1
            assert counts[(conversation.session_id, record.turn)] == expected, (ops, record.turn, record.branch)
    forks = driver.episode.fork_counts()
    assert "spurious" not in forks, (ops, forks)
    # a rewrite makes the last message longer: never read as a compaction; a compaction of a history
    # no longer than the summary is indistinguishable from an edit (docs/design/trajectories.md)
    assert forks.get("compaction", 0) + forks.get("rewrite", 0) == ops.count("compact") + ops.count("rewrite")
    assert forks.get("rewrite", 0) >= ops.count("rewrite")
    assert forks.get("retry", 0) == ops.count("retry")
    assert forks.get("subagent", 0) == len(conversations) - 1
