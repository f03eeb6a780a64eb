"""The backward's sums around the kernels, on the CPU: D = rowsum(dO * O) (launch.dot_do_o, the preprocess kernel's
specification), dQ's scaling and rounding from its fp32 atomics (launch.finish_dq), and the preprocess kernel's launch
(launch.backward_preprocess) with a stand-in kernel."""

import pytest
import torch

from volta_train.kernels import launch


def _pair(rng, shape, dtype):
    dout = (torch.randn(*shape, generator=rng) * 30).to(dtype)  # |dO| of tens: products far from fp16's range
    out = torch.randn(*shape, generator=rng).to(dtype)
    return dout, out


@pytest.mark.parametrize("varlen, shape", [(False, (3, 37, 5, 64)), (False, (2, 1, 1, 8)), (False, (1, 130, 7, 128)),
                                           (True, (77, 5, 64)), (True, (1, 3, 8))])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_dot_do_o_matches_float64(varlen, shape, dtype, rng):
    dout, out = _pair(rng, shape, dtype)
    got = launch.dot_do_o(dout, out, varlen)
    exact = (dout.double() * out.double()).sum(-1)
    exact = exact.t() if varlen else exact.transpose(1, 2)
    assert got.dtype == torch.float32 and got.is_contiguous() and got.shape == exact.shape
    scale = (dout.double().abs() * out.double().abs()).sum(-1)
    scale = scale.t() if varlen else scale.transpose(1, 2)
    assert ((got.double() - exact).abs() <= 1e-6 * scale + 1e-30).all()


def test_dot_do_o_of_a_heads_major_dout_gives_the_same_bits(rng):
    """dO as the dispatcher hands it over (head_dim innermost, any other layout): here heads-major memory."""
    dout, out = _pair(rng, (2, 45, 3, 64), torch.float16)
    heads_major = dout.transpose(1, 2).contiguous().transpose(1, 2)
    assert not heads_major.is_contiguous() and heads_major.stride(-1) == 1
    assert torch.equal(launch.dot_do_o(heads_major, out, False), launch.dot_do_o(dout, out, False))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_finish_dq_scales_in_fp32_and_rounds_once(dtype, rng):
    acc = torch.randn(3, 29, 4, 96, generator=rng) * 1e3
    scale = 0.05 + torch.rand((), generator=rng).item()
    before = acc.clone()
    got = launch.finish_dq(acc, scale, dtype)
    assert got.dtype == dtype and got.shape == acc.shape
    assert torch.equal(got, (acc * scale).to(dtype))  # fp32 product, one rounding
    assert torch.equal(acc, before)  # the fp32 sums are read, not changed
    exact = acc.double() * scale
    ulp = torch.finfo(dtype).eps
    assert ((got.double() - exact).abs() <= ulp * exact.abs()).all()


ROWS_PER_CTA = 8  # the stand-in kernel's block_m (the real one exports its own: csrc/flash_bwd_preprocess.cu)


class _FakeKernel:
    """Stands in for a compiled kernel: records each launch's grid and arguments."""

    def __init__(self, block_m):
        from volta_train.kernels.variants import LaunchGeometry

        self.geometry = LaunchGeometry(0, 32 * block_m, block_m, 0)
        self.launches = []

    def launch(self, grid, args, stream=None):
        self.launches.append((grid, args))


@pytest.mark.parametrize("varlen, shape, grid", [(False, (3, 37, 5, 64), (5, 5, 3)), (False, (1, 8, 2, 128), (1, 2, 1)),
                                                 (True, (77, 6, 96), (10, 6, 1))])
def test_backward_preprocess_launch_covers_every_row(varlen, shape, grid, monkeypatch):
    """Grid (row blocks of the kernel's block_m rows, heads, batch); packed rows as one batch of all of them; the row
    count travels as the kernel's second argument."""
    import ctypes

    from volta_train.kernels import tiles
    from volta_train.kernels.params import BackwardKernelParams

    fake = _FakeKernel(ROWS_PER_CTA)
    chosen = []
    monkeypatch.setattr(launch, "_kernel", lambda variant, device: chosen.append(variant) or fake)
    q = torch.empty(shape, dtype=torch.float16)
    bp = BackwardKernelParams()
    launch.backward_preprocess(bp, q, varlen)
    assert chosen == [tiles.preprocess_variant(shape[-1])]
    (got_grid, args), = fake.launches
    assert got_grid == grid
    assert args[0] is bp and isinstance(args[1], ctypes.c_int) and args[1].value == shape[-3]
    rows = shape[-3]
    assert got_grid[0] * ROWS_PER_CTA >= rows > (got_grid[0] - 1) * ROWS_PER_CTA


def test_backward_preprocess_runs_a_batch_past_grid_z_in_slices(monkeypatch):
    """A dense batch of 65535 * 2 + 3 sequences: three launches of at most 65535 batches, each with o, dO, D and dQ's
    sums moved to its first batch (the strides unchanged); no rows or too many heads: no launch."""
    from volta_train.kernels.params import BackwardKernelParams

    fake = _FakeKernel(8)
    monkeypatch.setattr(launch, "_kernel", lambda variant, device: fake)
    limit, rows, heads = launch.MAX_GRID_Y, 3, 2
    q = torch.empty((2 * limit + 3, rows, heads, 16), dtype=torch.float16)
    bp = BackwardKernelParams()
    bp.fwd.o, bp.dout, bp.dsum, bp.dq_accum = 1 << 20, 1 << 30, 1 << 34, 1 << 38
    bp.fwd.o_batch_stride, bp.do_batch_stride, bp.fwd.lse_batch_stride, bp.dq_batch_stride = 96, 128, 7, 112
    launch.backward_preprocess(bp, q, False)
    assert [grid for grid, _ in fake.launches] == [(1, heads, limit), (1, heads, limit), (1, heads, 3)]
    assert fake.launches[0][1][0] is bp
    for n, (_, (part, _)) in enumerate(fake.launches[1:], start=1):
        first = n * limit
        assert part.fwd.o == bp.fwd.o + 2 * 96 * first and part.dout == bp.dout + 2 * 128 * first
        assert part.dsum == bp.dsum + 4 * 7 * first and part.dq_accum == bp.dq_accum + 4 * 112 * first
        assert part.fwd.o_batch_stride == 96 and part.fwd.q == bp.fwd.q and part.dq == bp.dq
    bp.dq_accum = None  # the dQ kernel's path: no sums to zero, and none to move
    fake.launches.clear()
    launch.backward_preprocess(bp, q, False)
    assert [part.dq_accum for _, (part, _) in fake.launches[1:]] == [None] * 2

    fake.launches.clear()
    with pytest.raises(ValueError, match=r"q has 65536 heads: the backward preprocess's grid takes at most 65535"):
        launch.backward_preprocess(BackwardKernelParams(), torch.empty((1, 1, limit + 1, 16), dtype=torch.float16),
                                   False)
    launch.backward_preprocess(BackwardKernelParams(), torch.empty((2, 0, 3, 64), dtype=torch.float16), False)
    assert fake.launches == []  # no rows: nothing to launch
