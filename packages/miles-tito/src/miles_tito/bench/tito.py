"""``miles bench tito``: incremental TITO tokenization vs re-rendering and re-tokenizing every turn.

A synthetic agent conversation of ``--turns`` turns, each adding about ``--tokens-per-turn`` tokens
(a tool or user message plus the assistant's answer, with thinking for the qwen3 family). Per turn:

* **retokenize** (the baseline every framework without TITO does): render the whole history with
  the generation prompt, tokenize all of it;
* **tito**: :meth:`Conversation.prepare` -- the render-level and token-level checks, then tokenize
  only the appended messages; the "model output" is committed as the ids of the assistant text.

Reported per family: total seconds over all turns and per turn at the end (mean of the last five
turns), as medians of ``--repeats`` runs, their ratios, the number of tokens each approach encoded, and whether TITO's
prompt ids equal the baseline's at every turn (they must where the template is prefix-invariant
and the model's ids are the canonical tokenization of its text, as here).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from miles_contracts import RunContext

_VOCABULARY = (
    "the agent reads a file then calls the calculator tool and compares results before it writes a short "
    "answer with numbers like 42 17 and 3.5 while checking edge cases carefully because tests must pass"
)
WORDS = tuple(_VOCABULARY.split(" "))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model whose tokenizer to use")
    parser.add_argument("--families", default="chatml,qwen3", help="comma-separated chat families")
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--tokens-per-turn", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5, help="runs per approach; medians are reported")
    parser.add_argument("--seed", type=int, default=0)


def run(args: argparse.Namespace, ctx: RunContext) -> int:
    from miles_models import resolve_model
    from transformers import AutoTokenizer

    from miles_tito.families import resolve_family
    from miles_tito.tokenizer import TitoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.model))
    results: dict[str, Any] = {}
    for name in args.families.split(","):
        tito = TitoTokenizer(tokenizer, resolve_family(name.strip(), kernel=ctx.kernel))
        results[name] = bench_family(tito, turns=args.turns, tokens_per_turn=args.tokens_per_turn, repeats=args.repeats, seed=args.seed)
    print(json.dumps({
        "benchmark": "tito", "model": args.model, "turns": args.turns, "tokens_per_turn": args.tokens_per_turn,
        "repeats": args.repeats, "families": results,
    }, indent=2))
    return 0


def bench_family(tito: Any, *, turns: int, tokens_per_turn: int, repeats: int, seed: int) -> dict[str, Any]:
    script = conversation_script(turns, tokens_per_turn, thinking=tito.family.name == "qwen3", seed=seed)
    tito_runs = [run_tito(tito, script) for _ in range(repeats)]
    base_runs = [run_retokenize(tito, script) for _ in range(repeats)]
    tito_total = statistics.median(sum(r["seconds"]) for r in tito_runs)
    base_total = statistics.median(sum(r["seconds"]) for r in base_runs)
    tito_last = statistics.median(statistics.fmean(r["seconds"][-5:]) for r in tito_runs)
    base_last = statistics.median(statistics.fmean(r["seconds"][-5:]) for r in base_runs)
    identical = [a == b for a, b in zip(tito_runs[0]["prompts"], base_runs[0]["prompts"], strict=True)]
    return {
        "conversation_tokens": len(tito_runs[0]["final"]),
        "tito_total_s": round(tito_total, 5),
        "retokenize_total_s": round(base_total, 5),
        "speedup_total": round(base_total / tito_total, 2),
        "tito_per_turn_at_end_ms": round(tito_last * 1e3, 3),
        "retokenize_per_turn_at_end_ms": round(base_last * 1e3, 3),
        "speedup_at_end": round(base_last / tito_last, 2),
        "tokens_encoded_tito": tito_runs[0]["encoded"],
        "tokens_encoded_retokenize": base_runs[0]["encoded"],
        "identical_prompt_ids_every_turn": all(identical),
        "turns_with_different_ids": [i for i, same in enumerate(identical) if not same],
    }


def conversation_script(turns: int, tokens_per_turn: int, *, thinking: bool, seed: int) -> list[dict[str, Any]]:
    """Per turn: the messages appended before it and the assistant's answer (about half each)."""
    rng = random.Random(seed)

    def text(tokens: int) -> str:  # ~1.3 tokens per word with these words
        return " ".join(rng.choice(WORDS) for _ in range(max(1, int(tokens / 1.3))))

    half = tokens_per_turn // 2
    script = []
    for turn in range(turns):
        if turn == 0:
            appended = [{"role": "system", "content": "You are a coding agent."}, {"role": "user", "content": text(half)}]
        elif turn % 5 == 0:
            appended = [{"role": "user", "content": text(half)}]
        else:
            appended = [{"role": "tool", "tool_call_id": f"c{turn}", "content": text(half)}]
        answer: dict[str, Any] = {"role": "assistant", "content": text(half // 2 if thinking else half)}
        if thinking:
            answer["reasoning_content"] = text(half // 2)
        script.append({"appended": appended, "answer": answer})
    return script


def _answer_text(answer: dict[str, Any]) -> str:
    """What the model would have generated for ``answer`` (the template's own spelling)."""
    if answer.get("reasoning_content"):
        return f"<think>\n{answer['reasoning_content']}\n</think>\n\n{answer['content']}"
    return answer["content"]


def run_tito(tito: Any, script: list[dict[str, Any]]) -> dict[str, Any]:
    from miles_tito.conversation import Conversation
    from miles_tito.messages import ChatMessage

    conversation = Conversation(tito)
    history: list[dict[str, Any]] = []
    seconds, prompts, encoded = [], [], 0
    end_id = tito.stop_token_ids[0]
    for step in script:
        history += step["appended"]
        start = time.perf_counter()
        prepared = conversation.prepare([ChatMessage.from_openai(m, i) for i, m in enumerate(history)], None)
        seconds.append(time.perf_counter() - start)
        encoded += len(prepared.input_ids) - (len(conversation.token_ids) if conversation.turns else 0)
        prompts.append(prepared.input_ids)
        output = tito.encode(_answer_text(step["answer"])) + [end_id]
        message = ChatMessage.from_openai(step["answer"], len(history))
        conversation.commit(prepared, output_ids=output, output_logprobs=[0.0] * len(output), finish_reason="stop", weight_version=0, message=message)
        history.append(step["answer"])
    return {"seconds": seconds, "prompts": prompts, "encoded": encoded, "final": conversation.token_ids}


def run_retokenize(tito: Any, script: list[dict[str, Any]]) -> dict[str, Any]:
    from miles_tito.messages import ChatMessage

    history: list[dict[str, Any]] = []
    seconds, prompts, encoded = [], [], 0
    for step in script:
        history += step["appended"]
        start = time.perf_counter()
        messages = [ChatMessage.from_openai(m, i) for i, m in enumerate(history)]
        ids = tito.encode(tito.render(messages, None, add_generation_prompt=True))
        seconds.append(time.perf_counter() - start)
        encoded += len(ids)
        prompts.append(ids)
        history.append(step["answer"])
    return {"seconds": seconds, "prompts": prompts, "encoded": encoded}
