"""/generate on a real server (tiny random Llama): inputs, determinism, seeds, stop conditions."""

from __future__ import annotations

PROMPT = [1, 504, 3458, 282, 4649, 314]


def sampled(engine, **params):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 24, "temperature": 1.0, "ignore_eos": True, **params}}
    return engine.generate(body)


def test_generate_by_ids_returns_tokens_text_and_meta(dense):
    out = dense.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0.0, "ignore_eos": True},
                          "rid": "by-ids"})
    meta = out["meta_info"]
    assert len(out["output_ids"]) == 8
    assert meta["id"] == "by-ids"
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == 8
    assert meta["finish_reason"] == {"type": "length", "length": 8}
    assert meta["weight_version"] == dense.engine.weight_version
    tokenizer = dense.engine.loaded.tokenizer
    assert out["text"] == tokenizer.decode(out["output_ids"], skip_special_tokens=True)


def test_generate_by_text_tokenizes_like_the_tokenizer(dense):
    text = "The capital of France is"
    out = dense.generate({"text": text, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
    ids = dense.engine.loaded.tokenizer(text)["input_ids"]
    by_ids = dense.generate({"input_ids": ids, "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}})
    assert out["meta_info"]["prompt_tokens"] == len(ids)
    assert out["output_ids"] == by_ids["output_ids"]


def test_greedy_is_deterministic_and_independent_of_batch(dense):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 16, "temperature": 0.0, "ignore_eos": True}}
    alone = dense.generate(body)["output_ids"]
    again = dense.generate(body)["output_ids"]
    assert alone == again
    # The same request inside a batch of others decodes to the same tokens.
    import concurrent.futures as cf

    others = [{"input_ids": [7 + i] * (3 + i), "sampling_params": {"max_new_tokens": 16, "ignore_eos": True}} for i in range(6)]
    with cf.ThreadPoolExecutor(8) as pool:
        futures = [pool.submit(dense.generate, b) for b in [*others[:3], body, *others[3:]]]
        batched = futures[3].result()["output_ids"]
        for f in futures:
            f.result()
    assert batched == alone


def test_seeded_sampling_is_reproducible_and_seed_dependent(dense):
    first = sampled(dense, sampling_seed=1234)["output_ids"]
    second = sampled(dense, sampling_seed=1234)["output_ids"]
    other = sampled(dense, sampling_seed=99)["output_ids"]
    assert first == second
    assert first != other


def test_stop_token_ids_end_generation_at_the_first_match(dense):
    free = sampled(dense, sampling_seed=5)["output_ids"]
    stop = free[6]
    first = free.index(stop)
    eos = dense.engine.loaded.eos_token_ids
    assert not eos & set(free[: first + 1]), "the seed must not sample EOS before the stop token"
    out = sampled(dense, sampling_seed=5, stop_token_ids=[stop], ignore_eos=False)
    assert out["output_ids"] == free[: first + 1]  # the stop token is kept in output_ids
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # as SGLang: ignore_eos switches off every stop token, stop_token_ids included
    assert sampled(dense, sampling_seed=5, stop_token_ids=[stop])["output_ids"] == free


def test_stop_string_trims_text_unless_no_stop_trim(dense):
    free = sampled(dense, sampling_seed=11)
    tokenizer = dense.engine.loaded.tokenizer
    piece = tokenizer.decode(free["output_ids"][10:12], skip_special_tokens=True)
    assert piece.strip(), "the chosen stop string must be visible text"
    out = sampled(dense, sampling_seed=11, stop=[piece])
    reason = out["meta_info"]["finish_reason"]
    assert reason == {"type": "stop", "matched": piece}
    assert piece not in out["text"]
    assert free["text"].startswith(out["text"])
    assert len(out["output_ids"]) <= 12
    untrimmed = sampled(dense, sampling_seed=11, stop=piece, no_stop_trim=True)
    assert untrimmed["output_ids"] == out["output_ids"]
    assert untrimmed["text"].endswith(piece) or piece in untrimmed["text"]


def test_eos_stops_unless_ignored_and_min_new_tokens_holds_it_back(dense):
    eos = sorted(dense.engine.loaded.eos_token_ids)[0]
    # stop_token_ids adds stop tokens; min_new_tokens masks every stop token until it is reached.
    out = sampled(dense, sampling_seed=3, stop_token_ids=[eos], min_new_tokens=10, max_new_tokens=10, ignore_eos=False)
    assert len(out["output_ids"]) == 10
    assert eos not in out["output_ids"]


def test_length_limit_and_zero_new_tokens(dense):
    out = sampled(dense, max_new_tokens=5)
    assert len(out["output_ids"]) == 5
    assert out["meta_info"]["finish_reason"]["type"] == "length"
    empty = sampled(dense, max_new_tokens=0)
    assert empty["output_ids"] == [] and empty["meta_info"]["finish_reason"] == {"type": "length", "length": 0}


def test_context_length_caps_generation(dense_path):
    from engine_support import serve_engine

    with serve_engine(dense_path, context_length=16) as small:
        out = small.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 100, "ignore_eos": True}})
        assert len(PROMPT) + len(out["output_ids"]) == 16
        assert out["meta_info"]["finish_reason"]["type"] == "length"


def test_top_k_one_equals_greedy_and_penalties_change_the_output(dense):
    greedy = dense.generate({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True}})
    top1 = sampled(dense, max_new_tokens=12, top_k=1, sampling_seed=4)
    assert top1["output_ids"] == greedy["output_ids"]
    # The tiny random model repeats itself greedily; a repetition penalty must break that.
    assert len(set(greedy["output_ids"])) < len(greedy["output_ids"])
    penalised = dense.generate({"input_ids": PROMPT, "sampling_params": {
        "max_new_tokens": 12, "temperature": 0.0, "ignore_eos": True, "repetition_penalty": 1.5,
        "frequency_penalty": 1.0, "presence_penalty": 1.0}})
    assert penalised["output_ids"] != greedy["output_ids"]
