"""Dropout: Philox known answers, the mask as a pure function of (seed, offset, batch, head, row, col)."""

from __future__ import annotations

import math

import pytest
import torch

import volta_train
from volta_train import philox
from volta_train.options import to_int64
from volta_train.options import AttentionOptions
from volta_train.reference import reference_backward, reference_forward
from oracles import FLOAT64_ATOL, FLOAT64_RTOL, naive_attention


@pytest.mark.parametrize(
    "counter, key, expected",
    [  # Random123's known-answer vectors for philox4x32-10
        ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF, 0xFFFFFFFF), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
        (
            (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
            (0xA4093822, 0x299F31D0),
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
        ),
    ],
)
def test_philox_known_answers(counter, key, expected):
    words = philox.philox4x32_10(tuple(torch.tensor([c], dtype=torch.int64) for c in counter), key)
    assert tuple(int(w) for w in words) == expected


def _full_mask(seed, offset, p, batch, heads, sq, sk):
    bh = torch.arange(batch * heads)
    keep = philox.dropout_keep_mask(seed, offset, p, bh, torch.arange(sq), torch.arange(sk))
    return keep.view(batch, heads, sq, sk)


def test_mask_is_pure_function_of_coordinates():
    seed, offset, p = 0x1234_5678_9ABC_DEF1, 8, 0.3
    full = _full_mask(seed, offset, p, 2, 3, 19, 45)
    # any sub-rectangle, computed on its own, equals the same slice of the full mask
    part = philox.dropout_keep_mask(seed, offset, p, torch.tensor([4]), torch.arange(5, 12), torch.arange(13, 40))
    assert torch.equal(part[0], full[1, 1, 5:12, 13:40])
    # spot-check one element against the written specification
    b, h, row, col = 1, 2, 7, 29
    k0, k1 = seed & 0xFFFFFFFF, ((seed >> 32) ^ (offset >> 32)) & 0xFFFFFFFF
    ctr = tuple(torch.tensor([x]) for x in (col >> 3, row, b * 3 + h, offset & 0xFFFFFFFF))
    words = [int(w) for w in philox.philox4x32_10(ctr, (k0, k1))]
    u16 = (words[(col & 7) >> 1] >> (16 * (col & 1))) & 0xFFFF
    assert bool(full[b, h, row, col]) == (u16 >= philox.dropout_threshold(p))


def test_keep_rate_within_five_sigma():
    p = 0.17
    keep = _full_mask(123, 0, p, 2, 4, 128, 257)
    n = keep.numel()
    sigma = math.sqrt(n * p * (1 - p))
    assert abs(keep.sum().item() - n * (1 - p)) < 5 * sigma


def test_different_offsets_and_seeds_give_different_masks():
    a = _full_mask(7, 0, 0.5, 1, 2, 64, 64)
    b = _full_mask(7, 4, 0.5, 1, 2, 64, 64)
    c = _full_mask(8, 0, 0.5, 1, 2, 64, 64)
    d = _full_mask(7, 1 << 32, 0.5, 1, 2, 64, 64)  # the offset's high word matters too
    for other in (b, c, d):
        agree = (a == other).float().mean().item()
        assert 0.4 < agree < 0.6  # independent masks agree half the time at p = 0.5


@pytest.mark.parametrize("causal", [False, True])
def test_reference_dropout_equals_naive_with_the_same_mask(causal, rng):
    batch, sq, sk, h, hk, d, p = 2, 70, 300, 4, 2, 32, 0.25
    q = torch.randn(batch, sq, h, d, generator=rng, dtype=torch.float64, requires_grad=True)
    k = torch.randn(batch, sk, hk, d, generator=rng, dtype=torch.float64, requires_grad=True)
    v = torch.randn(batch, sk, hk, d, generator=rng, dtype=torch.float64, requires_grad=True)
    seed, offset = int(torch.randint(0, 2**62, (), generator=rng)), 4 * int(torch.randint(0, 1000, (), generator=rng))
    params = AttentionOptions(softmax_scale=d**-0.5, causal=causal, dropout_p=p, seed=seed, offset=offset)
    out, lse = reference_forward(q.detach(), k.detach(), v.detach(), params)
    keep = _full_mask(seed, offset, p, batch, h, sq, sk)
    ref, _ = naive_attention(q, k, v, causal=causal, keep_mask=keep, dropout_p=p)
    assert torch.allclose(out, ref, rtol=FLOAT64_RTOL, atol=FLOAT64_ATOL)
    dout = torch.randn_like(out)
    grads = reference_backward(dout, q.detach(), k.detach(), v.detach(), out, lse, params)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-5, atol=1e-6)


def test_manual_seed_reproduces_and_dropout_changes_output(rng):
    q = torch.randn(1, 40, 2, 16, generator=rng)
    k = torch.randn(1, 40, 2, 16, generator=rng)
    v = torch.randn(1, 40, 2, 16, generator=rng)
    torch.manual_seed(11)
    a = volta_train.flash_attn_func(q, k, v, dropout_p=0.3)
    torch.manual_seed(11)
    b = volta_train.flash_attn_func(q, k, v, dropout_p=0.3)
    c = volta_train.flash_attn_func(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b)
    assert not torch.equal(a, c)
    assert not torch.equal(a, volta_train.flash_attn_func(q, k, v))


def test_op_seed_roundtrip_through_int64():
    for value in (0, 1, 2**63 - 1, 2**63, 2**64 - 1):
        assert to_int64(value) % (1 << 64) == value and -(2**63) <= to_int64(value) < 2**63


def test_threshold_resolution():
    assert philox.dropout_threshold(0.0) == 0
    assert philox.dropout_threshold(0.5) == 32768
    assert philox.dropout_threshold(0.9999999) == 65535
    for p in (0.1, 0.17, 0.3):
        assert abs(philox.dropout_threshold(p) / 65536 - p) <= 2**-17
