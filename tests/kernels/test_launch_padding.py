"""launch.backward's zero-padding to a larger kernel head_dim (the V100 d112 backward on the d128 kernels,
tiles.BWD_KERNEL_HEAD_DIMS_SM70), on the CPU: the inner call is replaced by a recorder, so no kernel runs; the
kernels' numbers on padded inputs are tested on a GPU (test_kernel_bwd.py, the `_padded128` cases)."""

import pytest
import torch

from volta_train.options import AttentionOptions
from volta_train.kernels import launch, tiles


def _call(backward, head_dim, kernel_head_dim, gen):
    q, out, dout = (torch.randn(2, 5, 4, head_dim, generator=gen).half() for _ in range(3))
    k, v = (torch.randn(2, 7, 2, head_dim, generator=gen).half() for _ in range(2))
    lse = torch.randn(2, 4, 5, generator=gen)
    options = AttentionOptions(softmax_scale=head_dim**-0.5, causal=True)
    grads = backward(dout, q, k, v, out, lse, None, None, 5, 7, options, None,
                     tile=tiles.bwd_tile(128, 70), dq_tile=tiles.dq_tile(128, 70), kernel_head_dim=kernel_head_dim)
    return grads, dict(dout=dout, q=q, k=k, v=v, out=out)


def test_inputs_are_zero_padded_and_gradients_sliced_back(monkeypatch):
    seen = {}

    def inner(dout, q, k, v, out, lse, *args, **kwargs):
        seen.update(dout=dout, q=q, k=k, v=v, out=out, lse=lse, args=args, kwargs=kwargs)
        # a different value in every column (the padded ones included), to see which columns come back
        return tuple(torch.randn(t.shape).half() for t in (q, k, v))

    monkeypatch.setattr(launch, "_run_backward", inner)
    monkeypatch.setattr(launch, "_arch", lambda device: 90)  # CPU tensors: no device to ask
    gen = torch.Generator().manual_seed(1234)
    grads, inputs = _call(launch.backward, 112, 128, gen)
    for name, t in inputs.items():
        padded = seen[name]
        assert padded.shape == t.shape[:-1] + (128,), name
        assert torch.equal(padded[..., :112], t), name
        assert not padded[..., 112:].any(), f"{name}: padded columns not zero"
    # the inner call runs the d128 kernels (the shapes above), with the tiles given
    assert seen["args"][-3] == tiles.bwd_tile(128, 70) and seen["args"][-2] == tiles.dq_tile(128, 70)
    for g, t in zip(grads, (inputs["q"], inputs["k"], inputs["v"])):
        assert g.shape == t.shape and g.is_contiguous() and torch.isfinite(g.float()).all()


def test_a_smaller_kernel_head_dim_is_refused(monkeypatch):
    monkeypatch.setattr(launch, "_arch", lambda device: 90)
    gen = torch.Generator().manual_seed(5)
    with pytest.raises(ValueError, match=r"kernel_head_dim=96: smaller than the inputs' head_dim 112; accepted: "
                                         r"None \(the tile table's choice\) or a kernel head_dim >= 112"):
        _call(launch.backward, 112, 96, gen)


def test_only_the_v100_table_pads():
    assert tiles.BWD_KERNEL_HEAD_DIMS_SM70 == {80: 96, 112: 128}
    for head_dim in tiles.SUPPORTED_HEAD_DIMS:
        assert tiles.bwd_kernel_head_dim(head_dim, 90) == head_dim  # sm_80+: every head_dim on its own kernels
        kernel_d = tiles.bwd_kernel_head_dim(head_dim, 70)
        assert kernel_d == tiles.BWD_KERNEL_HEAD_DIMS_SM70.get(head_dim, head_dim)
        assert kernel_d in tiles.SUPPORTED_HEAD_DIMS and kernel_d >= head_dim

