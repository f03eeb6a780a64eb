"""flash-attn 2.8's API on volta_train: positional order, softcap, any head_dim, packed varlen, KV cache,
bert_padding helpers and the API edge cases of issue 14. CPU tests against float64 oracles; the gpu-marked
tests at the end check the dispatcher's head_dim padding on the kernel."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import math
from unittest import mock

import numpy as np
import pytest
import torch

import volta_train
from volta_train import dispatch, philox, validation, kernels
from volta_train.kernels import head_dim as head_dims
from volta_train.options import AttentionOptions
from volta_train.kernels import tiles
from oracles import FLOAT64_ATOL, FLOAT64_RTOL, naive_attention


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-8)).item()


def _randn(*shape, rng, dtype=torch.float64, scale=1.0, requires_grad=False):
    return (torch.randn(*shape, generator=rng, dtype=dtype) * scale).requires_grad_(requires_grad)


def _qkv(rng, b, sq, sk, h, hk, d, dtype=torch.float64, requires_grad=True, scale=1.0):
    return (
        _randn(b, sq, h, d, rng=rng, dtype=dtype, scale=scale, requires_grad=requires_grad),
        _randn(b, sk, hk, d, rng=rng, dtype=dtype, scale=scale, requires_grad=requires_grad),
        _randn(b, sk, hk, d, rng=rng, dtype=dtype, requires_grad=requires_grad),
    )


def _check_grads(out, ref, inputs, rng, bound=1e-6):
    dout = torch.randn(out.shape, generator=rng, dtype=out.dtype)
    grads = torch.autograd.grad(out, inputs, dout)
    ref_grads = torch.autograd.grad(ref, inputs, dout)
    for name, g, r in zip("qkv", grads, ref_grads):
        assert torch.isfinite(g).all()
        assert _rel(g, r) < bound, (name, _rel(g, r), rng.initial_seed())


# ---------------------------------------------------------------------------------------------------------------
# positional order: flash-attn >= 2.6 (softcap before alibi_slopes), as in flash-attn 2.8.3's flash_attn_interface
# ---------------------------------------------------------------------------------------------------------------

_COMMON_TAIL = ["dropout_p", "softmax_scale", "causal", "window_size", "softcap", "alibi_slopes", "deterministic",
                "return_attn_probs"]
FLASH_ATTN_2_8_ORDER = {
    "flash_attn_func": ["q", "k", "v"] + _COMMON_TAIL,
    "flash_attn_qkvpacked_func": ["qkv"] + _COMMON_TAIL,
    "flash_attn_kvpacked_func": ["q", "kv"] + _COMMON_TAIL,
    "flash_attn_varlen_func": ["q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    + _COMMON_TAIL + ["block_table"],
    "flash_attn_varlen_qkvpacked_func": ["qkv", "cu_seqlens", "max_seqlen"] + _COMMON_TAIL,
    "flash_attn_varlen_kvpacked_func": ["q", "kv", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k"]
    + _COMMON_TAIL,
    "flash_attn_with_kvcache": ["q", "k_cache", "v_cache", "k", "v", "rotary_cos", "rotary_sin", "cache_seqlens",
                                "cache_batch_idx", "cache_leftpad", "block_table", "softmax_scale", "causal",
                                "window_size", "softcap", "rotary_interleaved", "alibi_slopes", "num_splits",
                                "return_softmax_lse"],
}


@pytest.mark.parametrize("name", sorted(FLASH_ATTN_2_8_ORDER))
def test_positional_parameters_in_flash_attn_2_8_order(name):
    params = inspect.signature(getattr(volta_train, name)).parameters.values()
    positional = [p.name for p in params if p.kind == p.POSITIONAL_OR_KEYWORD]
    keyword_only = [p.name for p in params if p.kind == p.KEYWORD_ONLY]
    assert positional == FLASH_ATTN_2_8_ORDER[name]
    assert set(keyword_only) <= {"accum", "bwd_accum", "sinks"}


def test_eleven_positional_arguments_mean_what_flash_attn_2_8_means(rng):
    q, k, v = _qkv(rng, 2, 13, 17, 4, 2, 16)
    slopes = torch.rand(4, generator=rng)
    out, lse, probs = volta_train.flash_attn_func(q, k, v, 0.0, 0.4, True, (5, -1), 2.5, slopes, False, True)
    ref, ref_lse = naive_attention(q, k, v, causal=True, softmax_scale=0.4, window_size=(5, -1), alibi_slopes=slopes,
                                   softcap=2.5)
    assert probs.shape == (0,)  # S_dmask without dropout: empty, as flash-attn returns it
    assert torch.allclose(out, ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    assert torch.allclose(lse, ref_lse, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    # the varlen form with all 16 positional arguments, block_table=None included
    cu = torch.tensor([0, 13, 26], dtype=torch.int32)
    cu_k = torch.tensor([0, 17, 34], dtype=torch.int32)
    out_v = volta_train.flash_attn_varlen_func(
        q.reshape(26, 4, 16), k.reshape(34, 2, 16), v.reshape(34, 2, 16), cu, cu_k, 13, 17, 0.0, 0.4, True, (5, -1),
        2.5, slopes, False, False, None,
    )
    assert torch.allclose(out_v.view_as(out), ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)


# ---------------------------------------------------------------------------------------------------------------
# softcap on the reference backend
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("causal, window, alibi", [(False, (-1, -1), False), (True, (-1, -1), True),
                                                   (False, (7, 3), True), (True, (4, 0), False)])
@pytest.mark.parametrize("softcap", [0.7, 5.0, 50.0])
def test_softcap_forward_and_backward_match_float64(softcap, causal, window, alibi, rng):
    q, k, v = _qkv(rng, 2, 37, 300, 6, 2, 24, scale=2.0)  # 300 keys: two key blocks; |scores| up to ~20
    slopes = torch.rand(2, 6, generator=rng) if alibi else None
    out, lse, _ = volta_train.flash_attn_func(q, k, v, causal=causal, window_size=window, softcap=softcap,
                                              alibi_slopes=slopes, return_attn_probs=True)
    ref, ref_lse = naive_attention(q, k, v, causal=causal, window_size=window, alibi_slopes=slopes, softcap=softcap)
    assert torch.allclose(out, ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL), rng.initial_seed()
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isinf(lse), ~finite)
    assert torch.allclose(lse[finite], ref_lse[finite], rtol=FLOAT64_RTOL)
    _check_grads(out, ref, (q, k, v), rng)


def test_softcap_changes_the_result_and_large_softcap_tends_to_none(rng):
    q, k, v = _qkv(rng, 1, 20, 20, 2, 2, 32, requires_grad=False, scale=3.0)
    plain = volta_train.flash_attn_func(q, k, v)
    capped = volta_train.flash_attn_func(q, k, v, softcap=1.0)
    assert _rel(capped, plain) > 1e-2  # the test can fail if softcap were ignored
    assert _rel(volta_train.flash_attn_func(q, k, v, softcap=1e6), plain) < 1e-6


def test_softcap_with_dropout_matches_float64_with_the_same_mask(rng):
    q, k, v = _qkv(rng, 2, 19, 45, 3, 3, 16, scale=2.0)
    torch.manual_seed(1234)
    out = volta_train.flash_attn_func(q, k, v, dropout_p=0.25, causal=True, softcap=3.0)
    torch.manual_seed(1234)
    seed, offset = philox.draw_seed_offset(q.device)
    keep = philox.dropout_keep_mask(seed, offset, 0.25, torch.arange(2 * 3), torch.arange(19), torch.arange(45))
    ref, _ = naive_attention(q, k, v, causal=True, keep_mask=keep.view(2, 3, 19, 45), dropout_p=0.25, softcap=3.0)
    assert torch.allclose(out, ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    _check_grads(out, ref, (q, k, v), rng)


def test_softcap_varlen_matches_dense(rng):
    lengths = [5, 31, 1]
    q = _randn(sum(lengths), 4, 16, rng=rng, requires_grad=True)
    k = _randn(sum(lengths), 4, 16, rng=rng, requires_grad=True)
    v = _randn(sum(lengths), 4, 16, rng=rng, requires_grad=True)
    cu = torch.tensor([0, 5, 36, 37], dtype=torch.int32)
    out = volta_train.flash_attn_varlen_func(q, k, v, cu, cu, 31, 31, causal=True, softcap=2.0)
    for b in range(3):
        s = slice(cu[b].item(), cu[b + 1].item())
        ref, _ = naive_attention(q[None, s], k[None, s], v[None, s], causal=True, softcap=2.0)
        assert torch.allclose(out[s], ref[0], rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)


@pytest.mark.parametrize("bad, error", [(-1.0, ValueError), (float("inf"), ValueError), (float("nan"), ValueError),
                                        ("30", TypeError)])
def test_softcap_refuses_negative_and_non_finite(bad, error):
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(error, match="softcap"):
        volta_train.flash_attn_func(q, q, q, softcap=bad)


# ---------------------------------------------------------------------------------------------------------------
# any head_dim from 1 to 256
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("head_dim", [1, 7, 59, 111, 200, 256])
def test_odd_head_dims_match_float64(head_dim, rng):
    q, k, v = _qkv(rng, 2, 21, 34, 4, 2, head_dim)
    out = volta_train.flash_attn_func(q, k, v, causal=True)
    ref, _ = naive_attention(q, k, v, causal=True)  # default scale 1/sqrt(head_dim)
    assert out.shape == q.shape
    assert torch.allclose(out, ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL), rng.initial_seed()
    _check_grads(out, ref, (q, k, v), rng)


def test_kernel_head_dim_is_the_next_one_built():
    built = tiles.SUPPORTED_HEAD_DIMS
    for d in range(1, 257):
        padded = head_dims.forward_head_dim(d)
        if d <= max(built):
            assert padded in built and padded >= d and all(not d <= b < padded for b in built)
        else:
            assert padded is None
    t = torch.randn(2, 3, 4, 64)
    assert head_dims.pad(t, 64) is t  # aligned: no copy
    padded = head_dims.pad(t[..., :59], 64)
    assert padded.shape[-1] == 64 and torch.equal(padded[..., :59], t[..., :59])
    assert torch.equal(padded[..., 59:], torch.zeros(2, 3, 4, 5))


@pytest.fixture
def fake_kernel(monkeypatch):
    """The dispatcher believes a kernel is present; the kernels' launches run the reference backend but assert they
    only see head_dims the kernels are built for. Records the calls."""
    from volta_train import reference
    from volta_train.kernels import launch

    calls = []
    monkeypatch.setattr(dispatch, "_logged_reasons", set())
    monkeypatch.setattr(kernels.support.CallDescription, "arch", property(lambda self: 70))
    monkeypatch.setattr(kernels.support.CallDescription, "device_name", property(lambda self: "FakeV100"))
    monkeypatch.setattr(launch, "_arch", lambda device: 70)
    # the fake V100 would send head_dim 256 backwards to PyTorch's kernel (tests/kernels/test_cutlass_backward.py)
    monkeypatch.setenv("VOLTA_TRAIN_CUTLASS_BACKWARD", "never")
    monkeypatch.setattr(kernels, "unsupported_reason",
                        lambda call: None if call.kernel_head_dim is not None else "head_dim")

    def run_forward(q, k, v, cu_q, cu_k, max_q, max_k, options, alibi, tile, out, lse):
        assert q.shape[-1] in tiles.SUPPORTED_HEAD_DIMS and k.shape[-1] == v.shape[-1] == q.shape[-1]
        calls.append(("forward", q.shape[-1], options))
        return reference.reference_forward(q, k, v, options, alibi)

    def run_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, options, alibi, tile, dq_tile, arch):
        assert all(t.shape[-1] in tiles.SUPPORTED_HEAD_DIMS for t in (dout, q, k, v, out))
        padded_columns = (v == 0).flatten(0, -2).all(0)  # zero-padded features: out and dout must be 0 there
        assert not out[..., padded_columns].any() and not dout[..., padded_columns].any()
        calls.append(("backward", q.shape[-1], options))
        return reference.reference_backward(dout, q, k, v, out, lse, options, alibi)

    def forward_with_kvcache(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens, cache_batch_idx,
                             cache_leftpad, options, alibi, rotary_interleaved, *, key_end=-1,
                             longest=-1, block_table=None):  # kernels.decode's signature
        calls.append(("forward_with_kvcache", q.shape[-1], options, key_end, longest))
        return reference.reference_kvcache_forward(q, k_cache, v_cache, k, v, rotary_cos, rotary_sin, cache_seqlens,
                                                    cache_batch_idx, cache_leftpad, options, alibi, rotary_interleaved,
                                                    block_table)

    monkeypatch.setattr(launch, "_run_forward", run_forward)
    monkeypatch.setattr(launch, "_run_backward", run_backward)
    monkeypatch.setattr(kernels, "forward_with_kvcache", forward_with_kvcache)
    return calls


@pytest.mark.parametrize("head_dim, padded, padded_bwd", [(59, 64, 64), (7, 16, 16), (111, 112, 128), (64, 64, 64),
                                                         (200, 256, 256), (129, 256, 256)])
def test_kernel_path_pads_head_dim_and_slices_back(fake_kernel, head_dim, padded, padded_bwd, rng, caplog):
    """On the (fake) V100 the d112 backward runs the d128 kernels (tiles.BWD_KERNEL_HEAD_DIMS_SM70): one padding."""
    q, k, v = _qkv(rng, 2, 19, 23, 4, 2, head_dim)
    with caplog.at_level(logging.INFO, logger="volta_train"):
        out = volta_train.flash_attn_func(q, k, v, causal=True)
    ref, _ = naive_attention(q, k, v, causal=True)
    assert out.shape == q.shape
    assert torch.allclose(out, ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)  # scale from the original head_dim
    _check_grads(out, ref, (q, k, v), rng)
    assert [c[:2] for c in fake_kernel] == [("forward", padded), ("backward", padded_bwd)]
    if head_dim != padded:
        assert any(f"head_dim {head_dim} zero-padded to {padded}" in r.getMessage() for r in caplog.records)


def test_options_reach_the_kernel_as_one_value(fake_kernel, rng):
    q, k, v = _qkv(rng, 1, 9, 9, 2, 2, 16)
    out = volta_train.flash_attn_func(q, k, v, softcap=4.0, causal=True, window_size=(3, -1), deterministic=True,
                                      accum="fp16", bwd_accum="fp32")
    out.sum().backward()
    options = fake_kernel[0][2]
    assert (options.softcap, options.causal, options.window, options.deterministic) == (4.0, True, (3, -1), True)
    assert (options.accum, options.bwd_accum) == ("fp16", "fp32") and fake_kernel[1][2] == options
    ref, _ = naive_attention(q, k, v, causal=True, window_size=(3, -1), softcap=4.0)
    assert torch.allclose(out, ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)


def test_options_pack_and_unpack_every_field():
    options = AttentionOptions(softmax_scale=0.3, causal=True, window_left=5, window_right=0, dropout_p=0.2,
                               seed=2**64 - 3, offset=2**63, softcap=2.5, accum="fp16", bwd_accum="fp32",
                               deterministic=True)
    floats, ints = options.pack()
    assert all(-(2**63) <= i < 2**63 for i in ints)  # what a custom op's int[] carries
    assert AttentionOptions.unpack(floats, ints) == options


def test_head_dim_above_the_kernel_goes_to_the_reference(fake_kernel, monkeypatch, rng, caplog):
    """A head_dim above every kernel head_dim (here: a kernel package built up to 128) runs on the reference."""
    monkeypatch.setattr(tiles, "SUPPORTED_HEAD_DIMS", tuple(d for d in tiles.SUPPORTED_HEAD_DIMS if d <= 128))
    q, k, v = _qkv(rng, 1, 5, 5, 2, 2, 200, requires_grad=False)
    with caplog.at_level(logging.INFO, logger="volta_train"):
        volta_train.flash_attn_func(q, k, v)
    assert fake_kernel == []
    assert any("reference backend (head_dim" in r.getMessage() for r in caplog.records)


# ---------------------------------------------------------------------------------------------------------------
# packed varlen functions
# ---------------------------------------------------------------------------------------------------------------

def _cu(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32)


def test_varlen_packed_functions_equal_unpacked(rng):
    lengths_q, lengths_k = [4, 0, 19, 7], [9, 3, 19, 1]
    cu_q, cu_k = _cu(lengths_q), _cu(lengths_k)
    slopes = torch.rand(4, 4, generator=rng)
    options = dict(causal=True, window_size=(6, 2), softcap=3.0, alibi_slopes=slopes)

    qkv = _randn(sum(lengths_q), 3, 4, 24, rng=rng, requires_grad=True)
    out = volta_train.flash_attn_varlen_qkvpacked_func(qkv, cu_q, max(lengths_q), **options)
    q, k, v = (qkv.detach()[:, i].clone().requires_grad_() for i in range(3))
    ref = volta_train.flash_attn_varlen_func(q, k, v, cu_q, cu_q, max(lengths_q), max(lengths_q), **options)
    assert torch.equal(out, ref)
    dout = torch.randn(out.shape, generator=rng, dtype=out.dtype)
    (dqkv,) = torch.autograd.grad(out, qkv, dout)
    assert torch.equal(dqkv, torch.stack(torch.autograd.grad(ref, (q, k, v), dout), dim=1))

    q = _randn(sum(lengths_q), 4, 24, rng=rng, requires_grad=True)
    kv = _randn(sum(lengths_k), 2, 2, 24, rng=rng, requires_grad=True)
    out = volta_train.flash_attn_varlen_kvpacked_func(q, kv, cu_q, cu_k, max(lengths_q), max(lengths_k), **options)
    k, v = (kv.detach()[:, i].clone().requires_grad_() for i in range(2))
    ref = volta_train.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max(lengths_q), max(lengths_k), **options)
    assert torch.equal(out, ref)
    dq, dkv = torch.autograd.grad(out, (q, kv), dout)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref, (q, k, v), dout)
    assert torch.equal(dq, ref_dq) and torch.equal(dkv, torch.stack((ref_dk, ref_dv), dim=1))


@pytest.mark.parametrize("call, words", [
    (lambda: volta_train.flash_attn_varlen_qkvpacked_func(torch.randn(5, 2, 2, 16), _cu([5]), 5), "qkv must be [total, 3"),
    (lambda: volta_train.flash_attn_varlen_kvpacked_func(torch.randn(5, 2, 16), torch.randn(5, 3, 2, 16), _cu([5]),
                                                         _cu([5]), 5, 5), "kv must be [total_k, 2"),
    (lambda: volta_train.flash_attn_qkvpacked_func([[1.0]]), "qkv must be a torch.Tensor"),
])
def test_packed_shape_errors(call, words):
    with pytest.raises((ValueError, TypeError)) as info:
        call()
    assert words in str(info.value)


# ---------------------------------------------------------------------------------------------------------------
# flash_attn_with_kvcache
# ---------------------------------------------------------------------------------------------------------------

def _rotary_oracle(x, cos, sin, positions, interleaved):
    """Rotation as complex multiplication: pairs (x_a, x_b) -> (x_a + i x_b) * exp(i theta)."""
    half = cos.shape[-1]
    x = x.double()
    xr = x[..., : 2 * half]
    if interleaved:
        z = torch.complex(xr[..., 0::2], xr[..., 1::2])
    else:
        z = torch.complex(xr[..., :half], xr[..., half:])
    theta = torch.atan2(sin.double(), cos.double())[positions].unsqueeze(2)  # [B, N, 1, half]
    z = z * torch.polar(torch.ones_like(theta), theta)
    if interleaved:
        rotated = torch.stack((z.real, z.imag), dim=-1).flatten(-2)
    else:
        rotated = torch.cat((z.real, z.imag), dim=-1)
    return torch.cat((rotated, x[..., 2 * half:]), dim=-1)


def _kvcache_case(rng, seqlen_q, new, rotary_dim, interleaved, causal, window, batch_idx, leftpad, softcap, alibi):
    batch, batch_cache, seqlen_cache, h, hk, d = 3, 5, 40, 4, 2, 32
    q = _randn(batch, seqlen_q, h, d, rng=rng)
    k_cache = _randn(batch_cache, seqlen_cache, hk, d, rng=rng)
    v_cache = _randn(batch_cache, seqlen_cache, hk, d, rng=rng)
    k_new = _randn(batch, new, hk, d, rng=rng) if new else None
    v_new = _randn(batch, new, hk, d, rng=rng) if new else None
    span = max(new, seqlen_q)
    seqlens = torch.randint(0, seqlen_cache - span + 1, (batch,), generator=rng, dtype=torch.int32)
    rows = torch.randperm(batch_cache, generator=rng)[:batch].to(torch.int32) if batch_idx else None
    pads = torch.stack([torch.randint(0, int(n) + 1, (), generator=rng) for n in seqlens]).to(torch.int32) \
        if leftpad else None
    cos = sin = None
    if rotary_dim:
        angle = torch.rand(seqlen_cache, rotary_dim // 2, generator=rng, dtype=torch.float64) * 2 * math.pi
        cos, sin = angle.cos(), angle.sin()
    slopes = torch.rand(batch, h, generator=rng) if alibi else None
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
                cache_seqlens=seqlens, cache_batch_idx=rows, cache_leftpad=pads, causal=causal, window_size=window,
                softcap=softcap, rotary_interleaved=interleaved, alibi_slopes=slopes)


def _kvcache_oracle(case):
    """Appends (rotated) k/v to a copy of the cache and runs naive attention per batch entry."""
    q, k_cache, v_cache = case["q"], case["k_cache"].clone(), case["v_cache"].clone()
    batch, seqlen_q = q.shape[:2]
    seqlens = case["cache_seqlens"].long()
    rows = case["cache_batch_idx"].long() if case["cache_batch_idx"] is not None else torch.arange(batch)
    pads = case["cache_leftpad"].long() if case["cache_leftpad"] is not None else torch.zeros(batch, dtype=torch.long)
    new = 0 if case["k"] is None else case["k"].shape[1]
    cos, sin, interleaved = case["rotary_cos"], case["rotary_sin"], case["rotary_interleaved"]
    local = tuple(case["window_size"]) != (-1, -1)
    outs = []
    for b in range(batch):
        r, n = rows[b].item(), seqlens[b].item()
        if new:
            k_b = case["k"][b : b + 1]
            if cos is not None:
                k_b = _rotary_oracle(k_b, cos, sin, (n + torch.arange(new)).view(1, -1), interleaved)
            k_cache[r, n : n + new] = k_b[0]
            v_cache[r, n : n + new] = case["v"][b]
        q_b = q[b : b + 1]
        if cos is not None:
            offsets = torch.arange(seqlen_q) if (case["causal"] or local) else torch.zeros(seqlen_q, dtype=torch.long)
            q_b = _rotary_oracle(q_b, cos, sin, (n + offsets).view(1, -1), interleaved)
        keys = slice(pads[b].item(), n + new)
        slopes = case["alibi_slopes"][b] if case["alibi_slopes"] is not None else None
        out, _ = naive_attention(q_b, k_cache[r : r + 1, keys], v_cache[r : r + 1, keys], causal=case["causal"],
                                 window_size=case["window_size"], alibi_slopes=slopes, softcap=case["softcap"])
        outs.append(out[0])
    return torch.stack(outs), k_cache, v_cache


@pytest.mark.parametrize("seqlen_q", [1, 2, 5, 16])
@pytest.mark.parametrize(
    "new, rotary_dim, interleaved, causal, window, batch_idx, leftpad, softcap, alibi",
    [
        (1, 0, True, True, (-1, -1), False, False, 0.0, False),
        (3, 16, True, True, (-1, -1), True, False, 0.0, False),
        (16, 32, False, True, (6, 0), True, True, 0.0, True),
        (2, 8, False, False, (-1, -1), False, True, 5.0, False),  # non-causal: q rotated at cache_seqlens only
        (0, 0, True, False, (3, 2), True, False, 2.0, True),  # no new keys: attention over the cache only
        (5, 16, True, False, (-1, -1), True, True, 0.0, True),
    ],
)
def test_kvcache_matches_naive_attention_over_the_appended_cache(
    seqlen_q, new, rotary_dim, interleaved, causal, window, batch_idx, leftpad, softcap, alibi, rng
):
    case = _kvcache_case(rng, seqlen_q, new, rotary_dim, interleaved, causal, window, batch_idx, leftpad, softcap,
                         alibi)
    ref, ref_k_cache, ref_v_cache = _kvcache_oracle(case)
    k_cache_ptr = case["k_cache"].data_ptr()
    out, lse = volta_train.flash_attn_with_kvcache(**case, return_softmax_lse=True)
    assert case["k_cache"].data_ptr() == k_cache_ptr  # appended in place
    assert torch.allclose(case["k_cache"], ref_k_cache, rtol=1e-12, atol=1e-12), rng.initial_seed()
    assert torch.equal(case["v_cache"], ref_v_cache)  # v is never rotated: untouched rows and values bit-equal
    assert out.shape == case["q"].shape and lse.shape == (3, 4, seqlen_q) and lse.dtype == torch.float64
    assert torch.allclose(out, ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL), rng.initial_seed()


def _paginate(cache, page_size, spare_pages, rng):
    """A contiguous cache [B, L, Hk, D] (L a multiple of page_size) as a shuffled page pool [B * L / page_size +
    spare_pages, page_size, Hk, D] and its block table: logical page i of entry b is pool page table[b, i]; the spare
    pages (never referenced) hold garbage."""
    batch, length = cache.shape[:2]
    pages = length // page_size
    perm = torch.randperm(batch * pages + spare_pages, generator=rng)[: batch * pages]
    pool = torch.randn((batch * pages + spare_pages, page_size) + tuple(cache.shape[2:]), generator=rng,
                       dtype=cache.dtype) * 1e3
    table = perm.view(batch, pages).to(torch.int32)
    for b in range(batch):
        for i in range(pages):
            pool[table[b, i]] = cache[b, i * page_size : (i + 1) * page_size]
    return pool, table


def _unpaginate(pool, table):
    """The logical contiguous cache [B, pages * page_size, Hk, D] of a page pool (a plain gather, for the checks)."""
    return pool[table.long()].flatten(1, 2)


@pytest.mark.parametrize("page_size, pages_per_seq, spare", [(32, 3, 0), (64, 2, 5), (96, 1, 2), (256, 1, 1)])
@pytest.mark.parametrize(
    "seqlen_q, new, rotary_dim, interleaved, causal, window, softcap, alibi",
    [
        (1, 1, 0, True, True, (-1, -1), 0.0, False),
        (3, 7, 16, True, True, (-1, -1), 0.0, False),
        (5, 19, 32, False, True, (6, 0), 0.0, True),
        (2, 2, 8, False, False, (-1, -1), 5.0, False),
        (4, 0, 0, True, False, (3, 2), 2.0, True),
    ],
)
def test_kvcache_paged_matches_float64_attention_over_the_gathered_cache(
    page_size, pages_per_seq, spare, seqlen_q, new, rotary_dim, interleaved, causal, window, softcap, alibi, rng
):
    """A paged cache (shuffled physical pages, spare pages of garbage) gives what the same logical cache gives
    contiguous: appends land in the right pages (crossing page boundaries), the gathered cache matches, the output
    matches float64 attention over it."""
    batch, h, hk, d = 3, 4, 2, 32
    length = page_size * pages_per_seq
    q = _randn(batch, seqlen_q, h, d, rng=rng)
    k_cache, v_cache = _randn(batch, length, hk, d, rng=rng), _randn(batch, length, hk, d, rng=rng)
    k_new = _randn(batch, new, hk, d, rng=rng) if new else None
    v_new = _randn(batch, new, hk, d, rng=rng) if new else None
    span = max(new, seqlen_q)
    # lengths near a page boundary so that appends cross it, and one entry at the very start
    seqlens = torch.tensor([0, max(0, min(length - span, page_size - new // 2 - 1)), length - span], dtype=torch.int32)
    cos = sin = None
    if rotary_dim:
        angle = torch.rand(length, rotary_dim // 2, generator=rng, dtype=torch.float64) * 2 * math.pi
        cos, sin = angle.cos(), angle.sin()
    slopes = torch.rand(batch, h, generator=rng) if alibi else None
    case = dict(q=q, k_cache=k_cache, v_cache=v_cache, k=k_new, v=v_new, rotary_cos=cos, rotary_sin=sin,
                cache_seqlens=seqlens, cache_batch_idx=None, cache_leftpad=None, causal=causal, window_size=window,
                softcap=softcap, rotary_interleaved=interleaved, alibi_slopes=slopes)
    ref, ref_k_cache, ref_v_cache = _kvcache_oracle(case)
    k_pool, table = _paginate(k_cache, page_size, spare, rng)
    v_pool = torch.randn(k_pool.shape, generator=rng, dtype=k_pool.dtype)  # the same page layout as k_pool
    v_pool[table.long()] = v_cache.unflatten(1, (pages_per_seq, page_size))
    untouched = [p for p in range(k_pool.shape[0]) if p not in set(table.flatten().tolist())]
    spare_k = k_pool[untouched].clone()
    paged = dict(case, k_cache=k_pool, v_cache=v_pool, block_table=table)
    out, lse = volta_train.flash_attn_with_kvcache(**paged, return_softmax_lse=True)
    assert torch.allclose(_unpaginate(k_pool, table), ref_k_cache, rtol=1e-12, atol=1e-12)
    assert torch.equal(_unpaginate(v_pool, table), ref_v_cache)
    assert torch.equal(k_pool[untouched], spare_k)  # pages outside the table are never written
    assert torch.allclose(out, ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL), rng.initial_seed()
    # and bit-identical to the same logical cache held contiguous
    out_c, lse_c = volta_train.flash_attn_with_kvcache(**case, return_softmax_lse=True)
    assert torch.equal(out, out_c) and torch.equal(lse, lse_c)


def test_kvcache_paged_unused_table_entries_are_not_read(rng):
    """Table entries past an entry's last used page may hold anything (e.g. -1): they are neither checked nor read."""
    q = _randn(2, 1, 2, 16, rng=rng)
    pool = _randn(4, 32, 2, 16, rng=rng)
    table = torch.tensor([[2, -1, 99], [0, 3, -7]], dtype=torch.int32)
    seqlens = torch.tensor([20, 40], dtype=torch.int32)
    out = volta_train.flash_attn_with_kvcache(q, pool, pool.clone(), cache_seqlens=seqlens, block_table=table)
    k0 = pool[2, :20]
    ref0, _ = naive_attention(q[:1], k0[None], k0[None])
    assert torch.allclose(out[:1], ref0, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)


@pytest.mark.parametrize("mode", ["host", "device"])
def test_kvcache_paged_validation_names_the_argument(mode, monkeypatch):
    monkeypatch.setenv(validation.KVCACHE_CHECK_ENV, mode)
    q = torch.randn(2, 1, 2, 16, dtype=torch.float64)
    pool = torch.randn(4, 32, 2, 16, dtype=torch.float64)
    good = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    lens = torch.tensor([10, 40], dtype=torch.int32)
    call = lambda **kw: volta_train.flash_attn_with_kvcache(**dict(dict(q=q, k_cache=pool, v_cache=pool.clone(),
                                                                         cache_seqlens=lens, block_table=good), **kw))
    call()
    with pytest.raises(TypeError, match="block_table must be int32"):
        call(block_table=good.long())
    with pytest.raises(ValueError, match=r"block_table has shape \(2,\); accepted: \[batch=2"):
        call(block_table=good[0])
    with pytest.raises(ValueError, match=r"block_table has shape \(1, 2\); accepted: \[batch=2"):
        call(block_table=good[:1])
    with pytest.raises(ValueError, match="page_block_size 48.*accepted: a multiple of 32"):
        call(k_cache=torch.randn(4, 48, 2, 16, dtype=torch.float64),
             v_cache=torch.randn(4, 48, 2, 16, dtype=torch.float64))
    with pytest.raises(ValueError, match="cache_batch_idx is given with a block_table"):
        call(cache_batch_idx=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_leftpad is given with a block_table"):
        call(cache_leftpad=torch.tensor([0, 1], dtype=torch.int32))
    with pytest.raises(ValueError if mode == "host" else RuntimeError,
                       match=r"cache_seqlens\[.\] is .* accepted: 0 <= cache_seqlens <= 64"):
        call(cache_seqlens=torch.tensor([1, 65], dtype=torch.int32))  # the logical cache: 2 pages of 32
    if mode == "host":
        with pytest.raises(ValueError, match=r"block_table\[1, 1\] is 4; accepted: cache pages 0 to 3"):
            call(block_table=torch.tensor([[0, 9], [2, 4]], dtype=torch.int32))  # [0, 1]: unused (10 keys), fine
        with pytest.raises(ValueError, match=r"block_table\[0, 0\] is -1"):
            call(block_table=torch.tensor([[-1, 1], [2, 3]], dtype=torch.int32))
    else:
        with pytest.raises(RuntimeError, match="block_table: accepted: cache pages 0 to 3"):
            call(block_table=torch.tensor([[0, 9], [2, 4]], dtype=torch.int32))


def test_kvcache_paged_decode_loop_crosses_pages_and_equals_causal_attention(rng):
    """Decode one token at a time through 3 pages of 32 (shuffled): every step equals causal attention over the
    tokens so far."""
    heads, hk, d, steps = 4, 2, 16, 70
    q = _randn(1, steps, heads, d, rng=rng)
    k = _randn(1, steps, hk, d, rng=rng)
    v = _randn(1, steps, hk, d, rng=rng)
    pool, vpool = torch.zeros(5, 32, hk, d, dtype=q.dtype), torch.zeros(5, 32, hk, d, dtype=q.dtype)
    table = torch.tensor([[3, 0, 4]], dtype=torch.int32)
    full, _ = naive_attention(q, k, v, causal=True)
    for t in range(steps):
        out = volta_train.flash_attn_with_kvcache(q[:, t : t + 1], pool, vpool, k[:, t : t + 1], v[:, t : t + 1],
                                                  cache_seqlens=t, block_table=table, causal=True)
        assert torch.allclose(out[0, 0], full[0, t], rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL), t
    assert torch.equal(_unpaginate(pool, table)[:, :steps], k)


def test_kvcache_decode_loop_equals_full_causal_attention(rng):
    """Prefill 9 tokens then decode 6 one at a time with an int cache_seqlens: the last step equals causal
    attention over all 15 tokens."""
    b, h, d, total = 2, 4, 16, 15
    q, k, v = (_randn(b, total, h, d, rng=rng) for _ in range(3))
    k_cache, v_cache = torch.zeros(b, 32, h, d, dtype=torch.float64), torch.zeros(b, 32, h, d, dtype=torch.float64)
    outs = [volta_train.flash_attn_with_kvcache(q[:, :9], k_cache, v_cache, k[:, :9], v[:, :9], cache_seqlens=0,
                                                causal=True, num_splits=4)]
    for t in range(9, total):
        outs.append(volta_train.flash_attn_with_kvcache(
            q[:, t : t + 1], k_cache, v_cache, k[:, t : t + 1], v[:, t : t + 1], cache_seqlens=np.int64(t),
            causal=True))
    ref, _ = naive_attention(q, k, v, causal=True)
    assert torch.allclose(torch.cat(outs, dim=1), ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    assert torch.equal(k_cache[:, :total], k) and torch.equal(k_cache[:, total:], torch.zeros_like(k_cache[:, total:]))


def test_kvcache_without_cache_seqlens_reads_the_whole_cache(rng):
    q = _randn(2, 3, 2, 8, rng=rng)
    k_cache, v_cache = _randn(2, 11, 2, 8, rng=rng), _randn(2, 11, 2, 8, rng=rng)
    out = volta_train.flash_attn_with_kvcache(q, k_cache, v_cache, causal=True)
    ref, _ = naive_attention(q, k_cache, v_cache, causal=True)
    assert torch.allclose(out, ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(k=torch.randn(1, 2, 2, 8)), ValueError, "k and v go together"),
    (dict(k=torch.randn(1, 2, 2, 8), v=torch.randn(1, 2, 2, 8)), ValueError, "cache_seqlens is None"),
    (dict(k=torch.randn(1, 2, 2, 8), v=torch.randn(1, 2, 2, 8), cache_seqlens=9), ValueError,
     "cache_seqlens[0] is 9 with 2 new tokens, but the cache holds 10"),
    (dict(cache_seqlens=torch.tensor([1.0])), TypeError, "cache_seqlens must be an integer tensor"),
    (dict(cache_seqlens=2.5), TypeError, "cache_seqlens is 2.5"),
    (dict(cache_seqlens=3, cache_batch_idx=torch.tensor([4], dtype=torch.int32)), ValueError, "cache_batch_idx has 4"),
    (dict(cache_seqlens=3, cache_leftpad=torch.tensor([5], dtype=torch.int32)), ValueError, "cache_leftpad[0] is 5"),
    (dict(cache_seqlens=3, rotary_cos=torch.ones(10, 4)), ValueError, "rotary_cos and rotary_sin go together"),
    (dict(cache_seqlens=3, rotary_cos=torch.ones(10, 4), rotary_sin=torch.ones(10, 4)), ValueError, "without k/v"),
    (dict(cache_seqlens=3, k=torch.randn(1, 2, 2, 8), v=torch.randn(1, 2, 2, 8), rotary_cos=torch.ones(10, 5),
          rotary_sin=torch.ones(10, 5)), ValueError, "rotary_cos has shape (10, 5)"),
    (dict(cache_seqlens=3, k=torch.randn(1, 2, 2, 8), v=torch.randn(1, 2, 2, 8), rotary_cos=torch.ones(4, 4),
          rotary_sin=torch.ones(4, 4)), ValueError, "accepted: seqlen_ro >= 5"),
    (dict(cache_seqlens=3, k=torch.randn(1, 2, 3, 8), v=torch.randn(1, 2, 3, 8)), ValueError, "k has shape (1, 2, 3, 8)"),
    (dict(cache_seqlens=3, num_splits=1.5), TypeError, "num_splits"),
    (dict(cache_seqlens=3, window_size=(1.5, 0)), TypeError, "window_size"),
    (dict(cache_seqlens=3, softmax_scale=float("inf")), ValueError, "softmax_scale"),
])
def test_kvcache_errors_name_the_argument(kwargs, error, words):
    q, k_cache, v_cache = torch.randn(1, 1, 4, 8), torch.randn(2, 10, 2, 8), torch.randn(2, 10, 2, 8)
    with pytest.raises(error) as info:
        volta_train.flash_attn_with_kvcache(q, k_cache, v_cache, **kwargs)
    assert words in str(info.value), str(info.value)


def test_kvcache_repeated_batch_idx_with_append_is_refused():
    q, k_cache, v_cache = torch.randn(2, 1, 2, 8), torch.randn(3, 10, 2, 8), torch.randn(3, 10, 2, 8)
    with pytest.raises(ValueError, match="cache_batch_idx repeats"):
        volta_train.flash_attn_with_kvcache(q, k_cache, v_cache, torch.randn(2, 1, 2, 8), torch.randn(2, 1, 2, 8),
                                            cache_seqlens=1, cache_batch_idx=torch.tensor([1, 1], dtype=torch.int32))


def test_kvcache_has_no_backward_and_says_so(monkeypatch, caplog):
    from volta_train import interface

    monkeypatch.setattr(interface, "_logged_detach", [])
    q = torch.randn(1, 1, 2, 8, requires_grad=True)
    with caplog.at_level(logging.WARNING, logger="volta_train"):
        out = volta_train.flash_attn_with_kvcache(q, torch.randn(1, 4, 2, 8), torch.randn(1, 4, 2, 8), cache_seqlens=2)
    assert not out.requires_grad
    assert any("has no backward" in r.getMessage() for r in caplog.records)


def test_kvcache_runs_on_the_kernel(fake_kernel, rng):
    q = _randn(1, 1, 2, 16, rng=rng)
    cache = _randn(1, 8, 2, 16, rng=rng)
    out = volta_train.flash_attn_with_kvcache(q, cache, cache.clone(), cache_seqlens=4, softcap=3.0, causal=True)
    assert [c[0] for c in fake_kernel] == ["forward_with_kvcache"] and fake_kernel[0][2].softcap == 3.0
    assert fake_kernel[0][2].causal
    assert fake_kernel[0][3:] == (4, 4)  # key_end, longest: read by the validation, not again by the kernel path
    ref, _ = naive_attention(q, cache[:, :4], cache[:, :4], causal=True, softcap=3.0)
    assert torch.allclose(out, ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)


# ---------------------------------------------------------------------------------------------------------------
# unpad_input / pad_input (flash_attn.bert_padding)
# ---------------------------------------------------------------------------------------------------------------

def test_unpad_pad_round_trip_and_varlen_equals_padded_attention(rng):
    batch, seqlen, h, d = 4, 12, 2, 16
    lengths = torch.tensor([12, 1, 7, 0])
    mask = torch.arange(seqlen).view(1, -1) < lengths.view(-1, 1)
    x = _randn(batch, seqlen, h, d, rng=rng, requires_grad=True)
    x_unpad, indices, cu, max_seqlen, used = volta_train.unpad_input(x, mask)
    assert x_unpad.shape == (int(lengths.sum()), h, d)
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 12, 13, 20, 20]
    assert max_seqlen == 12 and isinstance(max_seqlen, int) and used.tolist() == lengths.tolist()
    assert indices.dtype == torch.int64
    back = volta_train.pad_input(x_unpad, indices, batch, seqlen)
    assert torch.equal(back[mask], x[mask]) and torch.equal(back[~mask], torch.zeros_like(back[~mask]))
    (grad,) = torch.autograd.grad(back.sum(), x)
    assert torch.equal(grad, mask[..., None, None].expand_as(x).double())
    # attention on the packed tokens equals per-row attention on the unpadded prefixes
    out = volta_train.pad_input(
        volta_train.flash_attn_varlen_func(x_unpad, x_unpad, x_unpad, cu, cu, max_seqlen, max_seqlen, causal=True),
        indices, batch, seqlen)
    for b, n in enumerate(lengths.tolist()):
        if n:
            ref, _ = naive_attention(x[b : b + 1, :n], x[b : b + 1, :n], x[b : b + 1, :n], causal=True)
            assert torch.allclose(out[b, :n], ref[0], rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
        assert torch.equal(out[b, n:], torch.zeros_like(out[b, n:]))


def test_unpad_with_unused_mask_and_non_prefix_masks(rng):
    x = _randn(2, 6, 3, rng=rng)
    mask = torch.tensor([[0, 1, 1, 0, 1, 0], [1, 1, 0, 0, 0, 0]])  # int mask, holes allowed
    unused = torch.tensor([[0, 0, 0, 0, 0, 1], [0, 0, 1, 0, 0, 0]], dtype=torch.bool)
    x_unpad, indices, cu, max_seqlen, used = volta_train.unpad_input(x, mask, unused)
    assert indices.tolist() == [1, 2, 4, 5, 6, 7, 8]
    assert cu.tolist() == [0, 4, 7] and max_seqlen == 4 and used.tolist() == [3, 2]
    assert torch.equal(x_unpad, x.reshape(12, 3)[indices])
    with pytest.raises(ValueError, match="overlap"):
        volta_train.unpad_input(x, mask, mask.bool())
    with pytest.raises(ValueError, match=r"attention_mask has shape \(2, 5\)"):
        volta_train.unpad_input(x, mask[:, :5])
    with pytest.raises(ValueError, match="0/1"):
        volta_train.unpad_input(x, mask * 2)
    with pytest.raises(TypeError, match="attention_mask must be a torch.Tensor"):
        volta_train.unpad_input(x, mask.tolist())


def test_unpad_for_concatenated_sequences(rng):
    from volta_train.bert_padding import unpad_input_for_concatenated_sequences

    x = _randn(2, 6, 4, rng=rng)
    lengths = torch.tensor([[2, 3, 0, 0, 0, 0], [6, 0, 0, 0, 0, 0]])
    x_unpad, indices, cu, max_seqlen = unpad_input_for_concatenated_sequences(x, lengths)
    assert indices.tolist() == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11]
    assert cu.tolist() == [0, 2, 5, 11] and max_seqlen == 6
    assert torch.equal(x_unpad, x.reshape(12, 4)[indices])


def test_index_helpers_errors():
    with pytest.raises(ValueError, match="indices run from 0 to 7; accepted: 0 to 4"):
        volta_train.index_first_axis(torch.randn(5, 2), torch.tensor([0, 7]))
    with pytest.raises(ValueError, match="values has 2 rows but indices 3"):
        volta_train.index_put_first_axis(torch.randn(2, 2), torch.tensor([0, 1, 2]), 5)


# ---------------------------------------------------------------------------------------------------------------
# issue 14's API edge cases
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("b, sq, sk, h, hk", [(0, 5, 5, 2, 2), (2, 0, 5, 2, 2), (2, 5, 5, 0, 0), (2, 5, 0, 2, 2),
                                             (2, 0, 0, 2, 1)])
def test_empty_dense_inputs_give_empty_outputs_and_gradients(b, sq, sk, h, hk):
    q = torch.randn(b, sq, h, 16, requires_grad=True)
    k = torch.randn(b, sk, hk, 16, requires_grad=True)
    v = torch.randn(b, sk, hk, 16, requires_grad=True)
    out, lse, _ = volta_train.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert out.shape == q.shape and lse.shape == (b, h, sq)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isposinf(lse).all()  # seqlen_k 0: zeros, lse +inf
    out.sum().backward()
    for t in (q, k, v):
        assert t.grad.shape == t.shape and torch.equal(t.grad, torch.zeros_like(t))
    packed = volta_train.flash_attn_qkvpacked_func(torch.randn(b, sq, 3, h, 16)) if sq == sk and h == hk else None
    assert packed is None or packed.shape == (b, sq, h, 16)


def test_empty_varlen_inputs():
    q = torch.randn(0, 2, 16, requires_grad=True)
    cu = torch.zeros(3, dtype=torch.int32)
    out = volta_train.flash_attn_varlen_func(q, q, q, cu, cu, 0, 0)
    assert out.shape == (0, 2, 16)
    out.sum().backward()
    assert q.grad.shape == q.shape


@pytest.mark.parametrize("scale", [float("inf"), float("-inf"), float("nan")])
def test_non_finite_softmax_scale_is_refused(scale):
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="softmax_scale is .*accepted: None .* or a finite float"):
        volta_train.flash_attn_func(q, q, q, softmax_scale=scale)


def test_softmax_scale_accepts_numpy_and_0d_tensors(rng):
    q, k, v = _qkv(rng, 1, 6, 6, 2, 2, 8, requires_grad=False)
    a = volta_train.flash_attn_func(q, k, v, softmax_scale=0.5)
    assert torch.equal(a, volta_train.flash_attn_func(q, k, v, softmax_scale=np.float32(0.5)))
    assert torch.equal(a, volta_train.flash_attn_func(q, k, v, softmax_scale=torch.tensor(0.5)))


@pytest.mark.parametrize("window", [(1.5, 0.7), (2.0, 0), (True, 0), ("1", 0)])
def test_non_integer_window_is_refused_not_truncated(window):
    q = torch.randn(1, 4, 2, 16)
    with pytest.raises(TypeError, match=r"window_size is .*accepted: a pair \(left, right\) of ints"):
        volta_train.flash_attn_func(q, q, q, window_size=window)


def test_integer_like_windows_are_accepted(rng):
    q, k, v = _qkv(rng, 1, 9, 9, 2, 2, 8, requires_grad=False)
    a = volta_train.flash_attn_func(q, k, v, window_size=(3, 1))
    for window in [(np.int64(3), np.int32(1)), (torch.tensor(3), torch.tensor(1)), [3, 1]]:
        assert torch.equal(a, volta_train.flash_attn_func(q, k, v, window_size=window))


@pytest.mark.parametrize("max_seqlen", [5, np.int64(5), np.int32(7), torch.tensor(5), torch.tensor(6, dtype=torch.int32)])
def test_integer_like_max_seqlen_is_accepted(max_seqlen, rng):
    q = _randn(8, 2, 16, rng=rng)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    out = volta_train.flash_attn_varlen_func(q, q, q, cu, cu, max_seqlen, max_seqlen, causal=True)
    ref = volta_train.flash_attn_varlen_func(q, q, q, cu, cu, 5, 5, causal=True)
    assert torch.equal(out, ref)


@pytest.mark.parametrize("bad, error, words", [
    (5.0, TypeError, "max_seqlen_q is 5.0 (float); accepted: an int"),
    (torch.tensor([5]), TypeError, "max_seqlen_q is tensor([5]); accepted: an int"),
    (torch.tensor(5.0), TypeError, "max_seqlen_q is tensor(5.) (Tensor); accepted: an int"),
    (True, TypeError, "max_seqlen_q is True"),
    (4, ValueError, "max_seqlen_q is 4 but the longest sequence in cu_seqlens_q has 5 tokens"),
])
def test_bad_max_seqlen_messages(bad, error, words):
    q = torch.randn(8, 2, 16)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    with pytest.raises(error) as info:
        volta_train.flash_attn_varlen_func(q, q, q, cu, cu, bad, 5)
    assert words in str(info.value), str(info.value)


@pytest.mark.parametrize("position", [0, 1, 2])
def test_non_tensors_get_a_type_error_naming_the_argument(position):
    args = [torch.randn(1, 4, 2, 16) for _ in range(3)]
    args[position] = args[position].tolist()
    name = "qkv"[position]
    with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor, got list"):
        volta_train.flash_attn_func(*args)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    packed = [torch.randn(4, 2, 16) for _ in range(3)]
    packed[position] = packed[position].tolist()
    with pytest.raises(TypeError, match=f"^{name} must be a torch.Tensor, got list"):
        volta_train.flash_attn_varlen_func(*packed, cu, cu, 4, 4)
    with pytest.raises(TypeError, match="^cu_seqlens_k must be a torch.Tensor, got list"):
        volta_train.flash_attn_varlen_func(*[torch.randn(4, 2, 16) for _ in range(3)], cu, [0, 4], 4, 4)
    with pytest.raises(TypeError, match="^k_cache must be a torch.Tensor"):
        volta_train.flash_attn_with_kvcache(torch.randn(1, 1, 2, 16), None, torch.randn(1, 4, 2, 16))


# ---------------------------------------------------------------------------------------------------------------
# issue 14 item 7: fp64 inputs keep an fp64 log-sum-exp
# ---------------------------------------------------------------------------------------------------------------

def _large_score_inputs(rng, n=48, heads=2, d=64, magnitude=60.0, noise=0.02):
    """q and k = magnitude * (one shared unit direction) + small noise: every score is ~magnitude^2 (3600) while
    the scores of a row differ by O(1), so the softmax is far from one-hot and every gradient is meaningful."""
    u = torch.randn(d, generator=rng, dtype=torch.float64)
    u = u / u.norm()
    q = magnitude * u + noise * torch.randn(1, n, heads, d, generator=rng, dtype=torch.float64)
    k = magnitude * u + noise * torch.randn(1, n, heads, d, generator=rng, dtype=torch.float64)
    v = torch.randn(1, n, heads, d, generator=rng, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v)]


@pytest.mark.parametrize("causal", [False, True])
def test_fp64_gradients_at_large_scores_reach_1e6(causal, rng):
    q, k, v = _large_score_inputs(rng)
    out, lse, _ = volta_train.flash_attn_func(q, k, v, softmax_scale=1.0, causal=causal, return_attn_probs=True)
    ref, ref_lse = naive_attention(q, k, v, softmax_scale=1.0, causal=causal)
    assert lse.dtype == torch.float64
    assert 3000 < ref_lse.min().item() and ref_lse.max().item() < 4000
    assert (lse - ref_lse).abs().max().item() < 1e-9  # fp32 could not hold 3600 closer than ~1e-4
    _check_grads(out, ref, (q, k, v), rng, bound=1e-6)


def test_fp32_log_sum_exp_would_fail_the_large_score_bound(rng):
    """The bound above can fail: the same backward fed an fp32-rounded log-sum-exp misses 1e-6."""
    from volta_train import reference

    q, k, v = (t.detach() for t in _large_score_inputs(rng))
    params = AttentionOptions(softmax_scale=1.0)
    out, lse = reference.reference_forward(q, k, v, params)
    dout = torch.randn(out.shape, generator=rng, dtype=torch.float64)
    exact = reference.reference_backward(dout, q, k, v, out, lse, params)
    rounded = reference.reference_backward(dout, q, k, v, out, lse.float(), params)
    assert max(_rel(r, e) for r, e in zip(rounded, exact)) > 1e-6


def test_fp64_lse_dtype_in_every_layout(rng):
    q = _randn(6, 2, 8, rng=rng)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    _, lse, _ = volta_train.flash_attn_varlen_func(q, q, q, cu, cu, 6, 6, return_attn_probs=True)
    assert lse.dtype == torch.float64
    _, lse, _ = volta_train.flash_attn_func(q[None].float(), q[None].float(), q[None].float(), return_attn_probs=True)
    assert lse.dtype == torch.float32


def test_torch_compile_with_softcap_and_odd_head_dim(rng):
    q, k, v = _qkv(rng, 1, 17, 17, 2, 2, 37, dtype=torch.float32)

    def f(q, k, v):
        return volta_train.flash_attn_func(q, k, v, causal=True, softcap=3.0).square().sum()

    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    grads = torch.autograd.grad(compiled(q, k, v), (q, k, v))
    ref_grads = torch.autograd.grad(f(q, k, v), (q, k, v))
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=1e-6)


# ---------------------------------------------------------------------------------------------------------------
# GPU: the kernel path with head_dim padding (run by the lead on an H100 / V100)
# ---------------------------------------------------------------------------------------------------------------

def _torch_fp16_eager(q, k, v, causal):
    """PyTorch fp16 attention (fp16 matmuls, fp32 softmax) and its gradients: the error yardstick."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * q.shape[-1] ** -0.5
    if causal:
        n_q, n_k = q.shape[1], k.shape[1]
        i = torch.arange(n_q, device=q.device).view(-1, 1)
        j = torch.arange(n_k, device=q.device).view(1, -1)
        s = s.masked_fill(j > i + n_k - n_q, float("-inf"))
    p = torch.softmax(s.float(), dim=-1).nan_to_num(0.0).half()
    return q, k, v, torch.einsum("bhij,bjhd->bihd", p, vv)


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [59, 111, 7, 100])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_kernel_pads_odd_head_dims_within_twice_pytorch_fp16_error(head_dim, causal, monkeypatch):
    if torch.cuda.get_device_capability()[0] < 7:
        pytest.skip("needs sm_70 or newer")
    monkeypatch.setenv("VOLTA_TRAIN_BACKEND", "kernel")  # raises if the kernel cannot run it
    gen = torch.Generator(device="cuda").manual_seed(head_dim)
    shape_q, shape_kv = (2, 333, 8, head_dim), (2, 517, 2, head_dim)
    q = torch.randn(shape_q, generator=gen, device="cuda").half().requires_grad_()
    k = torch.randn(shape_kv, generator=gen, device="cuda").half().requires_grad_()
    v = torch.randn(shape_kv, generator=gen, device="cuda").half().requires_grad_()
    out = volta_train.flash_attn_func(q, k, v, causal=causal)
    dout = torch.randn(out.shape, generator=gen, device="cuda").half()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, _ = naive_attention(q64, k64, v64, causal=causal)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), dout.double())
    tq, tk, tv, tout = _torch_fp16_eager(q, k, v, causal)
    torch_grads = torch.autograd.grad(tout, (tq, tk, tv), dout)
    err = lambda a, b: (a.double() - b).abs().max().item()
    assert err(out, ref) <= 2 * err(tout, ref) + 1e-4, (err(out, ref), err(tout, ref))
    for name, g, t, r in zip("qkv", grads, torch_grads, ref_grads):
        assert g.shape == r.shape and torch.isfinite(g).all()
        assert err(g, r) <= 2 * err(t, r) + 1e-4, (name, err(g, r), err(t, r))


@pytest.mark.gpu
def test_gpu_aligned_head_dim_is_not_copied(monkeypatch):
    """head_dim 64 reaches kernels.forward as the caller's tensors (no padding copy)."""
    seen = []
    original = kernels.forward
    monkeypatch.setattr(kernels, "forward", lambda q, *a: seen.append(q.data_ptr()) or original(q, *a))
    monkeypatch.setenv("VOLTA_TRAIN_BACKEND", "kernel")
    q = torch.randn(1, 64, 4, 64, device="cuda").half()
    volta_train.flash_attn_func(q, q, q)
    assert seen == [q.data_ptr()]


@pytest.mark.gpu
def test_gpu_softcap_and_kvcache_run_on_gpu_tensors():
    """Through the public API: on a GPU with NVRTC the kvcache call runs the split-KV decoding kernel."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 1, 8, 64, generator=gen, device="cuda").half()
    k_cache = torch.randn(2, 300, 2, 64, generator=gen, device="cuda").half()
    v_cache = torch.randn(2, 300, 2, 64, generator=gen, device="cuda").half()
    k_new = torch.randn(2, 1, 2, 64, generator=gen, device="cuda").half()
    out = volta_train.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, k_new, cache_seqlens=200, causal=True,
                                              softcap=30.0)
    ref, _ = naive_attention(q, k_cache[:, :201], v_cache[:, :201], causal=True, softcap=30.0)
    assert torch.equal(k_cache[:, 200], k_new[:, 0])
    assert _rel(out, ref) < 2e-3


def _kvcache_call(seqlens, leftpad=None, batch_idx=None, new=0, cache_len=12, batch_cache=3):
    q = torch.randn(len(seqlens), 1, 2, 8)
    k_cache, v_cache = torch.randn(batch_cache, cache_len, 2, 8), torch.randn(batch_cache, cache_len, 2, 8)
    k = v = torch.randn(len(seqlens), new, 2, 8) if new else None
    as_t = lambda x: None if x is None else torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return validation.check_kvcache(q, k_cache, v_cache, k, v, None, None, as_t(seqlens), as_t(batch_idx),
                                     as_t(leftpad), True, (-1, -1))


def test_kvcache_extent_is_read_once_on_the_host(monkeypatch):
    """The lengths, rows and left pads are read in one device-to-host copy; the extent the kernel path plans with
    (one past the last key read, the most keys one entry sees) comes from those values."""
    reads = []
    real = validation._read_int_vectors
    monkeypatch.setattr(validation, "_read_int_vectors", lambda v: reads.append(sorted(v)) or real(v))
    extent = _kvcache_call([5, 9], leftpad=[0, 6], batch_idx=[2, 0], new=2)
    assert reads == [["cache_batch_idx", "cache_leftpad", "cache_seqlens"]]
    assert (extent.key_end, extent.longest) == (11, 7)  # ends 7 and 11; 11 - 6 = 5 < 7 - 0
    assert extent.cache_seqlens.dtype == torch.int32 and extent.cache_seqlens.tolist() == [5, 9]
    extent = validation.check_kvcache(torch.randn(2, 1, 2, 8), torch.randn(2, 6, 2, 8), torch.randn(2, 6, 2, 8),
                                       None, None, None, None, 3, None, None, False, (-1, -1))
    assert (extent.key_end, extent.longest, extent.cache_seqlens.tolist()) == (3, 3, [3, 3])


@pytest.mark.parametrize("bad, match", [
    (dict(seqlens=[5, 11], new=2), r"cache_seqlens\[1\] is 11 with 2 new tokens"),
    (dict(seqlens=[5, 9], batch_idx=[0, 3]), "cache_batch_idx has 3; accepted: cache rows 0 to 2"),
    (dict(seqlens=[5, 9], batch_idx=[1, 1], new=1), "cache_batch_idx repeats a cache row"),
    (dict(seqlens=[5, 9], leftpad=[6, 0]), r"cache_leftpad\[0\] is 6; accepted: 0 to cache_seqlens\[0\] \(5\)"),
])
def test_kvcache_bad_vectors_are_named_on_the_host(bad, match):
    with pytest.raises(ValueError, match=match):
        _kvcache_call(**bad)


@pytest.mark.parametrize("bad", [
    dict(seqlens=[5, 11], new=2), dict(seqlens=[5, 9], batch_idx=[0, 3]), dict(seqlens=[5, 9], batch_idx=[1, 1], new=1),
    dict(seqlens=[5, 9], leftpad=[6, 0]), dict(seqlens=[-1, 2]),
])
def test_kvcache_device_checks_read_nothing_and_still_refuse(bad, monkeypatch):
    """VOLTA_TRAIN_KVCACHE_CHECK=device (and compiling / CUDA-graph capture): no host read, the extent is unknown
    (-1: the kernel path plans for the whole cache), and the same bounds are asserted on the device (on the CPU a
    failed torch._assert_async raises at once)."""
    monkeypatch.setenv(validation.KVCACHE_CHECK_ENV, "device")
    monkeypatch.setattr(validation, "_read_int_vectors", lambda v: pytest.fail(f"read {sorted(v)} on the host"))
    good = _kvcache_call([5, 9], leftpad=[1, 0], batch_idx=[2, 0], new=2)
    assert (good.key_end, good.longest) == (-1, -1) and good.cache_seqlens.tolist() == [5, 9]
    with pytest.raises(RuntimeError):
        _kvcache_call(**bad)


def test_kvcache_check_mode_is_validated(monkeypatch):
    monkeypatch.setenv(validation.KVCACHE_CHECK_ENV, "fast")
    with pytest.raises(ValueError, match="VOLTA_TRAIN_KVCACHE_CHECK='fast'; accepted: 'host'"):
        _kvcache_call([1, 2])


@pytest.mark.slow
def test_kvcache_under_torch_compile_checks_on_the_device():
    """Compiled, the checks read nothing to the host (no graph break on .tolist()) and still refuse a bad length."""
    q, k, v = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    k_cache, v_cache = torch.randn(2, 10, 2, 16), torch.randn(2, 10, 2, 16)

    def step(q, k_cache, v_cache, k, v, seqlens):
        return volta_train.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens, causal=True)

    compiled = torch.compile(step, fullgraph=True)  # a host read would be a graph break: an error here
    seqlens = torch.tensor([3, 7], dtype=torch.int32)
    want = step(q, k_cache.clone(), v_cache.clone(), k, v, seqlens)
    assert torch.equal(compiled(q, k_cache.clone(), v_cache.clone(), k, v, seqlens), want)
    with pytest.raises(RuntimeError, match="cache_seqlens"):
        compiled(q, k_cache.clone(), v_cache.clone(), k, v, torch.tensor([3, 10], dtype=torch.int32))


@pytest.mark.parametrize("page_size, causal, window",
                         [(32, True, (-1, -1)), (64, False, (5, 3)), (256, True, (-1, -1))])
def test_varlen_paged_kv_matches_float64_attention_over_the_gathered_keys(page_size, causal, window, rng):
    """flash_attn_varlen_func with a block_table (flash-attn 2.8's paged varlen): sequence b's keys are its first
    cu_seqlens_k lengths of logical positions through the table; GQA, odd lengths, a sequence spanning pages, an empty
    one; gradients reach the pages."""
    lens_q, lens_k = [3, 1, 7, 2], [2 * page_size + 5, 9, 0, page_size]
    hk, h, d, pages_per_seq = 2, 6, 24, 3
    pool_k = _randn(4 * pages_per_seq + 2, page_size, hk, d, rng=rng, requires_grad=True)
    pool_v = _randn(4 * pages_per_seq + 2, page_size, hk, d, rng=rng)
    table = torch.randperm(pool_k.shape[0], generator=rng)[: 4 * pages_per_seq].view(4, pages_per_seq).to(torch.int32)
    q = _randn(sum(lens_q), h, d, rng=rng)
    cu_q = torch.tensor([0] + np.cumsum(lens_q).tolist(), dtype=torch.int32)
    cu_k = torch.tensor([0] + np.cumsum(lens_k).tolist(), dtype=torch.int32)
    out = volta_train.flash_attn_varlen_func(q, pool_k, pool_v, cu_q, cu_k, max(lens_q), max(lens_k), causal=causal,
                                             window_size=window, block_table=table)
    for b in range(4):
        k_b = pool_k[table[b].long()].flatten(0, 1)[: lens_k[b]]
        v_b = pool_v[table[b].long()].flatten(0, 1)[: lens_k[b]]
        q_b = q[cu_q[b] : cu_q[b + 1]]
        ref, _ = naive_attention(q_b[None], k_b[None], v_b[None], causal=causal, window_size=window)
        assert torch.allclose(out[cu_q[b] : cu_q[b + 1]], ref[0], rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL), b
    out.sum().backward()
    unused = sorted(set(range(pool_k.shape[0])) - set(table.flatten().tolist()))
    assert pool_k.grad is not None and not pool_k.grad[unused].any()


def test_varlen_paged_kv_validation_names_the_argument(rng):
    q = _randn(4, 2, 16, rng=rng)
    pool = _randn(3, 32, 2, 16, rng=rng)
    cu_q = torch.tensor([0, 2, 4], dtype=torch.int32)
    table = torch.tensor([[0, 1], [2, 0]], dtype=torch.int32)
    call = lambda cu_k, t=table: volta_train.flash_attn_varlen_func(q, pool, pool, cu_q, cu_k, 2, 64, block_table=t)
    call(torch.tensor([0, 64, 70], dtype=torch.int32))
    with pytest.raises(ValueError, match="cu_seqlens_k gives sequence 1 65 keys.*accepted"):
        call(torch.tensor([0, 3, 68], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_table\[1, 0\] is 3; accepted: cache pages 0 to 2"):
        call(torch.tensor([0, 3, 6], dtype=torch.int32), torch.tensor([[0, 1], [3, 0]], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_table has shape \(1, 2\)"):
        call(torch.tensor([0, 3, 6], dtype=torch.int32), table[:1])


@pytest.mark.slow
def test_kvcache_paged_under_torch_compile():
    """A paged call compiled with fullgraph: the block table's page check runs on the device (no graph break), the
    appends land in the same pages as eagerly, the output is the eager one, a page out of range is refused."""
    q, k, v = torch.randn(2, 1, 4, 16), torch.randn(2, 1, 2, 16), torch.randn(2, 1, 2, 16)
    pool_k, pool_v = torch.randn(5, 32, 2, 16), torch.randn(5, 32, 2, 16)
    seqlens = torch.tensor([31, 5], dtype=torch.int32)

    def step(q, k_cache, v_cache, k, v, table):
        return volta_train.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens=seqlens,
                                                   block_table=table, causal=True)

    table = torch.tensor([[3, 1], [0, 4]], dtype=torch.int32)
    compiled = torch.compile(step, fullgraph=True)
    k1, v1, k2, v2 = pool_k.clone(), pool_v.clone(), pool_k.clone(), pool_v.clone()
    want = step(q, k1, v1, k, v, table)
    assert torch.equal(compiled(q, k2, v2, k, v, table), want)
    assert torch.equal(k1, k2) and torch.equal(v1, v2)
    assert torch.equal(k2[3, 31], k[0, 0]) and torch.equal(k2[0, 5], k[1, 0])  # pages 3 (row 31) and 0 (row 5)
    with pytest.raises(RuntimeError, match="block_table"):
        compiled(q, pool_k.clone(), pool_v.clone(), k, v, torch.tensor([[3, 1], [9, 4]], dtype=torch.int32))


# ---------------------------------------------------------------------------------------------------------
# v with its own head_dim (multi-head latent attention), attention sinks, head_dim up to 512
# ---------------------------------------------------------------------------------------------------------


def _eager_attention(q, k, v, causal, sinks=None):
    """float64 softmax attention with GQA, bottom-right causal mask and sink logits joining each denominator."""
    group = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        visible = torch.ones(sq, sk, dtype=torch.bool, device=scores.device).tril(sk - sq)
        scores = scores.masked_fill(~visible, float("-inf"))
    if sinks is not None:
        sink = sinks.double().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)
        probs = torch.softmax(torch.cat([scores, sink], -1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dims", [(24, 16), (16, 40), (512, 512), (192, 128)])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_value_head_dim_sinks_and_large_head_dims_match_eager(causal, dims, with_sinks):
    """v of its own head_dim, head_dim 512 (reference backend) and sinks: output and every gradient (sinks' too)
    equal a float64 softmax with the sinks in the denominator, dense and varlen."""
    head_dim, value_dim = dims
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 7, 4, head_dim, dtype=torch.float64, generator=generator, requires_grad=True)
    k = torch.randn(2, 9, 2, head_dim, dtype=torch.float64, generator=generator, requires_grad=True)
    v = torch.randn(2, 9, 2, value_dim, dtype=torch.float64, generator=generator, requires_grad=True)
    sinks = torch.randn(4, generator=generator).requires_grad_() if with_sinks else None
    inputs = (q, k, v) + ((sinks,) if with_sinks else ())
    expected = _eager_attention(q, k, v, causal, sinks)
    dout = torch.randn(expected.shape, dtype=torch.float64, generator=generator)
    want = torch.autograd.grad(expected, inputs, dout)
    out = volta_train.flash_attn_func(q, k, v, causal=causal, sinks=sinks)
    cu_q, cu_k = torch.tensor([0, 7, 14], dtype=torch.int32), torch.tensor([0, 9, 18], dtype=torch.int32)
    packed = volta_train.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu_q, cu_k, 7, 9,
                                                causal=causal, sinks=sinks).view(out.shape)
    for got in (out, packed):
        assert got.shape == expected.shape
        torch.testing.assert_close(got, expected)
        for g, w in zip(torch.autograd.grad(got, inputs, dout), want):
            torch.testing.assert_close(g, w, atol=1e-6 if g.dtype == torch.float32 else 1e-9, rtol=1e-5)
    if with_sinks:
        assert want[-1].abs().max() > 1e-3  # the sinks' gradient is not trivially zero


@pytest.mark.gpu
def test_head_dim_512_on_the_gpu_runs_the_reference_with_its_log(caplog, monkeypatch):
    """fp16 head_dim 512 on a GPU (Gemma 4's global layers): no refusal; the reference backend runs it, logged with
    the reason, forward and backward within fp16 rounding of float64."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setattr(dispatch, "_logged_reasons", set())
    generator = torch.Generator(device="cuda").manual_seed(11)
    q, k, v = (torch.randn(2, 37, heads, 512, device="cuda", generator=generator).half().requires_grad_()
               for heads in (4, 2, 2))
    with caplog.at_level(logging.INFO, logger="volta_train"):
        out = volta_train.flash_attn_func(q, k, v, causal=True)
    messages = " ".join(r.getMessage() for r in caplog.records)
    assert "reference" in messages and "head_dim 512" in messages
    dout = torch.randn(out.shape, device="cuda", generator=generator).half()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    expected = _eager_attention(q64, k64, v64, True, None)
    want = torch.autograd.grad(expected, (q64, k64, v64), dout.double())
    torch.testing.assert_close(out.double(), expected, rtol=1e-2, atol=1e-2)
    for g, w in zip(grads, want):
        torch.testing.assert_close(g.double(), w, rtol=2e-2, atol=2e-2)


def test_sinks_errors_name_the_argument():
    q = torch.randn(1, 3, 4, 8)
    with pytest.raises(TypeError, match="sinks must be float32"):
        volta_train.flash_attn_func(q, q, q, sinks=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"sinks has shape \(3,\); accepted: \(4,\)"):
        volta_train.flash_attn_func(q, q, q, sinks=torch.zeros(3))


def test_kernel_support_names_large_head_dims():
    from volta_train import kernels
    from volta_train.options import AttentionOptions

    options = AttentionOptions(softmax_scale=0.1)
    q = torch.empty(1, 4, 2, 64, device="meta")
    call = kernels.describe(q, q, q, options, varlen=False, alibi=False)
    assert "the Volta kernel needs a CUDA GPU" in kernels.unsupported_reason(call)  # device first
    cuda_call = dataclasses.replace(call, device=torch.device("cuda", 0), dtype=torch.float16, aligned=True)
    with mock.patch.object(torch.cuda, "get_device_capability", return_value=(7, 0)):
        wide = dataclasses.replace(cuda_call, value_head_dim=512)
        assert "head_dim 512: the Volta kernels run head_dim 1 to 256" in kernels.unsupported_reason(wide)
        mla = dataclasses.replace(cuda_call, head_dim=192, value_head_dim=128)
        assert mla.kernel_head_dim == 256
    assert volta_train.kernel_head_dim(192, 128) == 256 and volta_train.kernel_head_dim(512) is None


def test_sinks_on_rows_that_see_no_key():
    """More queries than keys, causal: the first rows see no key; with sinks they output 0, their lse is the sink's,
    and every gradient stays finite and equals float64 eager attention's (which gives those rows only the sink)."""
    generator = torch.Generator().manual_seed(11)
    q = torch.randn(1, 9, 2, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    k = torch.randn(1, 4, 2, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    v = torch.randn(1, 4, 2, 16, dtype=torch.float64, generator=generator, requires_grad=True)
    sinks = torch.randn(2, generator=generator).requires_grad_()
    out, lse, _ = volta_train.flash_attn_func(q, k, v, causal=True, sinks=sinks, return_attn_probs=True)
    assert not out[:, :5].any()  # rows 0-4 see no key
    assert torch.equal(lse[0, :, :5], sinks.detach().double().view(2, 1).expand(2, 5))
    expected = _eager_attention(q, k, v, True, sinks)
    torch.testing.assert_close(out[:, 5:], expected[:, 5:])
    dout = torch.randn(out.shape, dtype=torch.float64, generator=generator)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    assert all(torch.isfinite(g).all() for g in got)
    want = torch.autograd.grad(expected[:, 5:], (q, k, v, sinks), dout[:, 5:])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.to(g.dtype), atol=1e-6, rtol=1e-5)


def test_sinks_run_on_the_kernel_path(fake_kernel, rng):
    """The kernels compute attention without sinks and the dispatcher folds them in (volta_train/sinks.py); the
    backward runs on the kernels with the folded output and log-sum-exp."""
    q, k, v = _qkv(rng, 2, 11, 13, 4, 2, 32)
    sinks = torch.randn(4, generator=rng).requires_grad_()
    out = volta_train.flash_attn_func(q, k, v, causal=True, sinks=sinks)
    expected = _eager_attention(q, k, v, True, sinks)
    torch.testing.assert_close(out, expected)
    dout = torch.randn(out.shape, dtype=out.dtype, generator=rng)
    got = torch.autograd.grad(out, (q, k, v, sinks), dout)
    want = torch.autograd.grad(expected, (q, k, v, sinks), dout)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w.to(g.dtype), atol=1e-6, rtol=1e-5)
    assert [c[0] for c in fake_kernel] == ["forward", "backward"]


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_sinks_on_the_kernel_meet_the_standard(causal):
    """fp16 on the Volta kernels with sinks: output and gradients (the sinks' too) within twice PyTorch fp16's max-abs
    error against float64 eager attention with the sinks in the denominator."""
    generator = torch.Generator().manual_seed(21)
    q, k, v = (torch.randn(2, 300, h, 64, generator=generator) for h in (8, 2, 2))
    sinks = torch.randn(8, generator=generator)
    dout = torch.randn(2, 300, 8, 64, generator=generator)
    q64, k64, v64, s64 = (t.double().requires_grad_() for t in (q, k, v, sinks))
    truth = _eager_attention(q64, k64, v64, causal, s64)
    want = torch.autograd.grad(truth, (q64, k64, v64, s64), dout.double())
    q16, k16, v16 = (t.cuda().half().requires_grad_() for t in (q, k, v))
    s32 = sinks.cuda().requires_grad_()
    with mock.patch.dict("os.environ", {"VOLTA_TRAIN_BACKEND": "kernel"}):
        out = volta_train.flash_attn_func(q16, k16, v16, causal=causal, sinks=s32)
        got = torch.autograd.grad(out, (q16, k16, v16, s32), dout.cuda().half())
    # the yardstick: PyTorch fp16 attention with the sink as an extra column, same inputs
    qy, ky, vy = (t.cuda().half().requires_grad_() for t in (q, k, v))
    sy = sinks.cuda().half().requires_grad_()
    group = 4
    kr, vr = ky.repeat_interleave(group, 2), vy.repeat_interleave(group, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", qy, kr) * 64**-0.5
    if causal:
        scores = scores.masked_fill(~torch.ones(300, 300, dtype=torch.bool, device="cuda").tril(), float("-inf"))
    cat = torch.cat([scores, sy.view(1, -1, 1, 1).expand(2, 8, 300, 1)], -1)
    yard = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(cat.float(), -1).half()[..., :-1], vr)
    yard_grads = torch.autograd.grad(yard, (qy, ky, vy, sy), dout.cuda().half())
    for name, g, y, w in zip(("out", "dq", "dk", "dv", "dsinks"), (out,) + got, (yard,) + yard_grads,
                             (truth,) + want):
        err = (g.double().cpu() - w.detach()).abs().max().item()
        bound = 2 * (y.double().cpu() - w.detach()).abs().max().item() + 2**-14 * w.abs().max().item()
        assert err <= bound, f"{name}: {err:.3g} > {bound:.3g}"


@pytest.mark.gpu
@pytest.mark.parametrize("dims", [(192, 128), (24, 16), (64, 128)])
@pytest.mark.parametrize("varlen", [False, True])
def test_value_head_dim_runs_on_the_kernel(dims, varlen, monkeypatch):
    """On a GPU the kernels run a v of its own head_dim (zero-padded with q/k to one kernel head_dim); fp16 output
    and gradients as close to float64 as the reference backend's fp16 run."""
    monkeypatch.setenv("VOLTA_TRAIN_BACKEND", "kernel")  # raises if the kernels cannot run the call
    head_dim, value_dim = dims
    generator = torch.Generator().manual_seed(4)
    q = torch.randn(2, 130, 8, head_dim, generator=generator).cuda().half().requires_grad_()
    k = torch.randn(2, 130, 2, head_dim, generator=generator).cuda().half().requires_grad_()
    v = torch.randn(2, 130, 2, value_dim, generator=generator).cuda().half().requires_grad_()
    dout = torch.randn(2, 130, 8, value_dim, generator=generator).cuda().half()
    if varlen:
        cu = torch.tensor([0, 130, 260], dtype=torch.int32, device="cuda")
        out = volta_train.flash_attn_varlen_func(q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1), cu, cu, 130,
                                                 130, causal=True).view(2, 130, 8, value_dim)
    else:
        out = volta_train.flash_attn_func(q, k, v, causal=True)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    expected = _eager_attention(q.detach().double(), k.detach().double(), v.detach().double(), True)
    torch.testing.assert_close(out.double(), expected, atol=2e-3, rtol=2e-3)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    want = torch.autograd.grad(_eager_attention(qd, kd, vd, True), (qd, kd, vd), dout.double())
    for g, w in zip(grads, want):
        assert g.shape == w.shape
        torch.testing.assert_close(g.double(), w, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_pad_input_checks_indices_without_waiting_for_the_gpu(rng):
    """pad_input runs once per attention layer of a padded batch: its index check must not read the GPU's values."""
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool, device="cuda")
    x = _randn(2, 3, 2, 8, rng=rng).cuda()
    x_unpad, indices, *_ = volta_train.unpad_input(x, mask)
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = volta_train.pad_input(x_unpad, indices, 2, 3)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert torch.equal(out[mask], x[mask]) and not out[~mask].any()
