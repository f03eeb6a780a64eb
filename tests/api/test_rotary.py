"""flash_attn.layers.rotary.apply_rotary_emb (volta_train/rotary.py) against a float64 rotation written plainly here:
interleaved or not, partial rotary_dim, int and per-batch offsets, varlen, in place, gradients, argument errors."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

import volta_train
from volta_train import flash_attn_compat, rotary
from volta_train.rotary import apply_rotary_emb


def _cos_sin(seqlen_ro, rotary_dim, dtype=torch.float32):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, rotary_dim, 2, dtype=torch.float64) / rotary_dim))
    angles = torch.arange(seqlen_ro, dtype=torch.float64).view(-1, 1) * inv_freq.view(1, -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def _reference(x, cos, sin, positions, interleaved):
    """float64 rotation of x [..., H, D] at positions (x.shape[:-2]; outside [0, seqlen_ro): unrotated), pair by pair."""
    x = x.double()
    cos, sin = cos.double(), sin.double()
    half = cos.shape[1]
    out = x.clone()
    for i in range(half):
        a, b = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
        for index in itertools.product(*(range(n) for n in positions.shape)):
            pos = int(positions[index])
            if not 0 <= pos < cos.shape[0]:
                continue
            c, s = cos[pos, i], sin[pos, i]
            xa, xb = x[index][..., a], x[index][..., b]
            out[index][..., a] = xa * c - xb * s
            out[index][..., b] = xa * s + xb * c
    return out


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dim, head_dim", [(16, 16), (8, 22), (2, 3)])
@pytest.mark.parametrize("offsets", ["zero", "int", "tensor"])
def test_dense_matches_float64(interleaved, rotary_dim, head_dim, offsets, rng):
    b, n, h, seqlen_ro = 3, 7, 2, 12
    x = torch.randn(b, n, h, head_dim, generator=rng, dtype=torch.float64)
    cos, sin = _cos_sin(seqlen_ro, rotary_dim, torch.float64)
    if offsets == "zero":
        seqlen_offsets, base = 0, torch.zeros(b, 1, dtype=torch.long)
    elif offsets == "int":
        seqlen_offsets, base = 5, torch.full((b, 1), 5)
    else:  # per batch, one entry running past seqlen_ro and one negative: those positions stay unrotated
        seqlen_offsets = torch.tensor([3, 9, -2], dtype=torch.int32)
        base = seqlen_offsets.long().view(-1, 1)
    positions = base + torch.arange(n).view(1, -1)
    out = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=seqlen_offsets)
    torch.testing.assert_close(out, _reference(x, cos, sin, positions, interleaved), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("tensor_offsets", [False, True])
def test_varlen_matches_float64(interleaved, tensor_offsets, rng):
    lengths, h, d, rotary_dim = [4, 0, 9, 1], 3, 10, 6
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    total = sum(lengths) + 2  # two packed tokens after the last sequence: left as they are
    x = torch.randn(total, h, d, generator=rng, dtype=torch.float64)
    cos, sin = _cos_sin(20, rotary_dim, torch.float64)
    offsets = torch.tensor([2, 7, 11, 0]) if tensor_offsets else 3
    positions = torch.full((total,), -1)
    for seq, n in enumerate(lengths):
        start = int(cu[seq])
        shift = int(offsets[seq]) if tensor_offsets else offsets
        positions[start : start + n] = torch.arange(n) + shift
    out = apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets, cu_seqlens=cu, max_seqlen=max(lengths))
    torch.testing.assert_close(out, _reference(x, cos, sin, positions, interleaved), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("cos_dtype", [torch.float32, torch.float16])
def test_low_precision_rounds_once(dtype, cos_dtype, rng):
    """fp16/bf16: computed in fp32 and rounded once, within one rounding step of the float64 rotation (of the same
    cos/sin). fp32: the products and the sum each round in fp32, so within a few fp32 steps of the largest term."""
    x = torch.randn(2, 33, 4, 64, generator=rng).to(dtype)
    cos, sin = _cos_sin(40, 32, cos_dtype)
    out = apply_rotary_emb(x, cos, sin, seqlen_offsets=torch.tensor([0, 7]))
    assert out.dtype == dtype
    expected = _reference(x, cos, sin, torch.tensor([0, 7]).view(-1, 1) + torch.arange(33).view(1, -1), False)
    eps = torch.finfo(dtype).eps
    # three fp32 roundings of terms of at most |x| * (|cos| + |sin|) <= sqrt(2) |x|
    atol = 3 * eps * x.abs().max().item() if dtype == torch.float32 else eps
    torch.testing.assert_close(out.double(), expected, rtol=eps, atol=atol)


@pytest.mark.parametrize("interleaved", [False, True])
def test_gradient_is_the_inverse_rotation(interleaved, rng):
    x = torch.randn(2, 5, 2, 12, generator=rng, dtype=torch.float64, requires_grad=True)
    cos, sin = _cos_sin(9, 8, torch.float64)
    offsets = torch.tensor([1, 4])
    assert torch.autograd.gradcheck(lambda t: apply_rotary_emb(t, cos, sin, interleaved, seqlen_offsets=offsets), (x,))
    # the rotation is orthogonal: the gradient of <out, g> is g rotated back
    g = torch.randn(x.shape, generator=rng, dtype=torch.float64)
    (grad,) = torch.autograd.grad(apply_rotary_emb(x, cos, sin, interleaved, seqlen_offsets=offsets), x, g)
    assert math.isclose(grad.norm().item(), g.norm().item(), rel_tol=1e-12)
    cos_v, sin_v = cos.clone().requires_grad_(), sin.clone().requires_grad_()
    (grad_x,) = torch.autograd.grad(apply_rotary_emb(x, cos_v, sin_v, interleaved).sum(), x)  # cos/sin: no gradient
    assert grad_x.shape == x.shape


def test_varlen_gradient(rng):
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    x = torch.randn(8, 2, 6, generator=rng, dtype=torch.float64, requires_grad=True)
    cos, sin = _cos_sin(10, 6, torch.float64)
    fn = lambda t: apply_rotary_emb(t, cos, sin, True, seqlen_offsets=torch.tensor([2, 0]), cu_seqlens=cu, max_seqlen=5)
    assert torch.autograd.gradcheck(fn, (x,))


def test_inplace_writes_x_and_keeps_gradients(rng):
    x = torch.randn(2, 6, 3, 10, generator=rng, dtype=torch.float64, requires_grad=True)
    cos, sin = _cos_sin(8, 6, torch.float64)
    expected = apply_rotary_emb(x, cos, sin, seqlen_offsets=2)
    g = torch.randn(x.shape, generator=rng, dtype=torch.float64)
    (grad_expected,) = torch.autograd.grad(expected, x, g)

    y = x * 1.0  # a non-leaf, as qkv out of a projection is
    out = apply_rotary_emb(y, cos, sin, inplace=True, seqlen_offsets=2)
    assert out is y
    torch.testing.assert_close(y, expected, rtol=0, atol=0)
    (grad,) = torch.autograd.grad(out, x, g)
    torch.testing.assert_close(grad, grad_expected, rtol=0, atol=0)

    # a strided view of a packed qkv, rotated in place: only that slice changes
    qkv = torch.randn(2, 6, 3, 3, 10, generator=rng, dtype=torch.float64)
    before = qkv.clone()
    apply_rotary_emb(qkv[:, :, 0], cos, sin, inplace=True)
    torch.testing.assert_close(qkv[:, :, 0], apply_rotary_emb(before[:, :, 0], cos, sin), rtol=0, atol=0)
    assert torch.equal(qkv[:, :, 1:], before[:, :, 1:])


def test_kvcache_appends_keys_rotated_as_apply_rotary_emb_rotates_them(rng):
    """flash_attn_with_kvcache's rotary (kvcache.append -> rotary.rotate_at) and apply_rotary_emb agree bit for bit,
    as flash-attn's own kvcache tests assume."""
    b, n_new, hk, d, rotary_dim = 2, 3, 2, 16, 8
    k_cache = torch.zeros(b, 20, hk, d)
    v_cache = torch.zeros(b, 20, hk, d)
    q = torch.randn(b, n_new, 4, d, generator=rng)
    k = torch.randn(b, n_new, hk, d, generator=rng)
    v = torch.randn(b, n_new, hk, d, generator=rng)
    cache_seqlens = torch.tensor([4, 11], dtype=torch.int32)
    cos, sin = _cos_sin(20, rotary_dim)
    for interleaved in (False, True):
        volta_train.flash_attn_with_kvcache(q, k_cache, v_cache, k, v, cos, sin, cache_seqlens, causal=True,
                                            rotary_interleaved=interleaved)
        k_rot = apply_rotary_emb(k, cos, sin, interleaved, seqlen_offsets=cache_seqlens)
        for entry, start in enumerate(cache_seqlens.tolist()):
            assert torch.equal(k_cache[entry, start : start + n_new], k_rot[entry])


@pytest.mark.parametrize(
    "call, error, words",
    [
        (lambda x, c, s: apply_rotary_emb(x[0], c, s), ValueError, "x has shape"),
        (lambda x, c, s: apply_rotary_emb(x, torch.zeros(12, 9), torch.zeros(12, 9)), ValueError, "rotary_dim = 2 \\* cos.shape\\[1\\] = 18"),
        (lambda x, c, s: apply_rotary_emb(x, c, s[:, :2]), ValueError, "cos/sin have shapes"),
        (lambda x, c, s: apply_rotary_emb(x, c[:4], s[:4]), ValueError, "seqlen_ro >= seqlen"),
        (lambda x, c, s: apply_rotary_emb(x, c, s, seqlen_offsets=5), ValueError, "0 <= seqlen_offsets <= seqlen_ro"),
        (lambda x, c, s: apply_rotary_emb(x, c, s, seqlen_offsets=-1), ValueError, "seqlen_offsets is -1"),
        (lambda x, c, s: apply_rotary_emb(x, c, s, seqlen_offsets=1.0), TypeError, "seqlen_offsets is 1.0"),
        (lambda x, c, s: apply_rotary_emb(x, c, s, seqlen_offsets=torch.zeros(3, dtype=torch.int32)), ValueError,
         "seqlen_offsets has shape \\(3,\\)"),
        (lambda x, c, s: apply_rotary_emb(x, c, s, seqlen_offsets=torch.zeros(2)), ValueError, "int32 or int64"),
        (lambda x, c, s: apply_rotary_emb(x[0], c, s, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32)), ValueError,
         "max_seqlen is None"),
        (lambda x, c, s: apply_rotary_emb(x[0], c, s, cu_seqlens=torch.tensor([0.0, 8.0]), max_seqlen=8), ValueError,
         "cu_seqlens has shape"),
        (lambda x, c, s: apply_rotary_emb(x.long(), c, s), TypeError, "x has dtype"),
        (lambda x, c, s: apply_rotary_emb(x, c.numpy(), s), TypeError, "cos must be a torch.Tensor"),
    ],
)
def test_errors_name_the_argument(call, error, words):
    x = torch.zeros(2, 8, 2, 16)
    cos, sin = _cos_sin(12, 8)
    with pytest.raises(error, match=words):
        call(x, cos, sin)


def test_served_as_flash_attn_layers_rotary():
    volta_train.install_flash_attn()
    try:
        from flash_attn.layers.rotary import apply_rotary_emb as served
        import flash_attn.layers

        assert served is rotary.apply_rotary_emb and flash_attn.layers.rotary.apply_rotary_emb_func is served
    finally:
        flash_attn_compat.uninstall_flash_attn()
    import sys

    assert "flash_attn.layers.rotary" not in sys.modules and "flash_attn.layers" not in sys.modules
