"""Which backward calls go to PyTorch's memory-efficient (CUTLASS Sm70) kernel (volta_train/cutlass_backward.py),
and the dispatcher's wiring of that route (padding, slicing), on the CPU with the GPU parts replaced by spies. The
route's numbers are checked on a GPU by tests/test_kernel_standard.py::test_head_dim_256_backward_through_cutlass_*."""

from __future__ import annotations

import pytest
import torch

from volta_train import dispatch
from volta_train import cutlass_backward as eb

QUALIFIES = dict(kernel_head_dim=256, arch=70, varlen=False, dropout_p=0.0, softcap=0.0, alibi=False,
                 window=(-1, -1), deterministic=False)


def test_auto_takes_cutlass_on_sm70_only(monkeypatch):
    monkeypatch.delenv(eb.D256_BACKWARD_ENV, raising=False)
    assert eb.why_not(**QUALIFIES) is None
    assert "sm_90" in eb.why_not(**{**QUALIFIES, "arch": 90})
    assert "head_dim 128" in eb.why_not(**{**QUALIFIES, "kernel_head_dim": 128})
    monkeypatch.setenv(eb.D256_BACKWARD_ENV, "cutlass")
    assert eb.why_not(**{**QUALIFIES, "arch": 90}) is None
    assert "head_dim 64" in eb.why_not(**{**QUALIFIES, "kernel_head_dim": 64})  # never below 256
    monkeypatch.setenv(eb.D256_BACKWARD_ENV, "volta")
    assert eb.why_not(**QUALIFIES) == f"{eb.D256_BACKWARD_ENV}=volta"


@pytest.mark.parametrize("change, reason", [
    (dict(varlen=True), "varlen"), (dict(dropout_p=0.1), "dropout"), (dict(softcap=30.0), "softcap"),
    (dict(alibi=True), "ALiBi"), (dict(window=(64, 0)), "window"), (dict(window=(-1, 0)), "window"),
    (dict(deterministic=True), "deterministic"),
])
def test_what_cutlass_would_compute_differently_stays_on_the_volta_kernel(change, reason, monkeypatch):
    monkeypatch.setenv(eb.D256_BACKWARD_ENV, "auto")
    assert reason in eb.why_not(**{**QUALIFIES, **change})


def test_a_bad_policy_names_the_variable_and_the_choices(monkeypatch):
    monkeypatch.setenv(eb.D256_BACKWARD_ENV, "fast")
    with pytest.raises(ValueError, match=f"{eb.D256_BACKWARD_ENV}='fast'; accepted: auto, cutlass, volta"):
        eb.why_not(**QUALIFIES)


@pytest.mark.parametrize("dropout_p, expect", [(0.0, "cutlass"), (0.2, "kernel")])
def test_dispatcher_routes_and_slices(dropout_p, expect, monkeypatch):
    """head_dim 200 on a (pretended) V100: the kernel-sized (256) padded tensors go to the route the rule picks, and
    the gradients come back sliced to 200."""
    monkeypatch.setenv(eb.D256_BACKWARD_ENV, "auto")
    monkeypatch.setattr(dispatch, "choose_backend", lambda *a, **kw: dispatch.Choice("kernel", "test"))
    monkeypatch.setattr(type(dispatch.kernels.CallDescription(
        device=torch.device("cpu"), dtype=torch.float16, head_dim=256, varlen=False, causal=True, window=(-1, -1),
        alibi=False, dropout=False, accum="fp32")), "arch", property(lambda self: 70))
    calls = []

    def spy(name):
        def grads(dout, q, k, v, *rest, **kw):
            calls.append((name, q.shape[-1], k.shape[-1]))
            return (torch.full_like(q, 1.0), torch.full_like(k, 2.0), torch.full_like(v, 3.0))
        return grads

    monkeypatch.setattr(eb, "backward", spy("cutlass"))
    monkeypatch.setattr(dispatch.kernels, "backward", spy("kernel"))
    q, k, v = torch.randn(1, 5, 4, 200).half(), torch.randn(1, 7, 2, 200).half(), torch.randn(1, 7, 2, 200).half()
    out, dout, lse = torch.randn_like(q), torch.randn_like(q), torch.randn(1, 4, 5)
    dq, dk, dv = dispatch.attention_backward(dout, q, k, v, out, lse, None, None, 5, 7, 0.07, True, -1, -1, None,
                                              dropout_p, 1, 2, "auto", False, 0.0)
    assert calls == [(expect, 256, 256)]
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert bool((dq == 1).all() and (dk == 2).all() and (dv == 3).all())
