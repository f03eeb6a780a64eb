"""The reference backend against the naive float64 attention: forward, backward, masks, GQA, varlen."""

from __future__ import annotations

import math

import pytest
import torch

import volta_train
from volta_train import reference
from oracles import FLOAT64_ATOL, FLOAT64_RTOL, naive_attention

SHAPES = [
    # batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim
    (2, 37, 37, 4, 4, 32),
    (1, 1, 1, 2, 2, 64),
    (3, 1, 300, 4, 1, 40),  # MQA, decode-like
    (2, 300, 17, 6, 2, 96),  # seqlen_q > seqlen_k: fully masked rows under causal
    (1, 513, 700, 2, 2, 128),  # crosses key blocks, odd lengths
    (2, 65, 129, 8, 2, 256),
    (1, 130, 131, 3, 3, 8),
]


def _inputs(shape, dtype, rng, requires_grad=False):
    batch, sq, sk, h, hk, d = shape
    q = torch.randn(batch, sq, h, d, generator=rng, dtype=dtype)
    k = torch.randn(batch, sk, hk, d, generator=rng, dtype=dtype)
    v = torch.randn(batch, sk, hk, d, generator=rng, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def _rel(a, b, floor=1e-8):
    """Relative error ||a - b|| / max(||b||, floor). A gradient that is zero in exact arithmetic (dQ and dK with a
    single key) comes out as float64 roundoff, so gradient checks pass a floor taken from dV's norm instead."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(floor)).item()


def _grad_floor(dv_ref):
    """A thousandth of the reference dV's norm: far above float64 roundoff (~1e-15 of it), far below any real error."""
    return 1e-3 * dv_ref.double().norm().item()


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_matches_float64(shape, causal, rng):
    q, k, v = _inputs(shape, torch.float64, rng)
    scale = 0.3 + torch.rand((), generator=rng).item()
    out, lse, _ = volta_train.flash_attn_func(q, k, v, softmax_scale=scale, causal=causal, return_attn_probs=True)
    ref, ref_lse = naive_attention(q, k, v, causal=causal, softmax_scale=scale)
    assert out.dtype == torch.float64 and lse.dtype == torch.float64  # fp64 inputs keep an fp64 log-sum-exp
    assert torch.allclose(out, ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL), rng.initial_seed()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~finite)
    assert torch.allclose(lse[finite].double(), ref_lse[finite], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("shape", SHAPES[:5])
@pytest.mark.parametrize("causal", [False, True])
def test_backward_matches_float64_autograd(shape, causal, rng):
    q, k, v = _inputs(shape, torch.float64, rng, requires_grad=True)
    out = volta_train.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, _ = naive_attention(q, k, v, causal=causal)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    floor = _grad_floor(ref_grads[2])
    for name, g, r in zip("qkv", grads, ref_grads):
        # fp64 inputs keep an fp64 log-sum-exp: only libm's exp limits (FLOAT64_RTOL)
        assert _rel(g, r, floor) < 1e-6, (name, _rel(g, r, floor), rng.initial_seed())
        assert torch.isfinite(g).all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_inputs_follow_float64(dtype, rng):
    q, k, v = _inputs((2, 77, 91, 4, 2, 64), dtype, rng)
    out = volta_train.flash_attn_func(q, k, v, causal=True)
    ref, _ = naive_attention(q, k, v, causal=True)
    assert out.dtype == dtype
    tolerance = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-6}[dtype]
    assert _rel(out, ref) < tolerance


def test_rows_without_visible_keys_are_zero_with_zero_gradient(rng):
    q, k, v = _inputs((2, 50, 20, 2, 2, 32), torch.float32, rng, requires_grad=True)
    out, lse, _ = volta_train.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    empty = 50 - 20  # bottom-right alignment: the first 30 rows see no key
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isposinf(lse[:, :, :empty]).all() and torch.isfinite(lse[:, :, empty:]).all()
    out.backward(torch.randn_like(out))
    assert torch.equal(q.grad[:, :empty], torch.zeros_like(q.grad[:, :empty]))
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


def test_large_scores_do_not_overflow(rng):
    q, k, v = _inputs((1, 64, 64, 2, 2, 64), torch.float16, rng)
    out = volta_train.flash_attn_func(q * 30, k * 30, v, softmax_scale=1.0)  # |scores| up to ~1e4
    ref, _ = naive_attention(q * 30, k * 30, v, softmax_scale=1.0)
    assert torch.isfinite(out).all()
    assert _rel(out, ref) < 5e-3


@pytest.mark.parametrize("window", [(16, 0), (5, 9), (-1, 3), (0, 0)])
def test_window_and_alibi_match_float64(window, rng):
    q, k, v = _inputs((2, 45, 61, 4, 2, 32), torch.float64, rng, requires_grad=True)
    slopes = torch.rand(2, 4, generator=rng, dtype=torch.float32)
    out = volta_train.flash_attn_func(q, k, v, window_size=window, alibi_slopes=slopes)
    ref, _ = naive_attention(q, k, v, window_size=window, alibi_slopes=slopes)
    assert torch.allclose(out, ref, atol=1e-6)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-6, atol=1e-7)  # fp64 lse; window (0, 0): dq is exactly 0


def test_score_blocks_never_exceed_block_k(monkeypatch, rng):
    """The reference must stay O(seqlen x block): no score tile wider than BLOCK_K columns."""
    seen = []
    original = reference.scores

    def spy(q, k_blk, *args):
        s, cap_slope = original(q, k_blk, *args)
        seen.append(s.shape[-1])
        return s, cap_slope

    monkeypatch.setattr(reference, "scores", spy)
    q, k, v = _inputs((1, 40, 3 * reference.BLOCK_K + 5, 2, 2, 16), torch.float32, rng, requires_grad=True)
    volta_train.flash_attn_func(q, k, v).sum().backward()
    assert seen and max(seen) <= reference.BLOCK_K
    assert len(seen) == 2 * 4  # four key blocks, forward and backward


def test_causal_skips_fully_masked_key_blocks(monkeypatch, rng):
    calls = []
    original = reference.scores
    monkeypatch.setattr(reference, "scores", lambda *a: calls.append(1) or original(*a))
    n = 2 * reference.BLOCK_K
    q, k, v = _inputs((1, 10, n, 1, 1, 16), torch.float32, rng)
    # seqlen_q=10 rows sit at the bottom-right: only the last key block is visible
    volta_train.flash_attn_func(q, k, v, causal=True, window_size=(5, -1))
    assert len(calls) == 1


def test_varlen_equals_per_sequence_dense(rng):
    lengths_q = [0, 1, 17, 64, 5, 33]
    lengths_k = [3, 1, 17, 80, 0, 40]
    h, hk, d = 4, 2, 32
    q = torch.randn(sum(lengths_q), h, d, generator=rng, dtype=torch.float64, requires_grad=True)
    k = torch.randn(sum(lengths_k), hk, d, generator=rng, dtype=torch.float64, requires_grad=True)
    v = torch.randn(sum(lengths_k), hk, d, generator=rng, dtype=torch.float64, requires_grad=True)
    cu_q = torch.tensor([0] + lengths_q, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    cu_k = torch.tensor([0] + lengths_k, dtype=torch.int32).cumsum(0, dtype=torch.int32)
    out, lse, _ = volta_train.flash_attn_varlen_func(
        q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), causal=True, return_attn_probs=True
    )
    assert lse.shape == (h, sum(lengths_q))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b in range(len(lengths_q)):
        q0, q1, k0, k1 = cu_q[b].item(), cu_q[b + 1].item(), cu_k[b].item(), cu_k[b + 1].item()
        if q1 == q0:
            continue
        if k1 == k0:  # no keys at all: zeros
            assert torch.equal(out[q0:q1], torch.zeros_like(out[q0:q1]))
            continue
        ref, _ = naive_attention(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal=True)
        assert torch.allclose(out[q0:q1], ref[0], rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
        ref_grads = torch.autograd.grad(ref[0], (q, k, v), dout[q0:q1])
        floor = _grad_floor(ref_grads[2][k0:k1])
        assert _rel(grads[0][q0:q1], ref_grads[0][q0:q1], floor) < 1e-6
        assert _rel(grads[1][k0:k1], ref_grads[1][k0:k1], floor) < 1e-6
        assert _rel(grads[2][k0:k1], ref_grads[2][k0:k1], floor) < 1e-6


def test_packed_wrappers_equal_unpacked(rng):
    qkv = torch.randn(2, 33, 3, 4, 16, generator=rng)
    out = volta_train.flash_attn_qkvpacked_func(qkv, causal=True)
    assert torch.equal(out, volta_train.flash_attn_func(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True))
    q = torch.randn(2, 20, 4, 16, generator=rng)
    kv = torch.randn(2, 33, 2, 2, 16, generator=rng)
    out = volta_train.flash_attn_kvpacked_func(q, kv, causal=True)
    assert torch.equal(out, volta_train.flash_attn_func(q, kv[:, :, 0], kv[:, :, 1], causal=True))


def test_non_contiguous_strides(rng):
    base = torch.randn(2, 4, 50, 3, 32, generator=rng, dtype=torch.float64)  # heads and seqlen swapped in memory
    q = base[:, :, :, 0].transpose(1, 2)
    k = base[:, :, :, 1].transpose(1, 2)
    v = base[:, :, :, 2].transpose(1, 2)
    assert not q.is_contiguous()
    out = volta_train.flash_attn_func(q, k, v, causal=True)
    ref, _ = naive_attention(q, k, v, causal=True)
    assert torch.allclose(out, ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)


def test_default_scale_is_inverse_sqrt_head_dim(rng):
    q, k, v = _inputs((1, 9, 9, 2, 2, 24), torch.float64, rng)
    a = volta_train.flash_attn_func(q, k, v)
    b = volta_train.flash_attn_func(q, k, v, softmax_scale=1 / math.sqrt(24))
    assert torch.equal(a, b)


def test_torch_compile_through_the_custom_op(rng):
    q, k, v = _inputs((1, 33, 33, 2, 2, 16), torch.float32, rng, requires_grad=True)

    def f(q, k, v):
        return volta_train.flash_attn_func(q, k, v, causal=True).square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, v)
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_grads = torch.autograd.grad(f(q, k, v), (q, k, v))
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=1e-6)


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
def test_torch_compile_with_views_after_the_op_and_permuted_inputs(backend, rng):
    """Ops traced after the attention address its outputs with the strides the fake promised."""
    base = torch.randn(2, 3, 29, 24, generator=rng, dtype=torch.float32)  # [b, h, n, d] as HF holds q/k/v
    q, k, v = [(base * (i + 1)).requires_grad_(True) for i in range(3)]

    def f(q, k, v):
        out = volta_train.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), causal=True)
        return out.view(2, 29, 3 * 24)  # needs the contiguous output the fake promises

    compiled = torch.compile(f, backend=backend, fullgraph=True)
    weight = torch.randn(2, 29, 72, generator=rng)
    out = compiled(q, k, v)
    grads = torch.autograd.grad((out * weight).sum(), (q, k, v))
    ref = f(q, k, v)
    ref_grads = torch.autograd.grad((ref * weight).sum(), (q, k, v))
    assert out.is_contiguous()
    assert torch.allclose(out, ref, atol=1e-6)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=1e-5)


def test_varlen_under_torch_compile_checks_cu_seqlens_on_the_device(rng):
    lengths = [5, 17, 1]
    cu = torch.tensor([0, 5, 22, 23], dtype=torch.int32)
    q, k, v = (torch.randn(23, 2, 16, generator=rng) for _ in range(3))

    def f(q, k, v, cu):
        return volta_train.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)  # fullgraph: no host read of cu
    assert torch.allclose(compiled(q, k, v, cu), f(q, k, v, cu), atol=1e-6)
    other = torch.tensor([0, 5, 20, 23], dtype=torch.int32)  # other valid lengths: 5, 15, 3
    too_long = torch.tensor([0, 1, 22, 23], dtype=torch.int32)  # 21 tokens > max_seqlen 17
    assert torch.allclose(compiled(q, k, v, other), f(q, k, v, other), atol=1e-6)
    with pytest.raises(RuntimeError, match="max_seqlen_q"):
        compiled(q, k, v, too_long)
    with pytest.raises(RuntimeError, match="non-decreasing"):
        compiled(q, k, v, torch.tensor([0, 9, 5, 23], dtype=torch.int32))


def test_autocast_casts_mixed_inputs_and_returns_gradients_in_their_dtypes(rng):
    q, k, v = _inputs((2, 21, 21, 4, 2, 32), torch.float32, rng, requires_grad=True)
    v16 = v.detach().to(torch.bfloat16).requires_grad_(True)  # like Llama: fp32 q/k from RoPE, low-precision v
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = volta_train.flash_attn_func(q, k, v16, causal=True)
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert q.grad.dtype == torch.float32 and k.grad.dtype == torch.float32 and v16.grad.dtype == torch.bfloat16
    ref, _ = naive_attention(q.detach().bfloat16(), k.detach().bfloat16(), v16.detach(), causal=True)
    assert _rel(out, ref) < 1e-2
    plain = volta_train.flash_attn_func(q.detach(), k.detach(), v.detach(), causal=True)
    assert plain.dtype == torch.float32  # outside autocast nothing is cast
