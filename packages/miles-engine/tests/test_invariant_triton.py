"""The Triton kernels of the true on-policy forward (``miles_engine.invariant_triton``).

Without a GPU they run in Triton's interpreter (``TRITON_INTERPRET=1``: the same kernel code,
block by block in NumPy), which checks what they compute against PyTorch and the key-range logic
of attention; NumPy's matmul is not row-invariant inside a block, so the bitwise checks that depend
on tensor cores (a row of a matmul tile in any position) are in the ``gpu`` tests at the end, run on
the H200 with the same kernels compiled.

Triton decides at import whether its language functions are interpreted, so the interpreted tests
run in a child pytest started with the variable set (:func:`test_the_kernels_in_the_interpreter`);
in this process they are skipped.
"""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest
import torch

# not imported here: this process only starts the interpreted child (and, on a GPU, the gpu tests
# import the kernels themselves); an import would only leave nanobind's leak report at exit
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
interpreted = pytest.mark.skipif(not INTERPRETED, reason="runs in the interpreter child")


@pytest.mark.skipif(INTERPRETED, reason="this is the child")
def test_the_kernels_in_the_interpreter(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    child = subprocess.run([sys.executable, "-m", "pytest", __file__, "-q", "-p", "no:cacheprovider", "-m", "not gpu",
                            f"--basetemp={tmp_path / 'child'}"], env=env, capture_output=True, text=True, timeout=300)
    assert child.returncode == 0, child.stdout[-6000:] + child.stderr[-3000:]
    passed = re.search(r"(\d+) passed", child.stdout.strip().splitlines()[-1])
    assert passed and int(passed.group(1)) == 18, child.stdout[-2000:]  # every interpreted test ran


@pytest.fixture(scope="module")
def kernels():
    from miles_engine import invariant_triton

    return invariant_triton


def _causal(queries: int, length: int, batch: int = 1) -> torch.Tensor:
    rows = torch.arange(length - queries, length)
    return (torch.arange(length)[None, :] <= rows[:, None])[None, None].expand(batch, 1, queries, length)


def _packed(lengths: list[int]) -> torch.Tensor:
    """The block-diagonal causal mask of documents packed in one row."""
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    pos = torch.arange(len(doc))
    return ((doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None]))[None, None]


@interpreted
def test_matmul_computes_the_product_with_and_without_bias(kernels):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(70, 96, generator=gen)
    weight = torch.randn(200, 96, generator=gen)
    bias = torch.randn(200, generator=gen)
    torch.testing.assert_close(kernels.matmul(x, weight, bias), x @ weight.T + bias, rtol=1e-5, atol=1e-4)
    strided = torch.randn(96, 70, generator=gen).T  # not contiguous: the kernel takes strides
    torch.testing.assert_close(kernels.matmul(strided, weight), strided @ weight.T, rtol=1e-5, atol=1e-4)
    assert kernels.matmul(x[:0], weight).shape == (0, 200)
    with pytest.raises(TypeError, match="one dtype"):
        kernels.matmul(x.double(), weight)


@interpreted
@pytest.mark.parametrize("mask_kind", ["none", "causal", "padded", "packed"])
def test_attention_matches_sdpa_over_the_same_keys(kernels, mask_kind):
    gen = torch.Generator().manual_seed(1)
    batch, heads, kv_heads, dim = (1 if mask_kind == "packed" else 2), 6, 2, 16
    length = 11
    if mask_kind == "none":
        mask = None
    elif mask_kind == "causal":
        mask = _causal(length, length, batch)
    elif mask_kind == "padded":  # left padding: row 1's first 4 keys are pads (their queries see only themselves)
        mask = _causal(length, length, batch).clone()
        mask[1, 0, :, :4] = False
        mask[1, 0, torch.arange(4), torch.arange(4)] = True
    else:
        mask = _packed([4, 7])
    q = torch.randn(batch, heads, length, dim, generator=gen)
    k = torch.randn(batch, kv_heads, length, dim, generator=gen)
    v = torch.randn(batch, kv_heads, length, dim, generator=gen)
    out = kernels.attention(q, k, v, mask, dim**-0.5)
    assert out.shape == (batch, length, heads, dim)
    expected = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1),
        attn_mask=mask, is_causal=mask is None, scale=dim**-0.5).transpose(1, 2)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


@interpreted
def test_attention_walks_each_querys_own_keys_so_decode_prefill_and_packing_agree(kernels):
    """The key blocks start at the query's first key: a decode step over a longer cache, the same
    query inside a prefill, and the same document packed after another give equal bits."""
    gen = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, n = 4, 2, 16, 45  # more keys than one block (32)
    q = torch.randn(1, heads, n, dim, generator=gen)
    k = torch.randn(1, kv_heads, n, dim, generator=gen)
    v = torch.randn(1, kv_heads, n, dim, generator=gen)
    prefill = kernels.attention(q, k, v, _causal(n, n), dim**-0.5)
    cache_k = torch.cat([k, torch.randn(1, kv_heads, 83, dim, generator=gen)], 2)  # a slot longer than the row
    cache_v = torch.cat([v, torch.randn(1, kv_heads, 83, dim, generator=gen)], 2)
    decode_mask = (torch.arange(n + 83) < n)[None, None, None]
    decode = kernels.attention(q[:, :, -1:].contiguous(), cache_k, cache_v, decode_mask, dim**-0.5)
    assert torch.equal(decode[:, 0], prefill[:, -1])
    other = 9  # a 9-token document first, then ours at offset 9 (not a block boundary)
    packed_q = torch.cat([torch.randn(1, heads, other, dim, generator=gen), q], 2)
    packed_k = torch.cat([torch.randn(1, kv_heads, other, dim, generator=gen), k], 2)
    packed_v = torch.cat([torch.randn(1, kv_heads, other, dim, generator=gen), v], 2)
    packed = kernels.attention(packed_q, packed_k, packed_v, _packed([other, n]), dim**-0.5)
    assert torch.equal(packed[:, other:], prefill)


@interpreted
def test_query_tiles_keep_a_tile_inside_one_row_and_one_first_key(kernels):
    # row 0: a packed row of documents of 5 and 4 queries; row 1: 9 queries of one document
    lo = torch.tensor([0, 0, 0, 0, 0, 5, 5, 5, 5, 0, 0, 0, 0, 0, 0, 0, 0, 0], dtype=torch.int32)
    first, count = kernels.query_tiles(lo, 2, 9, 4)
    assert first.tolist() == [0, 4, 5, 9, 13, 17] and count.tolist() == [4, 1, 4, 4, 4, 1]
    decode_first, decode_count = kernels.query_tiles(lo[:3], 3, 1, 4)  # one query per row: a tile each
    assert decode_first.tolist() == [0, 1, 2] and decode_count.tolist() == [1, 1, 1]


@interpreted
def test_attention_refuses_a_mask_with_holes(kernels):
    mask = _causal(5, 5).clone()
    mask[0, 0, 4, 2] = False
    q, k = torch.randn(1, 2, 5, 16), torch.randn(1, 2, 5, 16)
    with pytest.raises(ValueError, match="contiguous range"):
        kernels.attention(q, k, k, mask, 0.25)


@interpreted
def test_key_ranges_are_cached_per_mask_object_and_version(kernels):
    """The trainer's masks per object and version; the engine's inference masks per object."""
    mask = _causal(4, 6).clone()
    lo, hi = kernels.key_ranges(mask, 1, 4, 6, mask.device)
    assert lo.tolist() == [0, 0, 0, 0] and hi.tolist() == [3, 4, 5, 6]
    assert kernels.key_ranges(mask, 1, 4, 6, mask.device)[1] is hi  # the same forward's next layer
    mask[0, 0, 0, 0] = False  # written in place: a new version, computed again
    lo2, _ = kernels.key_ranges(mask, 1, 4, 6, mask.device)
    assert lo2.tolist() == [1, 0, 0, 0]
    with torch.inference_mode():  # the engine's masks: no version counter, cached per object
        engine_mask = _causal(1, 6, batch=3).clone()
        lo3, hi3 = kernels.key_ranges(engine_mask, 3, 1, 6, mask.device)
        assert kernels.key_ranges(engine_mask, 3, 1, 6, mask.device)[1] is hi3
        tiles = kernels.query_tiles(lo3, 3, 1, 21)
        assert kernels.query_tiles(lo3, 3, 1, 21)[0] is tiles[0]  # a decode step's tiles: once per forward
        next_forward = engine_mask.clone()  # a new forward builds a new mask: computed again
        assert kernels.key_ranges(next_forward, 3, 1, 6, mask.device)[1] is not hi3
        assert kernels.key_ranges(next_forward, 3, 1, 6, mask.device)[1].tolist() == [6, 6, 6]


@interpreted
def test_rms_norm_and_log_softmax_match_pytorch_and_reduce_each_row_alone(kernels):
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 576, generator=gen)
    weight = torch.randn(576, generator=gen)
    normed = kernels.rms_norm(x, weight, 1e-5)
    torch.testing.assert_close(normed, kernels.reference_rms_norm(x, weight, 1e-5), rtol=1e-5, atol=1e-5)
    logits = torch.randn(64, 10000, generator=gen) * 4
    logp = kernels.log_softmax(logits)
    torch.testing.assert_close(logp, torch.log_softmax(logits, -1), rtol=1e-5, atol=1e-5)
    for rows in (1, 3):
        assert torch.equal(kernels.rms_norm(x[7 : 7 + rows], weight, 1e-5), normed[7 : 7 + rows])
        assert torch.equal(kernels.log_softmax(logits[7 : 7 + rows]), logp[7 : 7 + rows])


@interpreted
@pytest.mark.parametrize("rows, width", [(5, 32), (70, 576), (33, 100)])
def test_rms_norm_backward_matches_the_reference(kernels, rows, width):
    """The backward kernel (dX per row, dW from partial sums of 32-row blocks; 70 and 33 rows end in
    a partial block) against autograd through transformers' RMSNorm."""
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(rows, width, generator=gen, requires_grad=True)
    weight = torch.randn(width, generator=gen, requires_grad=True)
    grad = torch.randn(rows, width, generator=gen)
    (kernels.rms_norm_op(x, weight, 1e-6) * grad).sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), weight.detach().clone().requires_grad_()
    (kernels.reference_rms_norm(x2, w2, 1e-6) * grad).sum().backward()
    torch.testing.assert_close(x.grad, x2.grad, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(weight.grad, w2.grad, rtol=1e-5, atol=1e-4)


@interpreted
@pytest.mark.parametrize("mask_kind", ["decode", "causal", "padded", "packed"])
def test_attention_backward_matches_sdpa_over_the_same_keys(kernels, mask_kind):
    """dQ, dK, dV of the backward kernels against autograd through SDPA, with grouped heads, key
    blocks of 32 crossed, queries over a longer cache (no mask), left padding, rows without any key
    (their gradient is 0) and packed documents."""
    gen = torch.Generator().manual_seed(5)
    batch, heads, kv_heads, dim, queries, length = 2, 6, 2, 16, 40, 40
    keyless = slice(0, 0)
    if mask_kind == "decode":  # the last 5 queries of 45 positions
        mask, queries, length = None, 5, 45
    elif mask_kind == "causal":
        mask = _causal(length, length, batch)
    elif mask_kind == "padded":  # row 1: 4 left pads that see only themselves; row 0: 3 right pads that see nothing
        mask = _causal(length, length, batch).clone()
        mask[1, 0, :, :4] = False
        mask[1, 0, torch.arange(4), torch.arange(4)] = True
        mask[0, 0, 37:] = False
        keyless = slice(37, None)
    else:
        batch, heads, kv_heads, dim, queries, length = 1, 9, 3, 32, 70, 70
        mask = _packed([33, 37])
    q = torch.randn(batch, heads, queries, dim, generator=gen, requires_grad=True)
    k = torch.randn(batch, kv_heads, length, dim, generator=gen, requires_grad=True)
    v = torch.randn(batch, kv_heads, length, dim, generator=gen, requires_grad=True)
    grad = torch.randn(batch, queries, heads, dim, generator=gen)
    grad[0, keyless] = 0  # what the loss gives a pad
    out = kernels.attention_op(q, k, v, mask, dim**-0.5)
    (out * grad).sum().backward()
    assert (out[0, keyless] == 0).all() and (q.grad[0, :, keyless] == 0).all()
    # SDPA's output for a query without keys is NaN (and so is every gradient it reaches); the
    # reference lets such a query see key 0, which with a zero output gradient adds nothing anywhere
    reference_mask = None if mask is None else mask.clone()
    if reference_mask is not None:
        reference_mask[0, 0, keyless, 0] = True
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    expected = kernels.reference_attention(q2, k2, v2, reference_mask, dim**-0.5)
    (expected * grad).sum().backward()
    expected[0, keyless] = 0
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    for mine, theirs in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=256, rms_norm_eps=1e-5)
    return LlamaForCausalLM(config).eval()


def _kernel_forwards(model, monkeypatch) -> None:
    """The model's attention and RMSNorms through the Triton ops whatever the tensors' device (the
    interpreter runs them on CPU tensors; ``invariant`` dispatches to them only for CUDA tensors)."""
    from miles_engine import invariant, invariant_triton

    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
        return invariant_triton.attention_op(query, key, value, attention_mask, scaling), None

    monkeypatch.setattr(invariant, "attention", attention)
    invariant.register()
    model.set_attn_implementation(invariant.NAME)
    for norm in (m for m in model.modules() if type(m).__name__.endswith("RMSNorm")):
        norm.forward = lambda x, norm=norm: invariant_triton.rms_norm_op(x, norm.weight, norm.variance_epsilon)


@interpreted
def test_a_models_gradients_through_the_kernels_equal_sdpas(monkeypatch):
    """The whole tiny Llama on a packed row of three documents, as the trainer runs it: transformers
    hands attention transposed views (strided query, key, value and output gradient), and every
    parameter's gradient through the kernels equals the one through SDPA (fp32: 1e-4 relative)."""
    import copy

    model = _tiny_llama()
    lengths = [40, 33, 50]
    ids = torch.randint(0, 256, (1, sum(lengths)), generator=torch.Generator().manual_seed(8))
    positions = torch.cat([torch.arange(n) for n in lengths])[None]

    def gradients(m):
        logits = m(input_ids=ids, position_ids=positions, use_cache=False).logits
        torch.log_softmax(logits.float(), -1).gather(-1, ids[..., None]).sum().backward()
        return logits.detach(), {name: p.grad for name, p in m.named_parameters()}

    expected_logits, expected = gradients(copy.deepcopy(model))
    _kernel_forwards(model, monkeypatch)
    logits, mine = gradients(model)
    torch.testing.assert_close(logits, expected_logits, rtol=1e-5, atol=1e-5)
    for name, grad in expected.items():
        assert ((mine[name] - grad).norm() / grad.norm()).item() < 1e-4, name


# ---------------------------------------------------------------- on the GPU, compiled (H200)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_matmul_rows_are_invariant_to_batch_and_position(dtype):
    from miles_engine import invariant_triton

    gen = torch.Generator(device="cuda").manual_seed(5)
    for k, n in ((576, 1536), (1536, 576), (576, 49152)):
        x = torch.randn(300, k, device="cuda", dtype=dtype, generator=gen)
        weight = torch.randn(n, k, device="cuda", dtype=dtype, generator=gen)
        full = invariant_triton.matmul(x, weight)
        for start, rows in ((0, 1), (37, 1), (5, 3), (100, 64), (1, 129)):
            part = invariant_triton.matmul(x[start : start + rows], weight)
            assert torch.equal(part, full[start : start + rows]), (k, n, start, rows)
        torch.testing.assert_close(full.float(), (x.float() @ weight.float().T), rtol=2e-2, atol=2e-1)


@pytest.mark.gpu
def test_gpu_attention_norm_and_log_softmax_are_invariant_in_bf16():
    from miles_engine import invariant_triton

    gen = torch.Generator(device="cuda").manual_seed(6)
    heads, kv_heads, dim, n = 9, 3, 64, 300
    q = torch.randn(1, heads, n, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    k = torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    v = torch.randn(1, kv_heads, n, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    causal = (torch.arange(n, device="cuda")[None, :] <= torch.arange(n, device="cuda")[:, None])[None, None]
    prefill = invariant_triton.attention(q, k, v, causal, dim**-0.5)
    pad = torch.zeros(1, kv_heads, 211, dim, device="cuda", dtype=torch.bfloat16)
    for i in (0, 31, 32, 299):
        mask = (torch.arange(n + 211, device="cuda") <= i)[None, None, None]
        one = invariant_triton.attention(q[:, :, i : i + 1], torch.cat([k, pad], 2), torch.cat([v, pad], 2), mask,
                                         dim**-0.5)
        assert torch.equal(one[:, 0], prefill[:, i]), i
    x = torch.randn(200, 576, device="cuda", dtype=torch.bfloat16, generator=gen)
    weight = torch.randn(576, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(200, 49152, device="cuda", generator=gen) * 3
    normed, logp = invariant_triton.rms_norm(x, weight, 1e-5), invariant_triton.log_softmax(logits)
    for start, rows in ((0, 1), (7, 3), (64, 64)):
        assert torch.equal(invariant_triton.rms_norm(x[start : start + rows], weight, 1e-5), normed[start : start + rows])
        assert torch.equal(invariant_triton.log_softmax(logits[start : start + rows]), logp[start : start + rows])


@pytest.mark.gpu
def test_gpu_backward_kernels_match_the_fp32_reference_in_bf16():
    """The backward kernels compiled (bf16 tensor cores) against autograd through the references in
    fp32, on SmolLM2's head layout (9 heads, 3 KV heads, head_dim 64) and two packed documents."""
    from miles_engine import invariant_triton

    gen = torch.Generator(device="cuda").manual_seed(7)
    lengths = [130, 170]
    n = sum(lengths)
    mask = _packed(lengths).cuda()
    q, k, v = (torch.randn(1, h, n, 64, device="cuda", generator=gen).bfloat16().requires_grad_() for h in (9, 3, 3))
    grad = torch.randn(1, n, 9, 64, device="cuda", generator=gen).bfloat16()
    (invariant_triton.attention_op(q, k, v, mask, 0.125) * grad).float().sum().backward()
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    (invariant_triton.reference_attention(q2, k2, v2, mask, 0.125) * grad.float()).sum().backward()
    for mine, theirs in ((q.grad, q2.grad), (k.grad, k2.grad), (v.grad, v2.grad)):
        torch.testing.assert_close(mine.float(), theirs, rtol=5e-2, atol=5e-2)
    x = torch.randn(300, 576, device="cuda", generator=gen).bfloat16().requires_grad_()
    weight = torch.randn(576, device="cuda", generator=gen).bfloat16().requires_grad_()
    dy = torch.randn(300, 576, device="cuda", generator=gen).bfloat16()
    (invariant_triton.rms_norm_op(x, weight, 1e-5) * dy).float().sum().backward()
    x2, w2 = x.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    (invariant_triton.reference_rms_norm(x2, w2, 1e-5) * dy.float()).sum().backward()
    torch.testing.assert_close(x.grad.float(), x2.grad, rtol=5e-2, atol=5e-2)
    torch.testing.assert_close(weight.grad.float(), w2.grad, rtol=5e-2, atol=5e-1)
