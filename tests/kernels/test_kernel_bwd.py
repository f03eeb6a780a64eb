"""The Volta backward kernels on a GPU: dQ, dK, dV against float64 autograd, next to PyTorch's fp16 eager
attention backward on the same inputs; dropout against the reference backend; determinism; autograd paths."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
import torch.utils.checkpoint

import volta_train
from volta_train import reference
from volta_train.options import AttentionOptions
from volta_train.kernels import tiles, launch
from oracles import naive_attention, visible_mask

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def kernel_backend(monkeypatch):
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 7:
        pytest.skip("needs a CUDA GPU of sm_70 or newer")
    monkeypatch.setenv("VOLTA_TRAIN_BACKEND", "kernel")


def _rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def _inputs(batch, sq, sk, h, hk, d, gen):
    q = torch.randn(batch, sq, h, d, generator=gen, device="cuda").half()
    k = torch.randn(batch, sk, hk, d, generator=gen, device="cuda").half()
    v = torch.randn(batch, sk, hk, d, generator=gen, device="cuda").half()
    return q, k, v


def _eager_fp16_grads(q, k, v, dout, causal, window=(-1, -1)):
    """PyTorch fp16 eager attention (fp32 softmax, as HF's eager path) and its autograd gradients."""
    group = q.shape[2] // k.shape[2]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    kk, vv = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * q.shape[-1] ** -0.5
    mask = visible_mask(q.shape[1], k.shape[1], causal, window, device="cuda")
    p = torch.softmax(s.float().masked_fill(~mask, float("-inf")), dim=-1).nan_to_num(0.0).half()
    out = torch.einsum("bhij,bjhd->bihd", p, vv)
    return torch.autograd.grad(out, (q, k, v), dout)


def _reference_grads(q, k, v, dout, causal, window=(-1, -1)):
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, _ = naive_attention(q, k, v, causal=causal, window_size=window)
    return torch.autograd.grad(out, (q, k, v), dout.double())


def _kernel_grads(q, k, v, dout, causal, bwd_accum, window=(-1, -1), deterministic=False, dropout_p=0.0, seed=0,
                  offset=0, tile=None, dq_tile=None, kernel_head_dim=None):
    params = AttentionOptions(softmax_scale=q.shape[-1] ** -0.5, causal=causal, window_left=window[0],
                             window_right=window[1], dropout_p=dropout_p, seed=seed, offset=offset)
    params = dataclasses.replace(params, bwd_accum=bwd_accum, deterministic=deterministic)
    out, lse = launch.forward(q, k, v, None, None, q.shape[1], k.shape[1], params, None)
    return launch.backward(dout, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], params, None, tile=tile,
                           dq_tile=dq_tile, kernel_head_dim=kernel_head_dim)


def _assert_within_twice_eager(grads, q, k, v, dout, causal):
    """Each gradient finite and, in norm against float64, within twice PyTorch's fp16 eager error; returns the float64
    and eager gradients."""
    for name, g in zip("qkv", grads):
        assert torch.isfinite(g).all(), f"d{name} has NaN or inf"
    ref = _reference_grads(q, k, v, dout, causal)
    eager = _eager_fp16_grads(q, k, v, dout, causal)
    for name, g, r, e in zip("qkv", grads, ref, eager):
        err, torch_err = _rel(g, r), _rel(e, r)
        assert err <= 2 * torch_err + 1e-5, f"d{name}: kernel {err:.2e} vs PyTorch fp16 eager {torch_err:.2e}"
    return ref, eager


CASES = [  # batch, seqlen_q, seqlen_k, heads, kv_heads, head_dim, causal
    (2, 128, 128, 4, 4, 64, False),
    (2, 257, 257, 4, 2, 64, True),
    (1, 333, 1000, 6, 3, 128, False),
    (2, 1000, 333, 4, 1, 128, True),
    (1, 1, 513, 4, 4, 32, True),
    (2, 77, 91, 2, 2, 96, False),
    (1, 300, 300, 2, 1, 80, True),
    (1, 130, 129, 4, 2, 16, False),
    (1, 201, 190, 2, 2, 48, True),
    (1, 150, 150, 2, 2, 112, False),
    (1, 2048, 2048, 8, 2, 64, True),
    (1, 4096, 4096, 2, 2, 128, False),
    (1, 16384, 16384, 1, 1, 64, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "b{}_q{}_k{}_h{}/{}_d{}_{}".format(*c[:6], "causal" if c[6] else "full"))
@pytest.mark.parametrize("bwd_accum", ["fp32", "fp16"])
def test_gradients_within_twice_pytorch_fp16_error(case, bwd_accum):
    batch, sq, sk, h, hk, d, causal = case
    gen = torch.Generator(device="cuda").manual_seed(random.getrandbits(62))
    q, k, v = _inputs(batch, sq, sk, h, hk, d, gen)
    dout = torch.randn(batch, sq, h, d, generator=gen, device="cuda").half()
    _assert_within_twice_eager(_kernel_grads(q, k, v, dout, causal, bwd_accum), q, k, v, dout, causal)


@pytest.mark.parametrize("window", [(32, 0), (64, 16)])
def test_window_gradients(window):
    gen = torch.Generator(device="cuda").manual_seed(random.getrandbits(62))
    q, k, v = _inputs(2, 300, 357, 4, 2, 64, gen)
    dout = torch.randn_like(q)
    grads = _kernel_grads(q, k, v, dout, False, "fp32", window=window)
    ref = _reference_grads(q, k, v, dout, False, window)
    eager = _eager_fp16_grads(q, k, v, dout, False, window)
    for g, r, e in zip(grads, ref, eager):
        assert _rel(g, r) <= 2 * _rel(e, r) + 1e-5


@pytest.mark.parametrize("bwd_accum", ["fp32", "fp16"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("head_dim", [64, 128, 80])
def test_dropout_gradients_equal_reference_backend(bwd_accum, causal, head_dim):
    gen = torch.Generator(device="cuda").manual_seed(random.getrandbits(62))
    q, k, v = _inputs(2, 257, 300, 4, 2, head_dim, gen)
    dout = torch.randn(2, 257, 4, head_dim, generator=gen, device="cuda").half()
    seed, offset, p = random.getrandbits(64), 4 * random.getrandbits(20), 0.25
    grads = _kernel_grads(q, k, v, dout, causal, bwd_accum, dropout_p=p, seed=seed, offset=offset)
    params = AttentionOptions(softmax_scale=head_dim**-0.5, causal=causal, dropout_p=p, seed=seed, offset=offset)
    qd, kd, vd = q.double(), k.double(), v.double()
    out, lse = reference.reference_forward(qd, kd, vd, params)
    ref = reference.reference_backward(dout.double(), qd, kd, vd, out, lse, params)
    tolerance = 5e-3 if bwd_accum == "fp32" else 1e-2
    for name, g, r in zip("qkv", grads, ref):
        assert _rel(g, r) < tolerance, f"d{name} {_rel(g, r):.2e}"


@pytest.mark.parametrize("head_dim", [64, 128])
def test_deterministic_gives_identical_bits_and_matches_atomics(head_dim):
    gen = torch.Generator(device="cuda").manual_seed(random.getrandbits(62))
    q, k, v = _inputs(2, 1000, 1000, 4, 2, head_dim, gen)
    dout = torch.randn_like(q)
    first = _kernel_grads(q, k, v, dout, True, "fp32", deterministic=True)
    second = _kernel_grads(q, k, v, dout, True, "fp32", deterministic=True)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    atomic = _kernel_grads(q, k, v, dout, True, "fp32", deterministic=False)
    for a, b in zip(first, atomic):
        assert _rel(a, b) < 2e-3


def test_varlen_gradients_match_dense_per_sequence():
    lengths = [0, 1, 17, 128, 129, 300, 5]
    h, hk, d = 4, 2, 64
    total = sum(lengths)
    q = torch.randn(total, h, d, device="cuda").half().requires_grad_()
    k = torch.randn(total, hk, d, device="cuda").half().requires_grad_()
    v = torch.randn(total, hk, d, device="cuda").half().requires_grad_()
    cu = torch.tensor([0] + lengths, device="cuda").cumsum(0).to(torch.int32)
    out = volta_train.flash_attn_varlen_func(q, k, v, cu, cu, max(lengths), max(lengths), causal=True)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    for b, n in enumerate(lengths):
        if n == 0:
            continue
        s = slice(cu[b].item(), cu[b + 1].item())
        qs, ks, vs = (t[None, s].detach().requires_grad_() for t in (q, k, v))
        o = volta_train.flash_attn_func(qs, ks, vs, causal=True)
        ref = torch.autograd.grad(o, (qs, ks, vs), dout[None, s])
        for g, r in zip(grads, ref):
            assert _rel(g[s], r[0]) < 2e-3


def test_autograd_through_public_api_uses_kernel(monkeypatch):
    monkeypatch.setenv("VOLTA_TRAIN_BACKEND", "auto")
    from volta_train import kernels

    calls = []
    original = kernels.backward
    monkeypatch.setattr(kernels, "backward", lambda *a, **kw: calls.append(1) or original(*a, **kw))
    gen = torch.Generator(device="cuda").manual_seed(random.getrandbits(62))
    q, k, v = (t.requires_grad_() for t in _inputs(2, 200, 200, 4, 2, 64, gen))
    out = volta_train.flash_attn_func(q, k, v, causal=True)
    dq, dk, dv = torch.autograd.grad(out.float().square().sum(), (q, k, v))
    assert calls and all(torch.isfinite(g).all() for g in (dq, dk, dv))


class TinyAttention(torch.nn.Module):
    def __init__(self, dim=256, heads=4):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.proj = torch.nn.Linear(dim, dim)
        self.heads = heads

    def forward(self, x):
        b, n, c = x.shape
        qkv = self.qkv(x).view(b, n, 3, self.heads, c // self.heads)
        out = volta_train.flash_attn_qkvpacked_func(qkv, causal=True)
        return self.proj(out.reshape(b, n, c))


@pytest.mark.parametrize("mode", ["compile", "checkpoint"])
def test_small_model_under_compile_and_checkpointing(mode, monkeypatch):
    monkeypatch.setenv("VOLTA_TRAIN_BACKEND", "auto")
    torch.manual_seed(0)
    model = TinyAttention().cuda().half()
    x = torch.randn(2, 300, 256, device="cuda").half().requires_grad_()
    ref_out = model(x)
    ref_grads = torch.autograd.grad(ref_out.float().square().mean(), [x] + list(model.parameters()))
    if mode == "compile":
        run = torch.compile(model)
        out = run(x)
    else:
        out = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    grads = torch.autograd.grad(out.float().square().mean(), [x] + list(model.parameters()))
    assert torch.allclose(out, ref_out, atol=2e-3)
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < 1e-2


@pytest.mark.parametrize("tile", [
    tiles.BwdTile(quad_pair_rows=1, warps=4, block_m=32),
    tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=64),
    tiles.BwdTile(quad_pair_rows=2, warps=4, block_m=32),
    tiles.BwdTile(quad_pair_rows=1, warps=4, block_m=32, kv_in_smem=True),
    tiles.BwdTile(quad_pair_rows=2, warps=4, block_m=32, kv_in_smem=True, lean=True),
    # head_dim 64 split over two CTAs (32 dK/dV columns each; head_dim 256's design)
    tiles.BwdTile(quad_pair_rows=2, warps=4, block_m=16, kv_in_smem=True, dq_atomic=False, lean=True, out_split=2),
    tiles.BwdTile(quad_pair_rows=1, warps=4, block_m=32, kv_in_smem=True, dq_atomic=False, out_split=2),
], ids=repr)
def test_every_backward_tile(tile):
    gen = torch.Generator(device="cuda").manual_seed(random.getrandbits(62))
    q, k, v = _inputs(2, 333, 301, 4, 2, 64, gen)
    dout = torch.randn_like(q)
    grads = _kernel_grads(q, k, v, dout, True, "fp32", tile=tile)
    ref = _reference_grads(q, k, v, dout, True)
    eager = _eager_fp16_grads(q, k, v, dout, True)
    for g, r, e in zip(grads, ref, eager):
        assert _rel(g, r) <= 2 * _rel(e, r) + 1e-5


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_alibi_gradients(deterministic, causal):
    gen = torch.Generator(device="cuda").manual_seed(random.getrandbits(62))
    q, k, v = _inputs(2, 257, 300, 4, 2, 64, gen)
    dout = torch.randn(2, 257, 4, 64, generator=gen, device="cuda").half()
    slopes = torch.rand(2, 4, generator=gen, device="cuda") * 0.5
    params = AttentionOptions(softmax_scale=64**-0.5, causal=causal, bwd_accum="fp32", deterministic=deterministic)
    out, lse = launch.forward(q, k, v, None, None, 257, 300, params, slopes)
    grads = launch.backward(dout, q, k, v, out, lse, None, None, 257, 300, params, slopes)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out, _ = naive_attention(qd, kd, vd, causal=causal, alibi_slopes=slopes)
    ref = torch.autograd.grad(ref_out, (qd, kd, vd), dout.double())
    for name, g, r in zip("qkv", grads, ref):
        assert _rel(g, r) < 3e-3, f"d{name} {_rel(g, r):.2e}"


# the V100 backward's head dims: every tile's own, and those run on a larger head_dim's kernels (zero-padded)
SM70_BWD_HEAD_DIMS = sorted(set(tiles.BWD_TILES_SM70) | set(tiles.BWD_KERNEL_HEAD_DIMS_SM70))


def _sm70_tile_id(head_dim):
    kernel_d = tiles.bwd_kernel_head_dim(head_dim, 70)
    tile = tiles.BWD_TILES_SM70[kernel_d]
    return "d{}_qp{}x{}_n{}_m{}{}{}{}{}{}".format(
        head_dim, tile.quad_pair_rows, 4 // tile.quad_pair_rows, tile.block_n, tile.block_m,
        "_kvsmem" if tile.kv_in_smem else "", "_lean" if tile.lean else "", "" if tile.dq_atomic else "_dqkernel",
        f"_split{tile.out_split}" if tile.out_split > 1 else "", f"_padded{kernel_d}" if kernel_d != head_dim else "")


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dropout", [False, True], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("bwd_accum", ["fp32", "fp16"])
@pytest.mark.parametrize("head_dim", SM70_BWD_HEAD_DIMS, ids=_sm70_tile_id)
def test_sm70_backward_tiles_at_their_head_dim(head_dim, bwd_accum, causal, dropout, deterministic):
    """Every tile of the V100 tables (BWD_TILES_SM70 and DQ_TILES_SM70), run at its own head_dim on whatever GPU is
    present (the tables are what a V100 runs; elsewhere they are reached only through tile=), and d80 and d112 on the
    d96 and d128 kernels with zero-padded inputs (BWD_KERNEL_HEAD_DIMS_SM70): GQA, odd lengths (a partial key block and a
    partial query block), both accumulation modes, causal and not, dropout, and the deterministic path (dK/dV
    kernel without atomics + the sm_70 dQ kernel)."""
    kernel_d = tiles.bwd_kernel_head_dim(head_dim, 70)
    tile, dq_tile = tiles.BWD_TILES_SM70[kernel_d], tiles.dq_tile(kernel_d, 70)
    _check_backward_tile(head_dim, kernel_d, tile, dq_tile, bwd_accum, causal, dropout, deterministic)


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dropout", [False, True], ids=["nodrop", "dropout"])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("bwd_accum", ["fp32", "fp16"])
@pytest.mark.parametrize("head_dim", sorted(tiles.BWD_TILES_SM70_NEXT), ids=lambda d: f"d{d}")
def test_next_sm70_backward_tiles(head_dim, bwd_accum, causal, dropout, deterministic):
    """The tiles BWD_TILES_SM70 takes next (BWD_TILES_SM70_NEXT), as the V100 tiles above."""
    tile, dq_tile = tiles.BWD_TILES_SM70_NEXT[head_dim], tiles.dq_tile(head_dim, 70)
    _check_backward_tile(head_dim, head_dim, tile, dq_tile, bwd_accum, causal, dropout, deterministic)


def _check_backward_tile(head_dim, kernel_d, tile, dq_tile, bwd_accum, causal, dropout, deterministic):
    gen = torch.Generator(device="cuda").manual_seed(random.getrandbits(62))
    q, k, v = _inputs(2, 203, 237, 4, 2, head_dim, gen)
    dout = torch.randn(2, 203, 4, head_dim, generator=gen, device="cuda").half()
    if not dropout:
        grads = _kernel_grads(q, k, v, dout, causal, bwd_accum, deterministic=deterministic, tile=tile, dq_tile=dq_tile,
                              kernel_head_dim=kernel_d)
        assert all(g.shape == t.shape and g.is_contiguous() for g, t in zip(grads, (q, k, v)))
        _assert_within_twice_eager(grads, q, k, v, dout, causal)
        return
    seed, offset, p = random.getrandbits(64), 4 * random.getrandbits(20), 0.25
    grads = _kernel_grads(q, k, v, dout, causal, bwd_accum, deterministic=deterministic, dropout_p=p, seed=seed,
                          offset=offset, tile=tile, dq_tile=dq_tile, kernel_head_dim=kernel_d)
    params = AttentionOptions(softmax_scale=head_dim**-0.5, causal=causal, dropout_p=p, seed=seed, offset=offset)
    qd, kd, vd = q.double(), k.double(), v.double()
    out, lse = reference.reference_forward(qd, kd, vd, params)
    ref = reference.reference_backward(dout.double(), qd, kd, vd, out, lse, params)
    tolerance = 5e-3 if bwd_accum == "fp32" else 1e-2
    for name, g, r in zip("qkv", grads, ref):
        assert torch.isfinite(g).all(), f"d{name} has NaN or inf"
        assert _rel(g, r) < tolerance, f"d{name} {_rel(g, r):.2e}"


@pytest.mark.parametrize("varlen, batch, seqlen, heads, kv_heads, head_dim, causal", [
    (True, 8192, 3, 16, 8, 64, False),  # 65,536 sequences x kv heads: the dK/dV grid takes them in x
    (True, 8192, 5, 8, 8, 128, True),
    (False, 65537, 2, 1, 1, 16, False),  # and the preprocess runs the batch in two slices (grid z)
], ids=["varlen_8192x8_full", "varlen_8192x8_causal", "dense_65537"])
def test_backward_past_cuda_grid_limits(varlen, batch, seqlen, heads, kv_heads, head_dim, causal):
    """More than 65,535 sequences x key/value heads (CUDA's limit on grid y and z): the gradients against float64,
    norm and max-abs within twice PyTorch's fp16 eager error (sequences of one length: the packed call is a dense
    one too)."""
    gen = torch.Generator(device="cuda").manual_seed(random.getrandbits(62))
    q, k, v = _inputs(batch, seqlen, seqlen, heads, kv_heads, head_dim, gen)
    dout = torch.randn(batch, seqlen, heads, head_dim, generator=gen, device="cuda").half()
    params = AttentionOptions(softmax_scale=head_dim**-0.5, causal=causal)
    if varlen:
        cu = torch.arange(0, (batch + 1) * seqlen, seqlen, dtype=torch.int32, device="cuda")
        packed = [t.flatten(0, 1) for t in (q, k, v, dout)]
        out, lse = launch.forward(*packed[:3], cu, cu, seqlen, seqlen, params, None)
        grads = launch.backward(packed[3], *packed[:3], out, lse, cu, cu, seqlen, seqlen, params, None)
        grads = [g.unflatten(0, (batch, seqlen)) for g in grads]
    else:
        grads = _kernel_grads(q, k, v, dout, causal, "fp32")
    ref, eager = _assert_within_twice_eager(grads, q, k, v, dout, causal)
    for name, g, r, e in zip("qkv", grads, ref, eager):
        worst = (g.double() - r).abs().max().item()
        assert worst <= 2 * (e.double() - r).abs().max().item() + 1e-3, f"d{name}: max-abs error {worst:.2e}"


@pytest.mark.parametrize("varlen, shape", [(False, (2, 77, 5, 64)), (False, (1, 130, 3, 128)), (False, (3, 9, 2, 96)),
                                           (False, (1, 33, 2, 16)), (False, (2, 40, 2, 256)), (True, (151, 4, 128)),
                                           (True, (1, 1, 80))])
@pytest.mark.parametrize("with_dq_accum", [True, False], ids=["atomics", "dq_kernel"])
def test_backward_preprocess_matches_float64_and_zeroes_dq(varlen, shape, with_dq_accum):
    """csrc/flash_bwd_preprocess.cu: D = rowsum(dO * O) in fp32 (against float64 and launch.dot_do_o, its
    specification) written only where lse's strides put it, and dQ's fp32 sums zeroed where the atomics need them;
    dO heads-major (strided), D's rows padded, every output poisoned first, a second launch bit for bit the same."""
    from volta_train.kernels.params import BackwardKernelParams

    gen = torch.Generator(device="cuda").manual_seed(random.getrandbits(62))
    dout = (torch.randn(*shape, generator=gen, device="cuda") * 30).half()
    dout = dout.transpose(-2, -3).contiguous().transpose(-2, -3)  # heads-major memory, head_dim innermost
    out = torch.randn(*shape, generator=gen, device="cuda").half()
    nheads, rows = shape[-2], shape[-3]
    lse_shape = (nheads, rows) if varlen else (shape[0], nheads, rows)
    dsum_padded = torch.full(lse_shape[:-1] + (rows + 7,), float("nan"), device="cuda")
    dsum = dsum_padded[..., :rows]  # strided like a padded lse: the 7 columns past each row must stay NaN
    dq_accum = torch.full(shape, float("nan"), device="cuda")
    bp = BackwardKernelParams()
    bp.fwd.o, bp.dout, bp.dsum = out.data_ptr(), dout.data_ptr(), dsum.data_ptr()
    launch._set_strides(bp.fwd, "o", out, varlen)
    launch._set_strides(bp, "do", dout, varlen)
    bp.fwd.lse_batch_stride, bp.fwd.lse_head_stride = (0, dsum.stride(0)) if varlen else dsum.stride()[:2]
    bp.dq_accum = dq_accum.data_ptr() if with_dq_accum else None
    launch._set_strides(bp, "dq", dq_accum, varlen)
    q_like = torch.empty(shape, dtype=torch.float16, device="cuda")

    launch.backward_preprocess(bp, q_like, varlen)
    first = dsum.clone()
    launch.backward_preprocess(bp, q_like, varlen)
    torch.cuda.synchronize()
    assert torch.equal(first, dsum)
    assert torch.isnan(dsum_padded[..., rows:]).all(), "D was written outside lse's rows"
    if with_dq_accum:
        assert torch.equal(dq_accum, torch.zeros_like(dq_accum))
    else:
        assert torch.isnan(dq_accum).all(), "dq_accum was written though the params hold no pointer"
    exact = (dout.double() * out.double()).sum(-1)
    scale = (dout.double().abs() * out.double().abs()).sum(-1)
    exact, scale = ((t.t() if varlen else t.transpose(1, 2)) for t in (exact, scale))
    err = (dsum.double() - exact).abs()
    assert (err <= 1e-6 * scale + 1e-30).all(), f"max error {err.max().item():.3e}"
    spec = launch.dot_do_o(dout, out, varlen)
    assert ((dsum.double() - spec.double()).abs() <= 2e-6 * scale + 1e-30).all()
