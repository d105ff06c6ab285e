"""``miles bench train`` on the CPU: the report's shape, and ``--profile``'s op tables."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_bench_train_reports_rates_and_writes_a_profile(tmp_path) -> None:
    from miles.context import context_for
    from miles_fsdp.bench import run_benchmark

    report = run_benchmark(ctx=context_for(), preset="tiny", seq_lens=[64], tokens_per_step=128, warmup=1, steps=1,
                           device="cpu", gradient_checkpointing=False, options={"compile": False}, baseline=False,
                           peak_tflops=1.0, profile_dir=tmp_path / "prof")
    (entry,) = report["results"]
    assert (entry["seq_len"], entry["rows"], entry["tokens_per_step"]) == (64, 2, 128)
    miles = entry["miles"]
    assert miles["step_s"] > 0 and miles["tokens_per_s"] == pytest.approx(128 / miles["step_s"])
    assert miles["mfu"] == pytest.approx(miles["tflops"] / 1.0) and report["devices"] == 1
    profile = tmp_path / "prof" / "profile-fsdp-L64.txt"
    assert miles["profile"] == str(profile) and miles["profiled_step_s"] > 0
    text = profile.read_text()
    assert "one step under the profiler" in text and "aten::mm" in text  # the model's matmuls are in the table
    assert miles["kernel_s"] is None  # no device kernels on the CPU


def test_rates_are_per_device_when_ranks_share_a_step() -> None:
    from miles_fsdp.bench import _rates

    # 8 TFLOP in 2 s on two devices of peak 4 TFLOP/s each: 2 TFLOP/s per device, half the peak
    shared = _rates({"step_s": 2.0}, tokens=100, flops=8e12, peak_tflops=4.0, devices=2)
    assert shared["tokens_per_s"] == 50.0 and shared["tflops"] == pytest.approx(2.0) and shared["mfu"] == pytest.approx(0.5)
    assert _rates({"step_s": 2.0}, tokens=100, flops=8e12, peak_tflops=4.0)["mfu"] == pytest.approx(1.0)


def test_length_spread_gives_varied_rows_and_counts_only_their_tokens() -> None:
    from miles_fsdp.bench import make_batch, row_lengths_for

    assert row_lengths_for(3, 64) == [64, 64, 64]
    lengths = row_lengths_for(16, 64, 0.5)
    assert lengths == row_lengths_for(16, 64, 0.5)  # deterministic
    assert all(32 <= n <= 64 for n in lengths) and len(set(lengths)) > 1
    batch = make_batch(16, 64, 100, lengths=lengths)
    assert batch.attention_mask.sum(1).tolist() == lengths
    assert (batch.loss_mask <= batch.attention_mask).all() and (batch.tokens[batch.attention_mask == 0] == 0).all()
    with pytest.raises(ValueError, match="length spread"):
        row_lengths_for(2, 64, 1.0)


@pytest.mark.slow
def test_bench_train_with_a_length_spread_reports_the_real_tokens() -> None:
    from miles.context import context_for
    from miles_fsdp.bench import FlopCounter, build_model, run_benchmark

    report = run_benchmark(ctx=context_for(), preset="tiny", seq_lens=[64], tokens_per_step=256, warmup=1, steps=1,
                           device="cpu", gradient_checkpointing=False, options={"compile": False}, baseline=True,
                           peak_tflops=1.0, length_spread=0.5)
    (entry,) = report["results"]
    lengths = entry["row_lengths"]
    assert report["length_spread"] == 0.5 and len(lengths) == 4 and entry["tokens_per_step"] == sum(lengths) < 256
    counter = FlopCounter.of(build_model("tiny", device="meta"))
    for side in ("miles", "baseline"):
        rates = entry[side]
        assert rates["tflops"] * rates["step_s"] * 1e12 == pytest.approx(sum(counter.sequence(n) for n in lengths))


def test_another_backend_is_built_by_the_given_kernel_with_its_section(tmp_path) -> None:
    """``--backend NAME``: the backend comes from the command's kernel (here one only this test's
    kernel knows), built by its spec with the benchmark's config and ``options`` as its section."""
    from miles import hookimpl
    from miles.context import context_for
    from miles.kernel import Kernel
    from miles.plugins import PluginSelection, load_plugins
    from miles_contracts import ConfigSectionSpec, TrainBackendSpec
    from miles_fsdp.bench import run_benchmark
    from pydantic import BaseModel, ConfigDict

    class IdleSection(BaseModel):
        model_config = ConfigDict(extra="forbid")
        depth: int = 1

    built = []

    class Idle:
        """Counts its steps and trains nothing."""

        def __init__(self, ctx) -> None:
            self.ctx, self.steps, self.closed = ctx, 0, False

        def train_step(self, batch) -> dict[str, float]:
            self.steps += 1
            return {}

        def close(self) -> None:
            self.closed = True

    class IdlePlugin:
        @hookimpl
        def miles_register_train_backends(self, register) -> None:
            register("idle", TrainBackendSpec(lambda ctx: built.append(Idle(ctx)) or built[-1]))

        @hookimpl
        def miles_register_config_sections(self, register) -> None:
            register("idle", ConfigSectionSpec(IdleSection))

    selection = PluginSelection.from_settings(None, ())
    kernel = Kernel(load_plugins(selection), selection)
    kernel.register_plugin(IdlePlugin(), "idle_for_tests")
    report = run_benchmark(ctx=context_for(kernel=kernel), preset="tiny", seq_lens=[32], tokens_per_step=64, warmup=1,
                           steps=2, device="cpu", gradient_checkpointing=False, options={"depth": 3}, baseline=False,
                           peak_tflops=1.0, backend="idle", section="idle", work_dir=tmp_path)
    (backend,) = built
    assert backend.ctx.kernel is kernel and backend.steps == 3 and backend.closed
    config = backend.ctx.config
    assert config.train.backend == "idle" and config.section("idle", IdleSection).depth == 3
    assert (tmp_path / "tiny-rank0" / "config.json").is_file() and config.model.name == str(tmp_path / "tiny-rank0")
    assert report["idle_options"] == {"depth": 3} and report["results"][0]["miles"]["backend"] == "idle"


def test_bench_train_tree_counts_computed_tokens_and_keeps_the_loss() -> None:
    from miles.context import context_for
    from miles_fsdp.bench_tree import run_tree_benchmark

    report = run_tree_benchmark(ctx=context_for(), preset="tiny", device="cpu", options={"compile": False},
                                attentions=["sdpa"], warmup=1, repeats=3, scale=1 / 64, workloads=["grpo"])
    grpo = report["workloads"]["grpo"]
    # 32-token prompt + 8 completions of 4: the flat rows compute 8 x 36, the tree 32 + 8 x 4 (fewer
    # when two random completions happen to start alike)
    assert grpo["flat"]["computed_tokens"] == grpo["flat_tokens"] == 288
    tree = grpo["tree_sdpa"]
    assert 32 + 8 <= tree["computed_tokens"] <= 64 and tree["tokens_ratio"] == pytest.approx(288 / tree["computed_tokens"])
    assert tree["tree_micro_batches"] == tree["micro_batches"] == 1 and grpo["flat"]["tree_micro_batches"] == 0
    assert len(tree["step_s"]) == 3 and tree["step_s_min"] <= tree["step_s_median"] <= tree["step_s_max"]
    assert tree["loss_relative_difference"] <= 1e-6
    assert tree["first_step_grad_norm"] == pytest.approx(grpo["flat"]["first_step_grad_norm"], rel=1e-5)


def test_bench_train_tree_plans_several_groups_into_one_pass() -> None:
    from miles.context import context_for
    from miles_fsdp.bench_tree import run_tree_benchmark

    report = run_tree_benchmark(ctx=context_for(), preset="tiny", device="cpu", options={"compile": False},
                                attentions=["sdpa"], warmup=1, repeats=3, scale=1 / 64, workloads=["grpo"], groups=3)
    grpo = report["workloads"]["grpo"]
    # budget: one group's flat size (288 tokens); flat runs a group per pass, the trees (~64 nodes each) share one
    assert report["grpo_groups"] == 3 and grpo["micro_batch_tokens"] == 288 and grpo["flat_tokens"] == 3 * 288
    assert grpo["flat"]["micro_batches"] == 3
    assert grpo["tree_sdpa"]["micro_batches"] == grpo["tree_sdpa"]["tree_micro_batches"] == 1
    assert grpo["tree_sdpa"]["loss_relative_difference"] <= 1e-6


def test_episode_rows_share_the_system_prompt_and_train_only_answers() -> None:
    from miles_fsdp.bench_tree import EpisodeShape, episodes_batch
    from miles_fsdp.prefix_tree import build_prefix_tree

    shape = EpisodeShape(episodes=2, system=6, task=3, answer=2, tool=4, turns=4, compact_every=2, summary=2,
                         sub_agent_system=5, sub_agent_turns=1)
    batch = episodes_batch(100, shape)
    lengths = batch.attention_mask.sum(1).tolist()
    # per episode: two compaction epochs (the second restarts from a summary) and a sub-agent row
    assert lengths == [9 + 2 * 6, 9 + 2 + 2 * 6, 8 + 6] * 2
    assert int(batch.loss_mask.sum()) == 2 * (4 * 2 + 1 * 2)
    tree = build_prefix_tree(batch.tokens, lengths)
    # shared: system + task by the four epoch rows, task-led sub-agent rows by each other
    assert tree.num_nodes == sum(lengths) - 3 * 9 - 8


def test_the_qwen3_8b_preset_is_qwen3_8bs_published_shape() -> None:
    """The largest LoRA shape (scripts/h200/lora_largest.py): built on the meta device, no memory."""
    import torch
    from miles_fsdp.bench import PRESETS
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(PRESETS["qwen3-8b"])
    config = AutoConfig.for_model(shape.pop("model_type"), **shape)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == 8_190_735_360  # Qwen3-8B's model card: 8.2 B
    assert model.model.layers[0].self_attn.q_proj.weight.shape == (4096, 4096)
    assert model.model.layers[0].self_attn.k_proj.weight.shape == (1024, 4096)


def test_on_policy_pairs_alternate_their_order_and_report_the_median_runs() -> None:
    from miles_fsdp.bench import _on_policy_pairs

    calls: list[tuple[bool, bool]] = []
    steps = {False: iter([1.2, 0.9]), True: iter([1.5, 1.0, 1.3])}  # the first default (1.0) is measured before

    def arm(invariant: bool, last: bool) -> dict:
        calls.append((invariant, last))
        return {"step_s": next(steps[invariant]), "arm": invariant}

    default, invariant, pairs = _on_policy_pairs({"step_s": 1.0, "arm": False}, arm, 3)
    # pair 0 reuses the default already measured; pair 1 runs the invariant arm first, pair 2 the default first
    assert calls == [(True, False), (True, False), (False, False), (False, True), (True, True)]
    assert [(p["default_step_s"], p["true_on_policy_step_s"]) for p in pairs] == [(1.0, 1.5), (1.2, 1.0), (0.9, 1.3)]
    assert [p["slowdown"] for p in pairs] == [1.5, 1.0 / 1.2, 1.3 / 0.9]
    assert default["step_s"] == 1.0 and invariant["step_s"] == 1.3  # the median run of each arm
