"""Which backward calls go to PyTorch's memory-efficient (CUTLASS Sm70) kernel (volta_train/cutlass_backward.py),
and the dispatcher's wiring of that route (padding, slicing), on the CPU with the GPU parts replaced by spies. The
route's numbers are checked on a GPU by tests/kernels/test_kernel_standard.py::test_head_dim_256_backward_through_cutlass_*."""

from __future__ import annotations

import pytest
import torch

from volta_train import cutlass_backward as cb
from volta_train import dispatch
from volta_train.kernels.support import CallDescription
from volta_train.options import AttentionOptions


@pytest.fixture
def on_arch(monkeypatch):
    """CallDescription.arch answers what the test sets (CPU tensors: no device to ask)."""
    arch = {"value": 70}
    monkeypatch.setattr(CallDescription, "arch", property(lambda self: arch["value"]))
    return arch


def _call(head_dim=200, varlen=False, alibi=False, **options) -> CallDescription:
    return CallDescription(device=torch.device("cuda"), dtype=torch.float16, head_dim=head_dim, varlen=varlen,
                           alibi=alibi, backward=True, options=AttentionOptions(softmax_scale=0.1, **options))


def test_auto_takes_cutlass_on_sm70_only(monkeypatch, on_arch):
    monkeypatch.delenv(cb.POLICY_ENV, raising=False)
    assert cb.why_not(_call()) is None
    on_arch["value"] = 90
    assert "sm_90" in cb.why_not(_call())
    monkeypatch.setenv(cb.POLICY_ENV, "always")
    assert cb.why_not(_call()) is None
    assert "head_dim 64" in cb.why_not(_call(head_dim=64))  # never below 256
    on_arch["value"] = 70
    assert "head_dim 128" in cb.why_not(_call(head_dim=128))
    monkeypatch.setenv(cb.POLICY_ENV, "never")
    assert cb.why_not(_call()) == f"{cb.POLICY_ENV}=never"


@pytest.mark.parametrize("change, reason", [
    (dict(varlen=True), "varlen"), (dict(dropout_p=0.1), "dropout"), (dict(softcap=30.0), "softcap"),
    (dict(alibi=True), "ALiBi"), (dict(window_left=64, window_right=0), "window"), (dict(window_right=0), "window"),
    (dict(deterministic=True), "deterministic"),
])
def test_what_cutlass_would_compute_differently_stays_on_the_volta_kernel(change, reason, monkeypatch, on_arch):
    monkeypatch.setenv(cb.POLICY_ENV, "auto")
    assert reason in cb.why_not(_call(**change))


def test_a_bad_policy_names_the_variable_and_the_choices(monkeypatch, on_arch):
    monkeypatch.setenv(cb.POLICY_ENV, "fast")
    with pytest.raises(ValueError, match=f"{cb.POLICY_ENV}='fast'; accepted: auto, always, never"):
        cb.why_not(_call())


@pytest.mark.parametrize("dropout_p, expect", [(0.0, "cutlass"), (0.2, "kernel")])
def test_dispatcher_routes_pads_and_slices(dropout_p, expect, monkeypatch, on_arch):
    """head_dim 200 on a (pretended) V100: the route the rule picks gets the caller's tensors, CUTLASS's kernel sees
    them padded to 256, and the gradients come back sliced to 200."""
    monkeypatch.setenv(cb.POLICY_ENV, "auto")
    monkeypatch.setattr(dispatch.kernels, "unsupported_reason", lambda call: None)
    monkeypatch.setattr(CallDescription, "device_name", property(lambda self: "FakeV100"))
    calls = []

    def spy(name):
        def grads(dout, q, k, v, *rest, **kw):
            calls.append((name, q.shape[-1], k.shape[-1]))
            return (torch.full_like(q, 1.0), torch.full_like(k, 2.0), torch.full_like(v, 3.0))
        return grads

    monkeypatch.setattr(cb, "_backward", spy("cutlass"))
    monkeypatch.setattr(dispatch.kernels, "backward", spy("kernel"))
    q, k, v = torch.randn(1, 5, 4, 200).half(), torch.randn(1, 7, 2, 200).half(), torch.randn(1, 7, 2, 200).half()
    out, dout, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(1, 4, 5)
    options = AttentionOptions(softmax_scale=0.07, causal=True, dropout_p=dropout_p, seed=1, offset=2)
    dq, dk, dv, _ = dispatch.attention_backward(dout, q, k, v, out, lse, None, None, 5, 7, None, None,
                                                *options.pack())
    assert calls == [(expect, 256 if expect == "cutlass" else 200, 256 if expect == "cutlass" else 200)]
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert bool((dq == 1).all() and (dk == 2).all() and (dv == 3).all())
