"""Built-in plugin ``generators``: the ``single_turn`` generator.

One engine call per sample: the prompt is tokenized here (chat template for message lists), sent
as ``input_ids`` so the trajectory is exactly the ids the engine saw and produced, and the answer's
ids and log-probs are stored as they came back (token in, token out). With partial rollout
(``ctx.partial_rollout``), a generation a weight update aborted goes on from the tokens it has
(:mod:`miles.rollout.continuation`); each token keeps the weight version that sampled it. The
run's engine captures (``ctx.captures``) ride along on every call and land in the sample's stash.
"""

from __future__ import annotations

from miles_contracts import ExitReason, GenerateContext, GeneratorSpec, Sample, Status
from miles_contracts.wire.engine import GenerateRequest

from miles.engine_client import EngineRequestError, EngineUnavailableError
from miles.hookspecs import hookimpl
from miles.registry import Register
from miles.rollout.capture import store_captures
from miles.rollout.continuation import Generation, MalformedOutput, generate
from miles.rollout.tokens import prompt_token_ids

_FINISH = {
    "stop": (Status.COMPLETED, ExitReason.STOP),
    "length": (Status.TRUNCATED, ExitReason.LENGTH),
    "abort": (Status.ABORTED, ExitReason.ABORT),
}


async def single_turn(sample: Sample, ctx: GenerateContext) -> Sample:
    prompt_ids = prompt_token_ids(ctx.tokenizer, sample.prompt)
    budget = ctx.max_context_len - len(prompt_ids)
    if budget <= 0:
        sample.tokens = prompt_ids
        return sample.finish(Status.TRUNCATED, ExitReason.CONTEXT_OVERFLOW,
                             f"prompt has {len(prompt_ids)} tokens, context is {ctx.max_context_len}")
    params = ctx.sampling_params.model_copy(update={"max_new_tokens": min(ctx.sampling_params.max_new_tokens, budget)})
    request = GenerateRequest(input_ids=prompt_ids, sampling_params=params, return_logprob=True)
    try:
        generation = await generate(ctx.engine, request, routing_key=f"group-{sample.group_index}",
                                    partial_rollout=ctx.partial_rollout, captures=[c.spec for c in ctx.captures])
    except MalformedOutput as exc:
        sample.tokens = prompt_ids
        return sample.finish(Status.FAILED, ExitReason.ENGINE_ERROR, str(exc))
    except EngineRequestError as exc:
        sample.tokens = prompt_ids
        status = Status.FAILED if 400 <= exc.status_code < 500 else Status.ABORTED
        return sample.finish(status, ExitReason.ENGINE_ERROR, str(exc))
    except EngineUnavailableError as exc:
        sample.tokens = prompt_ids
        return sample.finish(Status.ABORTED, ExitReason.ENGINE_ERROR, str(exc))
    apply_generation(sample, prompt_ids, generation)
    return store_captures(sample, ctx.captures, generation.pieces)


def apply_generation(sample: Sample, prompt_ids: list[int], generation: Generation) -> Sample:
    """Fill ``sample`` from what the engine sampled (every output token is model-sampled: mask 1)."""
    output = generation.output_ids
    sample.tokens = prompt_ids + output
    sample.response_length = len(output)
    sample.response = generation.text
    sample.loss_mask = [1] * len(output)
    sample.rollout_logprobs = list(generation.logprobs)
    sample.token_versions = list(generation.token_versions)
    sample.weight_versions += generation.call_versions
    finish = generation.finish
    status, reason = _FINISH[finish.type] if finish else (Status.COMPLETED, ExitReason.STOP)
    return sample.finish(status, reason, finish.message if finish else None)


@hookimpl
def miles_register_generators(register: Register[GeneratorSpec]) -> None:
    register("single_turn", GeneratorSpec(single_turn))
