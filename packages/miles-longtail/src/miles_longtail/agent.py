"""The ``long_tail`` agent and the ``repeated_tokens`` reward.

The agent plays its sample's :class:`~miles_longtail.workload.Episode` against the session: a chat
completion per turn with the episode's token budget, and between turns a "tool call" that sleeps
the episode's latency and answers with a user message. It never looks at what the model said, so
the workload is the same whatever the policy learns, and a CPU benchmark's time is made of tool
latency (no CPU) plus a little decoding.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from typing import Any

from miles_contracts import Sample

from miles_longtail.workload import LongTailSection, episode


class LongTailAgent:
    """``run_agent(base_url, prompt, request_kwargs, metadata)``; settings from the ``longtail`` section."""

    def __init__(self, settings: LongTailSection | None = None) -> None:
        self.settings = settings or LongTailSection()

    async def __call__(self, base_url: str, prompt: Any, request_kwargs: dict[str, Any],
                       metadata: dict[str, Any]) -> dict[str, Any]:
        import httpx  # here, not at the top: every `miles` command loads this plugin (docs/benchmarks/cli.md)

        plan = episode(self.settings, int(metadata["index"]))
        messages: list[dict[str, Any]] = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
        body = dict(request_kwargs)
        body.update(body.pop("extra_body", None) or {})  # what an OpenAI client would merge in
        # the session's own key (what an OpenAI client sends as its api_key), not the run's token
        headers = {"Authorization": f"Bearer {metadata['api_key']}"} if metadata.get("api_key") else {}
        model_seconds = []  # each turn's wait for the model: what the engine's load does to an episode
        async with httpx.AsyncClient(base_url=base_url, timeout=None, headers=headers, trust_env=False) as http:
            for turn, budget in enumerate(plan.tokens):
                if turn:
                    await asyncio.sleep(plan.latencies[turn - 1])
                    messages.append({"role": "user", "content": f"tool result {turn}: done in {plan.latencies[turn - 1]:.2f} s"})
                start = time.perf_counter()
                answer = await http.post("/chat/completions", json={**body, "model": "policy", "messages": messages,
                                                                   "max_tokens": budget})
                answer.raise_for_status()
                model_seconds.append(time.perf_counter() - start)
                messages.append(answer.json()["choices"][0]["message"])
        return {"turns": len(plan.tokens), "tool_seconds": plan.tool_seconds, "model_seconds": model_seconds}


def repeated_tokens(samples: Sequence[Sample]) -> list[float]:
    """Share of each sample's model-sampled tokens that repeat the token just before them (NaN when
    it sampled none).

    A reward a random-weight model can learn in a few steps: with tied embeddings its residual
    stream still carries the current token, so the next-token logits already lean towards
    repeating it (at ``rollout.temperature`` 0.1 about a third of the tokens do), and one shared
    direction raises that for every token at once. A short benchmark then shows whether a loop
    mode learns as fast as ``sync`` without a model that understands the prompt."""
    rewards = []
    for s in samples:
        tokens, start = s.tokens, s.prompt_length
        sampled = [t for t, m in enumerate(s.loss_mask) if m and start + t > 0]
        repeats = sum(tokens[start + t] == tokens[start + t - 1] for t in sampled)
        rewards.append(repeats / len(sampled) if sampled else math.nan)
    return rewards
