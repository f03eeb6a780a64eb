"""The kernels' capability table (volta_train/kernels/support.py) on the CPU: the backward's grid limit, from the
call's description to the dispatcher's choice and the launcher's own refusal."""

import pytest
import torch

from volta_train import dispatch
from volta_train.kernels import launch, support
from volta_train.kernels.support import MAX_GRID_Y, CallDescription
from volta_train.options import AttentionOptions

OPTIONS = AttentionOptions(softmax_scale=0.125, causal=True)


def _tensors(batch, heads, kv_heads, rows=3, head_dim=64):
    q = torch.zeros(batch, rows, heads, head_dim, dtype=torch.float16)
    k = torch.zeros(batch, rows, kv_heads, head_dim, dtype=torch.float16)
    return q, k, k.clone()


def test_describe_counts_sequences_times_kv_heads_for_the_backward_only():
    q, k, v = _tensors(5, 8, 2)
    assert support.describe(q, k, v, OPTIONS, varlen=False, alibi=False, backward=True).batch_kv_heads == 10
    assert support.describe(q, k, v, OPTIONS, varlen=False, alibi=False).batch_kv_heads == 0
    packed = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)  # [total, heads, head_dim]
    call = support.describe(*packed, OPTIONS, varlen=True, alibi=False, backward=True, batch=4097)
    assert call.batch_kv_heads == 4097 * 2
    with pytest.raises(ValueError, match=r"needs batch: the number of sequences \(cu_seqlens_q.numel\(\) - 1\)"):
        support.describe(*packed, OPTIONS, varlen=True, alibi=False, backward=True)


@pytest.mark.parametrize("kv_heads_times_batch, refused", [(MAX_GRID_Y, False), (MAX_GRID_Y + 1, True)])
def test_backward_past_the_grid_limit_is_refused_with_its_reason(kv_heads_times_batch, refused, monkeypatch):
    """A (pretended) V100 call: past 65535 sequences x key/value heads the reason names the count and the limit."""
    monkeypatch.setattr(CallDescription, "arch", property(lambda self: 70))
    monkeypatch.setattr(support, "_compiler_problem", lambda arch: None)
    call = CallDescription(device=torch.device("cuda", 0), dtype=torch.float16, head_dim=128, options=OPTIONS,
                           backward=True, varlen=True, batch_kv_heads=kv_heads_times_batch)
    reason = support.unsupported_reason(call)
    if refused:
        assert reason == (f"{MAX_GRID_Y + 1} sequences x key/value heads: the backward's dK/dV kernel takes at most "
                          f"{MAX_GRID_Y} (its grid's y dimension)")
        assert dispatch.choose_backend(call).backend == "reference"
    else:
        assert reason is None


def test_dispatcher_hands_the_packed_batch_to_the_description(monkeypatch):
    """attention_backward describes a varlen call with cu_seqlens_q's sequence count (8192 one-token sequences x 8
    key/value heads: one past the limit), not q's first dimension; on the CPU the reference backend runs it."""
    seen = []
    real_describe = dispatch.kernels.describe

    def describe(*args, **kwargs):
        call = real_describe(*args, **kwargs)
        seen.append(call)
        return call

    monkeypatch.setattr(dispatch.kernels, "describe", describe)
    monkeypatch.setattr(CallDescription, "arch", property(lambda self: 70))
    total, heads, kv_heads, d = 8192, 8, 8, 16
    q = torch.randn(total, heads, d)
    k, v = torch.randn(total, kv_heads, d), torch.randn(total, kv_heads, d)
    cu = torch.arange(total + 1, dtype=torch.int32)  # 8192 one-token sequences
    out, dout, lse = torch.randn_like(q), torch.randn_like(q), torch.zeros(heads, total)
    dq, dk, dv, _ = dispatch.attention_backward(dout, q, k, v, out, lse, cu, cu, 1, 1, None, None, *OPTIONS.pack())
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert seen[-1].batch_kv_heads == total * kv_heads == MAX_GRID_Y + 1


def test_launcher_refuses_the_grid_before_launching(monkeypatch):
    launched = []
    monkeypatch.setattr(launch, "_kernel", lambda variant, device: launched.append(variant))
    q, k, v = _tensors(MAX_GRID_Y + 1, 1, 1, rows=1, head_dim=16)
    with pytest.raises(ValueError, match=rf"65536 sequences x 1 key/value heads = 65536: .* at most {MAX_GRID_Y}"):
        launch._run_backward(q, q, k, v, q, torch.zeros(MAX_GRID_Y + 1, 1, 1), None, None, 1, 1, OPTIONS, None,
                             None, None, 70)
    assert launched == []
