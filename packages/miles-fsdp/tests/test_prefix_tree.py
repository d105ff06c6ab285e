"""Prefix-tree training: the tree layout trains exactly what the flat rows train (fp32, CPU)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from miles_algorithms import objective
from miles_contracts import TrainBatch
from miles_fsdp.packing import plan_micro_batches
from miles_fsdp.passes import attention_pair_cost, layout_costs
from miles_fsdp.prefix_tree import TreePolicy, build_prefix_tree

SMOLLM2 = {"hidden_size": 576, "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}


def _batch(rows: list[list[int]], trained_from: list[int], seed: int = 0) -> TrainBatch:
    """Right-padded rows; row ``r`` trained on ``[trained_from[r], len)``; advantages of mixed sign."""
    b, t = len(rows), max(len(r) for r in rows)
    tokens = torch.zeros(b, t, dtype=torch.long)
    attention = torch.zeros(b, t, dtype=torch.long)
    loss_mask = torch.zeros(b, t)
    for r, (row, start) in enumerate(zip(rows, trained_from, strict=True)):
        tokens[r, : len(row)] = torch.tensor(row)
        attention[r, : len(row)] = 1
        loss_mask[r, start : len(row)] = 1.0
    gen = torch.Generator().manual_seed(seed)
    advantages = torch.randn(b, 1, generator=gen) * loss_mask
    return TrainBatch(tokens=tokens, attention_mask=attention, loss_mask=loss_mask,
                      rollout_logprobs=-torch.rand(b, t, generator=gen) * loss_mask, rewards=torch.zeros(b),
                      group_ids=torch.zeros(b, dtype=torch.long), rollout_ids=torch.arange(b), advantages=advantages)


def _random(n: int, gen: torch.Generator, vocab: int = 4000) -> list[int]:
    return torch.randint(1, vocab, (n,), generator=gen).tolist()


def grpo_group() -> TrainBatch:
    """One prompt of 13 tokens, 6 completions of odd lengths (two identical ones)."""
    gen = torch.Generator().manual_seed(1)
    prompt = _random(13, gen)
    completions = [_random(n, gen) for n in (7, 3, 11, 5, 9)]
    completions.append(list(completions[1]))
    return _batch([prompt + c for c in completions], [13] * 6)


def branched_episodes() -> TrainBatch:
    """Two episodes' branches: nested shared histories, a compaction that rewrites history at depth 6,
    a sub-agent row, a row that is a strict prefix of another, and model tokens trained in shared parts."""
    gen = torch.Generator().manual_seed(2)
    history, turn1, turn2 = _random(10, gen), _random(6, gen), _random(5, gen)
    compacted, sub_agent, other = _random(7, gen), _random(9, gen), _random(8, gen)
    rows = [
        history + turn1,                      # branch 1, turn 1
        history + turn1 + turn2,              # branch 1, turn 2 (extends row 0)
        history[:6] + compacted,              # compaction: rewrites history after 6 tokens
        history + turn1 + sub_agent,          # sub-agent forked at the end of turn 1
        other,                                # an unrelated episode
        other[:5] + _random(4, gen),          # its retry from token 5
    ]
    return _batch(rows, [10, 16, 6, 12, 2, 3])


def unshared_rows() -> TrainBatch:
    gen = torch.Generator().manual_seed(3)
    rows = [[r + 1, *_random(n, gen)] for r, n in enumerate((8, 3, 12, 5))]  # distinct first tokens
    return _batch(rows, [2, 1, 4, 2])


WORKLOADS = {"grpo_group": grpo_group, "branched_episodes": branched_episodes, "unshared_rows": unshared_rows}


# ----------------------------------------------------------------------------- the trie


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_every_row_is_its_path_in_the_tree(workload: str) -> None:
    batch = WORKLOADS[workload]()
    lengths = batch.attention_mask.sum(1).tolist()
    tree = build_prefix_tree(batch.tokens, lengths)
    mask = tree.dense_mask(torch.device("cpu"))[0, 0]
    for r, n in enumerate(lengths):
        nodes = tree.node_index[r, :n]
        assert torch.equal(tree.tokens[nodes], batch.tokens[r, :n])
        assert tree.depth[nodes].tolist() == list(range(n))
        # the last node of the row sees exactly the row's nodes
        assert sorted(torch.nonzero(mask[nodes[-1]]).flatten().tolist()) == sorted(nodes.tolist())
    assert torch.equal(batch.tokens.reshape(-1)[tree.owner], tree.tokens)
    expected = {"grpo_group": 13 + 7 + 3 + 11 + 5 + 9, "branched_episodes": 21 + 7 + 9 + 8 + 4,
                "unshared_rows": sum(lengths)}[workload]
    assert tree.num_nodes == expected


# ----------------------------------------------------------------------------- equality with flat rows


def _loss_and_gradients(backend, batch: TrainBatch) -> tuple[float, dict[str, torch.Tensor]]:
    params = backend.config.algorithm
    policy_loss = backend.kernel.policy_losses().get("ppo_clip").loss
    correction = backend.kernel.mismatch_corrections().get("none").correct
    total = []

    def loss_fn(micro, outputs):
        loss, shares = objective.actor_loss(outputs[0], micro, params, policy_loss=policy_loss, correction=correction,
                                            entropy=outputs[1])
        total.append(loss.detach())
        return loss, shares

    backend.runner.accumulate("train", backend.actor, objective.prepare_batch(batch), loss_fn, with_entropy=True)
    grads = {n: p.grad.full_tensor().clone() for n, p in backend.actor.hf.named_parameters()}
    backend.actor.zero_grad(set_to_none=True)
    return float(sum(total)), grads


@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_tree_loss_and_every_gradient_equal_the_flat_rows(tiny_dense, backend_factory, workload: str) -> None:
    batch = WORKLOADS[workload]()
    common = {"micro_batch_tokens": 10_000, "algorithm": {"entropy_coef": 0.01}}
    tree = backend_factory(tiny_dense, fsdp={"prefix_tree": "on"}, **common)
    flat = backend_factory(tiny_dense, fsdp={"prefix_tree": "off", "packing": False}, **common)

    assert tree.runner.my_micro_batches(batch) == [list(range(batch.size))]  # one micro-batch: the whole tree
    _, inputs, _ = tree.runner._inputs(batch, list(range(batch.size)))
    assert inputs.input_ids.shape[1] == build_prefix_tree(batch.tokens, batch.attention_mask.sum(1).tolist()).num_nodes
    logprobs, entropy = tree.compute_logprobs_and_entropy(batch)
    want_logprobs, want_entropy = flat.compute_logprobs_and_entropy(batch)
    # values one by one: fp32 rounding of a differently shaped attention (entropy ~ 8, so 1e-5 is ~1e-6 relative)
    torch.testing.assert_close(logprobs, want_logprobs, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(entropy, want_entropy, rtol=1e-5, atol=1e-5)

    tree_loss, tree_grads = _loss_and_gradients(tree, batch)
    flat_loss, flat_grads = _loss_and_gradients(flat, batch)
    assert tree_loss == pytest.approx(flat_loss, rel=1e-6)
    assert flat_grads.keys() == tree_grads.keys()
    for name, want in flat_grads.items():
        assert float(want.norm()) > 0, name
        relative = float((tree_grads[name] - want).norm() / want.norm())
        assert relative <= 1e-6, f"{name}: relative gradient error {relative:.2e}"


def test_a_tree_split_over_micro_batches_and_ranks_plan_still_trains_every_row(tiny_dense, backend_factory) -> None:
    batch = branched_episodes()
    tree = backend_factory(tiny_dense, fsdp={"prefix_tree": "on"}, micro_batch_tokens=30)
    flat = backend_factory(tiny_dense, fsdp={"prefix_tree": "off"}, micro_batch_tokens=30)
    assert len(tree.runner.my_micro_batches(batch)) > 1
    _assert_trains_the_same(tree, flat, batch)


def _assert_trains_the_same(tree, flat, batch: TrainBatch) -> None:
    tree_loss, tree_grads = _loss_and_gradients(tree, batch)
    flat_loss, flat_grads = _loss_and_gradients(flat, batch)
    assert tree_loss == pytest.approx(flat_loss, rel=1e-6)
    for name, want in flat_grads.items():
        assert float((tree_grads[name] - want).norm() / want.norm()) <= 1e-6, name


def test_groups_are_planned_whole_by_tree_size_and_train_as_the_flat_rows(tiny_dense, backend_factory) -> None:
    gen = torch.Generator().manual_seed(5)
    rows, group = [], []
    for g in range(4):  # 4 GRPO groups: a 12-token prompt, 3 completions of 4 tokens
        head = _random(12, gen)
        rows += [head + _random(4, gen) for _ in range(3)]
        group += [g] * 3
    order = torch.randperm(len(rows), generator=gen).tolist()  # groups interleaved, as a batch arrives
    batch, group = _batch([rows[i] for i in order], [12] * len(rows)), [group[i] for i in order]
    budget = 2 * (12 + 3 * 4)  # two groups' trees, or three 16-token rows flat
    tree = backend_factory(tiny_dense, fsdp={"prefix_tree": "on"}, micro_batch_tokens=budget)
    flat = backend_factory(tiny_dense, fsdp={"prefix_tree": "off"}, micro_batch_tokens=budget)

    plan = tree.runner.my_micro_batches(batch)
    assert len(plan) == 2
    for micro in plan:  # two whole groups in each pass
        assert sorted(Counter(group[r] for r in micro).values()) == [3, 3]
    assert len(flat.runner.my_micro_batches(batch)) == 4
    _assert_trains_the_same(tree, flat, batch)


def test_auto_plans_by_tree_only_where_rows_share_prefixes(tiny_dense, backend_factory) -> None:
    backend = backend_factory(tiny_dense, fsdp={"prefix_tree": "auto"}, micro_batch_tokens=40)
    batch = unshared_rows()  # nothing shared: exactly the prefix-blind plan
    assert backend.runner.my_micro_batches(batch) == plan_micro_batches(batch.attention_mask.sum(1).tolist(), 40, 1)[0]
    # a 30-token prompt shared by 6 rows of 33: flat, one row per 40-token pass; as trees, 3 rows a pass
    assert len(plan_micro_batches([33] * 6, 40, 1)[0]) == 6
    assert [len(micro) for micro in backend.runner.my_micro_batches(_group(30, 6, 3))] == [3, 3]


# ----------------------------------------------------------------------------- when the tree pays


def _group(prompt: int, samples: int, completion: int) -> TrainBatch:
    gen = torch.Generator().manual_seed(4)
    head = _random(prompt, gen)
    return _batch([head + _random(completion, gen) for _ in range(samples)], [prompt] * samples)


@pytest.mark.parametrize("attention", ["sdpa", "flex_attention"])
def test_the_cost_model_takes_the_tree_only_when_it_pays(attention: str) -> None:
    policy = TreePolicy("auto", attention, attention_pair_cost(SMOLLM2))
    device = torch.device("cpu")

    def chosen(batch: TrainBatch) -> bool:
        lengths = batch.attention_mask.sum(1).tolist()
        flat = min(layout_costs(batch.attention_mask, policy.pair_cost))
        return policy.inputs(batch, lengths, flat, device) is not None

    assert chosen(_group(2048, 8, 256))  # GRPO, long prompt: 4K tree tokens instead of 18K
    assert chosen(_group(256, 8, 64))
    assert not chosen(_group(2, 8, 300))  # two shared tokens of 302: nothing to gain
    assert not chosen(unshared_rows())  # no sharing: the flat layout (padded or packed) as before
    # forced on, a tree is built whatever it costs; forced off, never
    assert TreePolicy("on", attention, policy.pair_cost).inputs(unshared_rows(), [9, 4, 13, 6], 1.0, device) is not None
    grpo = _group(2048, 8, 256)
    assert TreePolicy("off", attention, policy.pair_cost).inputs(grpo, [2304] * 8, 1e12, device) is None
    # auto with a kernel that takes no mask stays flat
    assert TreePolicy("auto", "flash_attention_2", policy.pair_cost).inputs(grpo, [2304] * 8, 1e12, device) is None


def test_forcing_the_tree_on_a_kernel_without_masks_is_a_config_error() -> None:
    from miles_fsdp.config import FSDPSection
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="fsdp.prefix_tree: on needs fsdp.attn_implementation"):
        FSDPSection(prefix_tree="on", attn_implementation="flash_attention_2")
    with pytest.raises(ValidationError, match="prefix_tree"):
        FSDPSection(prefix_tree="sometimes")
    FSDPSection(prefix_tree="auto", attn_implementation="flash_attention_2")  # auto: simply never a tree
    # YAML reads a bare `on` / `off` as a boolean
    assert FSDPSection(prefix_tree=True).prefix_tree == "on" and FSDPSection(prefix_tree=False).prefix_tree == "off"


# ----------------------------------------------------------------------------- the GPU kernels


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["sdpa", "flex_attention"])
def test_tree_on_cuda_equals_the_flat_rows_in_fp32(tiny_dense, make_config, attention: str) -> None:
    """The CUDA forms of the tree mask (dense under sdpa; flex_attention's block-sparse BlockMask,
    which has no CPU backward) train what the flat rows train, fp32 so rounding stays small."""
    from dataclasses import replace

    from miles.context import context_for
    from miles.sections import ModelSection
    from miles_contracts import Process
    from miles_fsdp.backend import FSDPBackend

    batch = branched_episodes()
    results = []
    for fsdp in ({"prefix_tree": "on", "attn_implementation": attention, "compile": False},
                 {"prefix_tree": "off", "packing": False, "compile": False}):
        config = make_config(tiny_dense, fsdp=fsdp, micro_batch_tokens=10_000, algorithm={"entropy_coef": 0.01})
        config = replace(config, model=ModelSection(name=str(tiny_dense), device="cuda", dtype="float32"))
        backend = FSDPBackend(context_for(config, Process.trainer_rank(0)))
        try:
            results.append(_loss_and_gradients(backend, batch))
        finally:
            backend.close()
    (tree_loss, tree_grads), (flat_loss, flat_grads) = results
    assert tree_loss == pytest.approx(flat_loss, rel=1e-5)
    for name, want in flat_grads.items():
        assert float((tree_grads[name] - want).norm() / want.norm()) <= 1e-4, name
