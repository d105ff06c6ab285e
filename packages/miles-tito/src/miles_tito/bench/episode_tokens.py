"""``miles bench episode-tokens``: tokens a trainer sees per generated token on an agent episode
that compacts its context and delegates to a sub-agent.

The episode is scripted (the model's answers are fixed text, so this counts tokens, it does not
time anything; the counts are exact and the same on every run): a main agent with a long system
prompt runs ``--turns`` turns, each answer ``--output-tokens`` long and followed by a tool result of
``--tool-tokens``; every ``--compact-every`` turns it replaces its history with the system prompt
and a summary; at turn ``--spawn-at`` it opens a sub-agent session (its own task) of
``--subagent-turns`` turns. The session server's real :class:`~miles_tito.conversation.Conversation`
records it, with the real tokenizer and chat family; the rows are the ``agentic`` generator's.

Reported, each per generated token:

* **graph**: the tokens the episode's graph holds (each turn's prompt increment plus its sampled
  ids: every token once);
* **rows** (what Miles trains on today): the rows' tokens summed, one row per branch, each holding
  its whole path (a shared prefix is re-read as context in every row after the first);
* **per request** (one sample per model call, each with its full prompt: what a framework that
  turns every request into a sample trains on).
"""

from __future__ import annotations

import argparse
import json
import random
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_contracts import RunContext

    from miles_tito.conversation import Conversation

def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model whose tokenizer to use")
    parser.add_argument("--family", default="chatml", help="chat family")
    parser.add_argument("--turns", type=int, default=24, help="main agent turns")
    parser.add_argument("--output-tokens", type=int, default=120, help="about this many sampled ids per turn")
    parser.add_argument("--tool-tokens", type=int, default=300, help="about this many ids per tool result")
    parser.add_argument("--system-tokens", type=int, default=600, help="about this many ids of system prompt")
    parser.add_argument("--compact-every", type=int, default=6)
    parser.add_argument("--spawn-at", type=int, default=3)
    parser.add_argument("--subagent-turns", type=int, default=4)


SETTINGS = ("turns", "output_tokens", "tool_tokens", "system_tokens", "compact_every", "spawn_at", "subagent_turns")


def run(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles_models import resolve_model
    from transformers import AutoTokenizer

    from miles_tito.families import resolve_family
    from miles_tito.tokenizer import TitoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    tito = TitoTokenizer(tokenizer, resolve_family(args.family, kernel=ctx.kernel))
    result = count_episode(tito, turns=args.turns, output_tokens=args.output_tokens, tool_tokens=args.tool_tokens,
                           system_tokens=args.system_tokens, compact_every=args.compact_every, spawn_at=args.spawn_at,
                           subagent_turns=args.subagent_turns)
    print(json.dumps({"benchmark": "episode-tokens", "model": args.model, "family": args.family,
                      "settings": {k: getattr(args, k) for k in SETTINGS},
                      **result}, indent=2))
    return 0


def count_episode(tito: Any, *, turns: int, output_tokens: int, tool_tokens: int, system_tokens: int,
                  compact_every: int, spawn_at: int, subagent_turns: int, seed: int = 0) -> dict[str, Any]:
    """Record the scripted episode and count its tokens three ways (module docstring)."""
    from miles_contracts import Sample

    from miles_tito.bench.tito import WORDS
    from miles_tito.conversation import Conversation, Episode
    from miles_tito.generators.agentic import episode_rows
    from miles_tito.server.service import conversation_view

    rng = random.Random(seed)

    def text(tokens: int) -> str:  # ~1.3 ids per word with these words
        return " ".join(rng.choice(WORDS) for _ in range(max(1, int(tokens / 1.3))))

    episode = Episode()
    main = Conversation(tito, episode=episode, session_id="main")
    system = {"role": "system", "content": text(system_tokens)}
    history: list[dict[str, Any]] = [system, {"role": "user", "content": text(80)}]
    sub: Conversation | None = None
    for number in range(turns):
        if number and number % compact_every == 0:
            history = [system, {"role": "user", "content": "Summary of the work so far: " + text(150)}]
        _turn(main, history, text(output_tokens))
        history += [main.messages[-1].to_openai(), {"role": "user", "content": text(tool_tokens)}]
        if number == spawn_at:
            head = main.head
            assert head is not None
            sub = Conversation(tito, episode=episode, session_id="sub", role="subagent",
                               parent=(head.record.branch, head.record.turn))
            sub_history: list[dict[str, Any]] = [{"role": "user", "content": text(120)}]
            for _ in range(subagent_turns):
                _turn(sub, sub_history, text(output_tokens))
                sub_history += [sub.messages[-1].to_openai(), {"role": "user", "content": text(tool_tokens)}]
    sessions = [main, *([sub] if sub is not None else [])]
    views = [conversation_view(c) for c in sessions]
    root = views[0].model_copy(update={"children": views[1:]})
    sample = Sample(prompt="scripted")
    rows = episode_rows(sample, root, ())
    records = [r for c in sessions for r in c.records]
    generated = sum(len(r.output_ids) for r in records)
    row_tokens = sum(len(r.tokens) for r in rows)
    trained = sum(sum(r.loss_mask) for r in rows)
    request_tokens = sum(len(r.input_ids) + len(r.output_ids) for r in records)
    return {
        "turns": len(records), "branches": len(episode.branches), "forks": episode.fork_counts(), "rows": len(rows),
        "generated_tokens": generated, "trained_tokens": trained,
        "graph_tokens": episode.tokens, "row_tokens": row_tokens, "per_request_tokens": request_tokens,
        "graph_per_generated": round(episode.tokens / generated, 2),
        "rows_per_generated": round(row_tokens / generated, 2),
        "per_request_per_generated": round(request_tokens / generated, 2),
        "rows_vs_graph": round(row_tokens / episode.tokens, 3),
        "per_request_vs_rows": round(request_tokens / row_tokens, 2),
    }


def _turn(conversation: Conversation, history: list[dict[str, Any]], answer: str) -> None:
    from miles_tito.messages import ChatMessage

    prepared = conversation.prepare([ChatMessage.from_openai(m, i) for i, m in enumerate(history)], None)
    output = conversation.tito.encode(answer) + [conversation.tito.stop_token_ids[0]]
    conversation.commit(prepared, output_ids=output, output_logprobs=[0.0] * len(output), finish_reason="stop",
                        weight_version=0, message=ChatMessage(role="assistant", content=answer))
