"""Every bad input gets a clear error naming the argument and what would be accepted."""

from __future__ import annotations

import logging

import pytest
import torch

import volta_train
from volta_train import dispatch, validation


def qkv(b=2, sq=8, sk=8, h=4, hk=4, d=16, dtype=torch.float32):
    return torch.randn(b, sq, h, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype), torch.randn(b, sk, hk, d, dtype=dtype)


@pytest.mark.parametrize(
    "make, error, words",
    [
        (lambda: (torch.randn(8, 4, 16), *qkv()[1:]), ValueError, ["q must be 4-D", "[batch, seqlen, heads, head_dim]"]),
        (lambda: (qkv()[0], torch.randn(3, 8, 4, 16), qkv()[2]), ValueError, ["batch sizes differ", "q 2, k 3"]),
        (lambda: (qkv(d=16)[0], *qkv(d=24)[1:]), ValueError, ["k has head_dim 24", "q has 16"]),
        (lambda: qkv(h=6, hk=4), ValueError, ["q has 6 heads", "multiple"]),
        (lambda: qkv(d=520), ValueError, ["q has head_dim 520", "accepted: 1 to 512"]),
        (lambda: (qkv(d=16)[0], qkv(d=16)[1], qkv(d=520)[2]), ValueError, ["v has head_dim 520", "accepted: 1 to 512"]),
        (lambda: qkv(h=4, hk=0), ValueError, ["q has 4 heads and k/v have 0"]),
        (lambda: (qkv()[0], qkv()[1].to("meta"), qkv()[2]), ValueError, ["k is on meta", "same device"]),
        (lambda: (qkv()[0], qkv()[1].half(), qkv()[2]), TypeError, ["k has dtype torch.float16"]),
        (lambda: qkv(dtype=torch.int32) if False else tuple(t.to(torch.int32) for t in qkv()), TypeError, ["accepted: float16"]),
        (lambda: (qkv()[0], qkv()[1], torch.randn(2, 9, 4, 16)), ValueError, ["k has seqlen 8 but v has 9"]),
        (lambda: (qkv()[0], *[t.transpose(1, 3).contiguous().transpose(1, 3) for t in qkv()[1:]]), ValueError,
         ["contiguous in its last dimension"]),
    ],
)
def test_dense_shape_errors(make, error, words):
    q, k, v = make()
    with pytest.raises(error) as info:
        volta_train.flash_attn_func(q, k, v)
    for word in words:
        assert word in str(info.value), str(info.value)


def test_bfloat16_on_volta_points_to_fp16_with_loss_scaling(monkeypatch):
    monkeypatch.setattr(validation, "is_volta", lambda device: True)
    with pytest.raises(TypeError, match="no bfloat16 tensor cores.*float16 with dynamic loss scaling"):
        volta_train.flash_attn_func(*qkv(dtype=torch.bfloat16))


@pytest.mark.parametrize("p", [-0.1, 1.0, 1.5, float("nan")])
def test_dropout_out_of_range(p):
    with pytest.raises(ValueError, match=r"dropout_p is .*accepted: a float in \[0, 1\)"):
        volta_train.flash_attn_func(*qkv(), dropout_p=p)


def test_paged_kv_cache_refusals_name_block_table():
    q, k, v, cu, m = _packed([3, 4])
    with pytest.raises(ValueError, match="k must be 4-D \\[num_blocks, page_block_size"):
        volta_train.flash_attn_varlen_func(q, k, v, cu, cu, m, m, block_table=torch.zeros(2, 1, dtype=torch.int32))
    # a page size it does not accept is named
    with pytest.raises(ValueError, match="page_block_size 4 .*accepted: a multiple of 32"):
        volta_train.flash_attn_with_kvcache(torch.randn(1, 1, 2, 16), torch.randn(1, 4, 2, 16), torch.randn(1, 4, 2, 16),
                                            block_table=torch.zeros(1, 1, dtype=torch.int32))
    # None is flash-attn's default and accepted
    volta_train.flash_attn_varlen_func(q, k, v, cu, cu, m, m, block_table=None)


@pytest.mark.parametrize(
    "kwargs, error, pattern",
    [
        ({"window_size": (-2, 0)}, ValueError, "window_size"),
        ({"window_size": 5}, ValueError, "window_size"),
        ({"alibi_slopes": torch.ones(3)}, ValueError, r"alibi_slopes has shape \(3,\); accepted: \(4,\) or \(2, 4\)"),
        ({"alibi_slopes": torch.ones(4, dtype=torch.float64)}, TypeError, "alibi_slopes must be float32"),
        ({"accum": "fp8"}, ValueError, "accum is 'fp8'; accepted: fp32, fp16"),
        ({"bwd_accum": "tf32"}, ValueError, "bwd_accum"),
    ],
)
def test_option_errors(kwargs, error, pattern):
    with pytest.raises(error, match=pattern):
        volta_train.flash_attn_func(*qkv(), **kwargs)


def _packed(lengths, h=2, d=16):
    total = sum(lengths)
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    return torch.randn(total, h, d), torch.randn(total, h, d), torch.randn(total, h, d), cu, max(lengths)


@pytest.mark.parametrize(
    "mutate, error, pattern",
    [
        (lambda q, k, v, cu, m: (q, k, v, cu.long(), cu, m, m), TypeError, "cu_seqlens_q must be int32"),
        (lambda q, k, v, cu, m: (q, k, v, cu, cu + 1, m, m), ValueError, "cu_seqlens_k must start at 0"),
        (lambda q, k, v, cu, m: (q, k, v, torch.tensor([0, 5, 3, 12], dtype=torch.int32), cu, m, m), ValueError,
         "non-decreasing"),
        (lambda q, k, v, cu, m: (q, k, v, torch.tensor([0, 3, 7, 11], dtype=torch.int32), cu, m, m), ValueError,
         "ends at 11 but the packed tensor has 12 tokens"),
        (lambda q, k, v, cu, m: (q, k, v, cu, cu, 3, m), ValueError, "max_seqlen_q is 3 but the longest"),
        (lambda q, k, v, cu, m: (q[None], k, v, cu, cu, m, m), ValueError, "3-D"),
        (lambda q, k, v, cu, m: (q, k, v, cu, cu[:-1], m, m), ValueError, "cu_seqlens_k ends at"),
    ],
)
def test_varlen_errors(mutate, error, pattern):
    args = mutate(*_packed([3, 4, 5]))
    with pytest.raises(error, match=pattern):
        volta_train.flash_attn_varlen_func(*args)


def test_backend_policy_errors(monkeypatch):
    monkeypatch.setenv("VOLTA_TRAIN_BACKEND", "kernel")
    with pytest.raises(dispatch.BackendUnavailableError, match="input is on cpu: the Volta kernel needs a CUDA GPU"):
        volta_train.flash_attn_func(*qkv())
    monkeypatch.setenv("VOLTA_TRAIN_BACKEND", "fastest")
    with pytest.raises(ValueError, match="VOLTA_TRAIN_BACKEND='fastest'; accepted: auto, kernel, reference"):
        volta_train.flash_attn_func(*qkv())


def test_backend_choice_logged_once(monkeypatch, caplog):
    monkeypatch.setenv("VOLTA_TRAIN_BACKEND", "reference")
    monkeypatch.setattr(dispatch, "_logged_reasons", set())
    with caplog.at_level(logging.INFO, logger="volta_train"):
        for _ in range(3):
            q, k, v = (t.requires_grad_() for t in qkv())
            volta_train.flash_attn_func(q, k, v).sum().backward()
    lines = [r.getMessage() for r in caplog.records if "volta_train attention" in r.getMessage()]
    assert lines == ["volta_train attention forward: reference backend (VOLTA_TRAIN_BACKEND=reference)",
                     "volta_train attention backward: reference backend (VOLTA_TRAIN_BACKEND=reference)"]
