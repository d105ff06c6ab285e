"""CUDA-graph decode: bucket arithmetic (CPU) and, on a GPU, that replayed graphs give what eager
decode steps give while requests join and leave and the cache grows (skipped without CUDA)."""

from __future__ import annotations

import asyncio

import pytest
import torch
from miles_contracts.wire.engine import GenerateRequest, SamplingParams
from miles_engine.cuda_graphs import batch_buckets, bucket_for, length_bucket


def test_batch_buckets_cover_every_size_up_to_the_maximum():
    assert batch_buckets(1) == [1]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(64)[:7] == [1, 2, 4, 8, 12, 16, 24] and batch_buckets(64)[-1] == 64
    buckets = batch_buckets(300)
    assert buckets[-1] == 300 and buckets == sorted(set(buckets))
    for size in range(1, 301):
        chosen = bucket_for(size, buckets)
        assert size <= chosen and chosen - size < max(8, size / 4)  # padding stays bounded
    with pytest.raises(ValueError, match="exceeds the largest bucket"):
        bucket_for(301, buckets)


def test_length_buckets_are_powers_of_two_capped_by_the_cache():
    assert length_bucket(1, 1024) == 128
    assert length_bucket(129, 1024) == 256
    assert length_bucket(700, 768) == 768
    assert length_bucket(768, 768) == 768


def _generate_all(engine, requests):
    async def go():
        return await asyncio.gather(*(engine.generate(r) for r in requests))

    return asyncio.run(go())


@pytest.mark.gpu
def test_graph_decode_matches_eager_decode(dense_path):
    from miles_engine.engine import Engine

    # Different prompt lengths and budgets: the batch shrinks step by step (bucket changes), and
    # one long prompt makes the cache grow past its first allocation (graphs are recaptured).
    requests = [
        GenerateRequest(input_ids=[1] + [10 + (i * 7 + j) % 200 for j in range(3 + 5 * i)], return_logprob=True,
                        sampling_params=SamplingParams(max_new_tokens=4 + 3 * i, temperature=0.0, ignore_eos=True))
        for i in range(11)
    ]
    requests.append(GenerateRequest(input_ids=[1] + [20 + j % 100 for j in range(300)], return_logprob=True,
                                    sampling_params=SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)))
    results = {}
    for eager in (False, True):
        engine = Engine(dense_path, device="cuda", dtype="float32", max_running_requests=16, disable_cuda_graph=eager)
        try:
            short = _generate_all(engine, requests[:11])
            long = _generate_all(engine, requests)  # grows the cache while requests run
            info = engine.server_info()["cuda_graphs"]
        finally:
            engine.shutdown()
        results[eager] = (short + long, info)
    graphed, info = results[False]
    eager, eager_info = results[True]
    assert eager_info == {"enabled": False}
    assert info["enabled"] and info["captured"] >= 3 and info["replays"] > 0
    for g, e in zip(graphed, eager, strict=True):
        assert g.output_ids == e.output_ids
        got = torch.tensor([lp for lp, *_ in g.meta_info.output_token_logprobs])
        want = torch.tensor([lp for lp, *_ in e.meta_info.output_token_logprobs])
        assert (got - want).abs().max().item() < 1e-3


class _CannotCapture:
    """Stands in for DecodeGraphs on CPU: every capture fails, as an uncapturable model's would."""

    buckets = [1, 2, 4, 8]

    def __init__(self) -> None:
        self.calls = 0

    def decode(self, tokens, positions):
        from miles_engine.cuda_graphs import GraphCaptureError

        self.calls += 1
        raise GraphCaptureError("capturing the decode step failed: operation not permitted when stream is capturing")


def test_a_failed_capture_turns_graphs_off_and_the_step_runs_eagerly(dense_path):
    from miles_engine.engine import Engine

    request = GenerateRequest(input_ids=[1, 504, 3458, 282], return_logprob=True,
                              sampling_params=SamplingParams(max_new_tokens=6, temperature=0.0, ignore_eos=True))
    outputs = []
    for fail in (True, False):
        engine = Engine(dense_path, device="cpu", max_running_requests=4)
        stand_in = _CannotCapture()
        if fail:
            engine.scheduler.call(lambda e=engine, s=stand_in: setattr(e.scheduler.runner, "graphs", s)).result()
        try:
            outputs.append(_generate_all(engine, [request])[0])
            assert engine.scheduler.runner.graphs is None
            assert engine.scheduler.stats.step_errors == 0
        finally:
            engine.shutdown()
        if fail:
            assert stand_in.calls == 1  # tried once, then never again
    failed, plain = outputs
    assert failed.output_ids == plain.output_ids and len(failed.output_ids) == 6
    assert failed.meta_info.finish_reason.type == "length"
