"""return_attn_probs=True: S_dmask as flash-attn 2.8.3 returns it, checked against float64 softmaxes written here, the
Philox mask, and the output rebuilt from it the way flash-attn's own tests rebuild theirs; gpu-marked tests at the end
run the kernel path."""

from __future__ import annotations

import math

import pytest
import torch

import volta_train
from volta_train import attn_probs, flash_attn_compat, philox
from volta_train.validation import MAX_HEAD_DIM


def _round128(n):
    return (n + 127) // 128 * 128


def _fixed_philox(monkeypatch, rng):
    """Makes every dropout call use one random (seed, offset), returned, so the test can evaluate the mask itself."""
    seed = int(torch.randint(0, 2**62, (), generator=rng)) * 3 + 1  # high bits set too
    offset = int(torch.randint(0, 2**40, (), generator=rng)) * 4
    monkeypatch.setattr(philox, "draw_seed_offset", lambda device: (seed, offset))
    return seed, offset


def _scores64(q, k, scale, causal=False, window=(-1, -1), softcap=0.0, slopes=None):
    """float64 [B, H, Nq, Nk] scores of dense q [B, Nq, H, D], k [B, Nk, Hkv, D]: -inf where hidden, written plainly."""
    q, k = q.double(), k.double()
    heads, heads_kv = q.shape[2], k.shape[2]
    k = k.repeat_interleave(heads // heads_kv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    sq, sk = q.shape[1], k.shape[1]
    i = torch.arange(sq).view(-1, 1)
    j = torch.arange(sk).view(1, -1)
    diag = i + sk - sq
    if slopes is not None:
        s = s - slopes.double().reshape(-1, heads, 1, 1) * (diag - j).abs()  # [H] or [B, H] slopes
    left, right = window
    if causal:
        right = 0
    visible = torch.ones(sq, sk, dtype=torch.bool)
    if right >= 0:
        visible &= j <= diag + right
    if left >= 0:
        visible &= j >= diag - left
    return s.masked_fill(~visible, float("-inf"))


def _block_running_max(s, block):
    """flash-attn's m_i(J): the max of row i over key blocks J, J+1, ... (its forward walks the blocks last to first)."""
    block_max = torch.stack([t.amax(dim=-1) for t in s.split(block, dim=-1)], dim=-1)
    return block_max.flip(-1).cummax(dim=-1).values.flip(-1)  # [B, H, Nq, blocks]


def _softmax64(s):
    """float64 softmax; rows that see no key are 0."""
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)
    return torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)


def _normalize(s_dmask, scores, lse, block):
    """flash-attn's normalize_flash_attn_S, rewritten: |S_dmask| block J times exp(m_i(J) - lse_i), with our lse."""
    m = _block_running_max(scores, block)
    factors = torch.exp(m - lse.double().unsqueeze(-1))  # -inf - inf = -inf on rows that see no key: factor 0
    return torch.cat([a.abs().double() * f.unsqueeze(-1) for a, f in zip(s_dmask.split(block, -1), factors.unbind(-1))],
                     dim=-1)


def _keep(seed, offset, p, batch_index, heads, sq, sk):
    bh = (torch.as_tensor(batch_index).view(-1, 1) * heads + torch.arange(heads).view(1, -1)).reshape(-1)
    keep = philox.dropout_keep_mask(seed, offset, p, bh, torch.arange(sq), torch.arange(sk))
    return keep.view(-1, heads, sq, sk)


def _case(rng, b, sq, sk, h, hk, d, dtype=torch.float64):
    q = torch.randn(b, sq, h, d, generator=rng, dtype=torch.float64).to(dtype)
    k = torch.randn(b, sk, hk, d, generator=rng, dtype=torch.float64).to(dtype)
    v = torch.randn(b, sk, hk, d, generator=rng, dtype=torch.float64).to(dtype)
    return q, k, v


MASKS = [
    dict(),
    dict(causal=True),
    dict(window_size=(37, 5)),
    dict(causal=True, window_size=(20, -1)),
    dict(softcap=3.0),
    dict(alibi=True),
    dict(alibi=True, causal=True),
]


@pytest.mark.parametrize("mask", MASKS, ids=lambda m: "-".join(f"{k}" for k in m) or "none")
@pytest.mark.parametrize("sq, sk", [(77, 301), (130, 45), (1, 129)])
def test_dense_s_dmask_is_flash_attn_s_dmask(mask, sq, sk, rng, monkeypatch):
    """Shape, padding, values against float64, the dropout mask against Philox and the output rebuilt from S_dmask."""
    seed, offset = _fixed_philox(monkeypatch, rng)
    b, h, hk, d, p = 2, 4, 2, 24, 0.23
    q, k, v = _case(rng, b, sq, sk, h, hk, d)
    slopes = torch.rand(b, h, generator=rng) * 0.3 if mask.get("alibi") else None
    kwargs = {key: val for key, val in mask.items() if key != "alibi"}
    out, lse, s_dmask = volta_train.flash_attn_func(q, k, v, p, alibi_slopes=slopes, return_attn_probs=True, **kwargs)

    assert s_dmask.shape == (b, h, _round128(sq), _round128(sk)) and s_dmask.dtype == q.dtype
    padding = torch.ones_like(s_dmask, dtype=torch.bool)
    padding[:, :, :sq, :sk] = False
    assert (s_dmask[padding] == 0).all() and not torch.signbit(s_dmask[padding]).any()
    s = s_dmask[:, :, :sq, :sk]
    # the sign bit is the dropout mask, everywhere (masked elements carry -0.0 where dropped)
    keep = _keep(seed, offset, p, torch.arange(b), h, sq, sk)
    assert torch.equal(~torch.signbit(s), keep)
    # values: exp(s_ij - m_i(J)) with flash-attn's running max over _get_block_size_n blocks
    block = attn_probs.get_block_size_n(q.device, d, True, bool(mask.get("causal")))
    scores = _scores64(q, k, d**-0.5, kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)),
                       kwargs.get("softcap", 0.0), slopes)
    m = _block_running_max(scores, block).repeat_interleave(block, dim=-1)[..., :sk]
    expected = torch.exp(scores - torch.where(torch.isneginf(m), torch.zeros_like(m), m))
    torch.testing.assert_close(s.abs(), expected, rtol=1e-9, atol=1e-12)
    # normalised with the returned lse they are the float64 softmax (rows that see no key: 0)
    probs = _normalize(s, scores, lse, block)
    torch.testing.assert_close(probs, _softmax64(scores), rtol=1e-9, atol=1e-12)
    # flash-attn's tests: dropout_mask = S_dmask >= 0, then out = (P * mask / (1 - p)) @ v
    rebuilt = torch.einsum("bhij,bjhd->bihd", probs * (s >= 0) / (1 - p), v.repeat_interleave(h // hk, dim=2))
    torch.testing.assert_close(out, rebuilt, rtol=1e-7, atol=1e-9)


def test_rows_that_see_no_key_are_zero_and_keep_their_dropout_bits(rng, monkeypatch):
    seed, offset = _fixed_philox(monkeypatch, rng)
    q, k, v = _case(rng, 1, 50, 20, 2, 2, 16)
    out, lse, s_dmask = volta_train.flash_attn_func(q, k, v, 0.4, causal=True, return_attn_probs=True)
    blind = slice(0, 30)  # bottom-right causal: queries 0..29 see no key
    assert (out[:, blind] == 0).all() and torch.isinf(lse[..., blind]).all()
    assert (s_dmask[:, :, blind] == 0).all()
    assert torch.equal(~torch.signbit(s_dmask[:, :, :50, :20]), _keep(seed, offset, 0.4, [0], 2, 50, 20))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_s_dmask_rebuilds_the_output(dtype, rng, monkeypatch):
    """In q's dtype, as flash-attn returns it: the rebuilt output agrees to that dtype's rounding."""
    seed, offset = _fixed_philox(monkeypatch, rng)
    b, sq, sk, h, d, p = 2, 65, 200, 3, 40, 0.17
    q, k, v = _case(rng, b, sq, sk, h, h, d, dtype)
    out, lse, s_dmask = volta_train.flash_attn_func(q, k, v, p, causal=True, return_attn_probs=True)
    assert s_dmask.dtype == dtype and lse.dtype == torch.float32
    s = s_dmask[:, :, :sq, :sk]
    assert torch.equal(~torch.signbit(s), _keep(seed, offset, p, torch.arange(b), h, sq, sk))
    scores = _scores64(q, k, d**-0.5, causal=True)
    probs = _normalize(s, scores, lse, attn_probs.BLOCK_N)
    rebuilt = torch.einsum("bhij,bjhd->bihd", probs * (s >= 0) / (1 - p), v.double())
    tol = {torch.float16: 2e-3, torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.double(), rebuilt, rtol=tol, atol=tol)


@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window_size=(9, 3)), dict(alibi=True)],
                         ids=lambda m: "-".join(m) or "none")
def test_varlen_s_dmask_is_flash_attn_s_dmask(mask, rng, monkeypatch):
    """[batch, heads, round128(max_seqlen_q), round128(max_seqlen_k)]; sequence b at [b, :, :len_q, :len_k] with the
    dense dropout mask of batch entry b; empty sequences and the rest are 0."""
    seed, offset = _fixed_philox(monkeypatch, rng)
    lengths_q, lengths_k = [13, 0, 140, 7, 30], [29, 11, 150, 0, 1]
    h, hk, d, p = 4, 1, 20, 0.3
    cu_q = torch.tensor([0] + lengths_q).cumsum(0).to(torch.int32)
    cu_k = torch.tensor([0] + lengths_k).cumsum(0).to(torch.int32)
    q = torch.randn(sum(lengths_q), h, d, generator=rng, dtype=torch.float64)
    k = torch.randn(sum(lengths_k), hk, d, generator=rng, dtype=torch.float64)
    v = torch.randn(sum(lengths_k), hk, d, generator=rng, dtype=torch.float64)
    slopes = torch.rand(len(lengths_q), h, generator=rng) * 0.3 if mask.get("alibi") else None
    kwargs = {key: val for key, val in mask.items() if key != "alibi"}
    max_q, max_k = max(lengths_q) + 3, max(lengths_k)  # max_seqlen may exceed every length
    out, lse, s_dmask = volta_train.flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, p, alibi_slopes=slopes,
                                                           return_attn_probs=True, **kwargs)
    assert s_dmask.shape == (len(lengths_q), h, _round128(max_q), _round128(max_k))
    for b, (lq, lk) in enumerate(zip(lengths_q, lengths_k)):
        rest = s_dmask[b].clone()
        rest[:, :lq, :lk] = 0
        assert (rest == 0).all() and not torch.signbit(rest).any()
        if lq == 0 or lk == 0:
            continue
        q0, k0 = int(cu_q[b]), int(cu_k[b])
        qb, kb, vb = q[None, q0 : q0 + lq], k[None, k0 : k0 + lk], v[None, k0 : k0 + lk]
        s = s_dmask[b : b + 1, :, :lq, :lk]
        assert torch.equal(~torch.signbit(s), _keep(seed, offset, p, [b], h, lq, lk))
        scores = _scores64(qb, kb, d**-0.5, kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)),
                           slopes=None if slopes is None else slopes[b : b + 1])
        probs = _normalize(s, scores, lse[None, :, q0 : q0 + lq], attn_probs.BLOCK_N)
        torch.testing.assert_close(probs, _softmax64(scores), rtol=1e-9, atol=1e-12)
        rebuilt = torch.einsum("bhij,bjhd->bihd", probs * (s >= 0) / (1 - p), vb.repeat_interleave(h // hk, dim=2))
        torch.testing.assert_close(out[None, q0 : q0 + lq], rebuilt, rtol=1e-7, atol=1e-9)


def test_without_dropout_s_dmask_is_empty_as_in_flash_attn(rng):
    q, k, v = _case(rng, 2, 9, 11, 2, 2, 8, torch.float32)
    for call in (
        lambda: volta_train.flash_attn_func(q, k, v, return_attn_probs=True),
        lambda: volta_train.flash_attn_qkvpacked_func(torch.stack((q, q, q), dim=2), return_attn_probs=True),
        lambda: volta_train.flash_attn_kvpacked_func(q, torch.stack((k, v), dim=2), return_attn_probs=True),
    ):
        _, _, s_dmask = call()
        assert s_dmask.shape == (0,) and s_dmask.dtype == q.dtype
    cu = torch.tensor([0, 4, 9], dtype=torch.int32)
    _, _, s_dmask = volta_train.flash_attn_varlen_func(q[0], k[0, :9], v[0, :9], cu, cu, 5, 5, return_attn_probs=True)
    assert s_dmask.shape == (0,)


def test_packed_variants_return_the_same_s_dmask(rng, monkeypatch):
    _fixed_philox(monkeypatch, rng)
    q, k, v = _case(rng, 2, 33, 33, 2, 2, 8)
    qkv = torch.stack((q, k, v), dim=2)
    _, _, plain = volta_train.flash_attn_func(q, k, v, 0.2, return_attn_probs=True)
    _, _, packed = volta_train.flash_attn_qkvpacked_func(qkv, 0.2, return_attn_probs=True)
    _, _, kvpacked = volta_train.flash_attn_kvpacked_func(q, qkv[:, :, 1:], 0.2, return_attn_probs=True)
    assert torch.equal(plain, packed) and torch.equal(plain, kvpacked)
    cu = torch.tensor([0, 33, 66], dtype=torch.int32)
    _, _, varlen = volta_train.flash_attn_varlen_qkvpacked_func(qkv.flatten(0, 1), cu, 33, 0.2, return_attn_probs=True)
    # sequence b's mask is batch entry b's; the values may differ in the last bit (other matmul shapes)
    assert torch.equal(torch.signbit(varlen), torch.signbit(plain))
    torch.testing.assert_close(varlen, plain, rtol=1e-12, atol=0)


def test_gradients_still_flow_and_s_dmask_has_none(rng):
    q, k, v = (t.requires_grad_() for t in _case(rng, 1, 16, 16, 2, 2, 8))
    out, lse, s_dmask = volta_train.flash_attn_func(q, k, v, 0.1, return_attn_probs=True)
    assert not s_dmask.requires_grad
    out.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (q, k, v))


def test_empty_and_degenerate_shapes(rng, monkeypatch):
    _fixed_philox(monkeypatch, rng)
    q, k, v = _case(rng, 2, 5, 0, 2, 2, 8)
    out, lse, s_dmask = volta_train.flash_attn_func(q, k, v, 0.5, return_attn_probs=True)
    assert s_dmask.shape == (2, 2, 128, 0)
    q, k, v = _case(rng, 0, 5, 7, 2, 2, 8)
    assert volta_train.flash_attn_func(q, k, v, 0.5, return_attn_probs=True)[2].shape == (0, 2, 128, 128)


def test_get_block_size_n_is_served_and_checks_head_dim():
    flash_attn = volta_train.install_flash_attn()
    try:
        from flash_attn.flash_attn_interface import _get_block_size_n

        assert _get_block_size_n is attn_probs.get_block_size_n
        for args in (("cpu", 1, True, False), (torch.device("cpu"), 256, False, True), (None, 59, True, True)):
            assert _get_block_size_n(*args) == attn_probs.BLOCK_N
        with pytest.raises(ValueError, match=f"head_dim is {MAX_HEAD_DIM + 1}; accepted: 1 to {MAX_HEAD_DIM}"):
            _get_block_size_n("cpu", MAX_HEAD_DIM + 1, True, False)
        with pytest.raises(TypeError, match="head_dim"):
            _get_block_size_n("cpu", 64.0, True, False)
        assert not hasattr(flash_attn, "_get_block_size_n")  # flash-attn's package does not export it either
    finally:
        flash_attn_compat.uninstall_flash_attn()


# ---------------------------------------------------------------------------------------------------------------
# GPU: the kernel's dropout is the one S_dmask reports
# ---------------------------------------------------------------------------------------------------------------


def _gpu_call(backend, monkeypatch, fn, *args, **kwargs):
    monkeypatch.setenv("VOLTA_TRAIN_BACKEND", backend)
    torch.manual_seed(1234)  # the same Philox seed and offset for both backends
    return fn(*args, **kwargs)


@pytest.mark.gpu
@pytest.mark.parametrize("mask", [dict(), dict(causal=True), dict(window_size=(50, 20)), dict(alibi=True)],
                         ids=lambda m: "-".join(m) or "none")
@pytest.mark.parametrize("sq, sk, h, hk, d", [(113, 203, 4, 2, 64), (256, 129, 2, 2, 128), (77, 77, 3, 1, 40)])
def test_gpu_kernel_s_dmask_equals_reference_and_rebuilds_kernel_output(mask, sq, sk, h, hk, d, monkeypatch):
    torch.manual_seed(0)
    b, p = 2, 0.17
    q = torch.randn(b, sq, h, d, device="cuda", dtype=torch.float16)
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.float16)
    v = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.float16)
    slopes = torch.rand(b, h, device="cuda") * 0.3 if mask.get("alibi") else None
    kwargs = {key: val for key, val in mask.items() if key != "alibi"}
    out, lse, s_dmask = _gpu_call("kernel", monkeypatch, volta_train.flash_attn_func, q, k, v, p,
                                  alibi_slopes=slopes, return_attn_probs=True, **kwargs)
    out_ref, lse_ref, s_ref = _gpu_call("reference", monkeypatch, volta_train.flash_attn_func, q, k, v, p,
                                        alibi_slopes=slopes, return_attn_probs=True, **kwargs)
    assert torch.equal(s_dmask, s_ref)
    s = s_dmask[:, :, :sq, :sk].cpu()
    scores = _scores64(q.cpu(), k.cpu(), d**-0.5, kwargs.get("causal", False), kwargs.get("window_size", (-1, -1)),
                       slopes=None if slopes is None else slopes.cpu())
    probs = _normalize(s, scores, lse.cpu(), attn_probs.BLOCK_N)
    vr = v.cpu().double().repeat_interleave(h // hk, dim=2)
    rebuilt = torch.einsum("bhij,bjhd->bihd", probs * (s >= 0) / (1 - p), vr)
    # the kernel's output against the output its reported mask implies: fp16 rounding, no dropout disagreement
    torch.testing.assert_close(out.cpu().double(), rebuilt, rtol=5e-3, atol=5e-3)
    torch.testing.assert_close(out.cpu().double(), out_ref.cpu().double(), rtol=5e-3, atol=5e-3)


@pytest.mark.gpu
def test_gpu_varlen_kernel_s_dmask_rebuilds_kernel_output(monkeypatch):
    torch.manual_seed(0)
    lengths, h, d, p = [70, 1, 200, 33], 4, 64, 0.25
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    q, k, v = (torch.randn(sum(lengths), h, d, device="cuda", dtype=torch.float16) for _ in range(3))
    out, lse, s_dmask = _gpu_call("kernel", monkeypatch, volta_train.flash_attn_varlen_func, q, k, v, cu, cu,
                                  max(lengths), max(lengths), p, causal=True, return_attn_probs=True)
    _, _, s_ref = _gpu_call("reference", monkeypatch, volta_train.flash_attn_varlen_func, q, k, v, cu, cu,
                            max(lengths), max(lengths), p, causal=True, return_attn_probs=True)
    assert torch.equal(s_dmask, s_ref)
    for b, n in enumerate(lengths):
        t0 = int(cu[b])
        s = s_dmask[b : b + 1, :, :n, :n].cpu()
        qb, kb, vb = (t[None, t0 : t0 + n].cpu() for t in (q, k, v))
        scores = _scores64(qb, kb, d**-0.5, causal=True)
        probs = _normalize(s, scores, lse[None, :, t0 : t0 + n].cpu(), attn_probs.BLOCK_N)
        rebuilt = torch.einsum("bhij,bjhd->bihd", probs * (s >= 0) / (1 - p), vb.double())
        torch.testing.assert_close(out[None, t0 : t0 + n].cpu().double(), rebuilt, rtol=5e-3, atol=5e-3)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_kernel_output_shows_the_s_dmask_dropout_mask_element_by_element(causal, monkeypatch):
    """v one-hot over the keys makes out[i, h, j] = P_ij * keep_ij / (1 - p): the kernel's own dropout decisions, read
    off its output, equal the signs of S_dmask on every visible element (a rebuild within tolerance could miss one)."""
    torch.manual_seed(0)
    b, sq, sk, h, hk, d, p = 2, 77, 120, 4, 2, 128, 0.3
    q = (torch.randn(b, sq, h, d, device="cuda") * 0.1).half()  # near-uniform P: every visible element well above 0
    k = torch.randn(b, sk, hk, d, device="cuda", dtype=torch.float16)
    v = torch.eye(sk, d, device="cuda", dtype=torch.float16).view(1, sk, 1, d).expand(b, sk, hk, d).contiguous()
    out, _, s_dmask = _gpu_call("kernel", monkeypatch, volta_train.flash_attn_func, q, k, v, p, causal=causal,
                                return_attn_probs=True)
    kernel_kept = (out.permute(0, 2, 1, 3)[..., :sk] != 0).cpu()
    visible = torch.isfinite(_scores64(q.cpu(), k.cpu(), d**-0.5, causal=causal))
    reported_kept = ~torch.signbit(s_dmask[:, :, :sq, :sk]).cpu()
    assert torch.equal(kernel_kept, reported_kept & visible)
