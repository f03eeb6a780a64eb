"""flash_attn_with_kvcache on the split-KV decoding kernel (volta_train/kernels/decode.py, csrc SplitKvParams).

CPU: the split rule, the GQA packing decision, the combine of the splits, the decoding tile table and the parameter
struct's ctypes mirror. GPU (``@pytest.mark.gpu``): flash-attn's accuracy standard against the float64 truth (max-abs
error within twice that of PyTorch's fp16 attention on the same fp16 inputs, plus the floor of tests/support/oracles.py;
rows that see no key exactly 0 with lse +inf), per-batch cache lengths including 0 and the full cache, seqlen_q 1 /
3 / 16, GQA groups 1 / 4 / 8 (packed and not), cache_batch_idx, k/v appends of 1 and 5 tokens, rotary (interleaved
and not), causal masks, left and right windows, soft-capping, ALiBi, cache_leftpad, padded head dims; outputs and
the split partials poisoned with NaN; bitwise-repeatable calls; a 20,000-key cache over many splits; both tile
tables ("sm70" through the launcher's tile override); the caches bit-equal to the reference backend's after the
append. Paged caches (block_table): the emulated kernel (CPU) and the GPU kernel read K/V through a shuffled block
table and give outputs bit-identical to the same logical cache held contiguous, the appends crossing pages.
"""

from __future__ import annotations

import math
import random
import re
import types

import pytest
import torch

import volta_train
from volta_train import kvcache, reference
from volta_train.options import AttentionOptions
from volta_train.kernels import decode, tiles
from volta_train.kernels.params import KernelParams, SplitKvKernelParams
from volta_train.kernels.variants import csrc_dir
from checkout import ROOT
from oracles import error_vs_yardstick, naive_attention, torch_fp16_attention

# --- the split rule (CPU) ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("ctas, key_blocks, sms, want", [
    (8, 2048, 80, (40, 52)),        # 1 x 8 KV heads, 32k keys of 16, V100: 320 CTAs wanted -> 40 splits
    (8, 2048, 132, (64, 32)),       # H100: 66 splits wanted, capped at 64
    (8, 10, 80, (2, 5)),            # few keys: each split keeps >= 4 blocks
    (8, 3, 80, (1, 3)),             # fewer than 2 x 4 blocks: no split
    (256, 2048, 80, (2, 1024)),     # 8 x 32 heads: 2 splits reach 4 CTAs per SM
    (320, 2048, 80, (1, 2048)),     # enough CTAs already
    (8, 0, 80, (1, 1)),             # no key at all
])
def test_split_plan_examples(ctas, key_blocks, sms, want):
    assert decode.split_plan(ctas, key_blocks, sms) == want


def test_split_plan_invariants():
    for ctas in (1, 3, 8, 24, 100, 500):
        for key_blocks in (1, 2, 7, 8, 63, 64, 65, 1000, 20000):
            for sms in (1, 80, 132):
                splits, per = decode.split_plan(ctas, key_blocks, sms)
                assert (splits, per) == decode.split_plan(ctas, key_blocks, sms)  # a function of its inputs
                assert 1 <= splits <= decode.MAX_SPLITS
                assert splits * per >= key_blocks > (splits - 1) * per, "every block in one split, no empty split"
                if splits > 1:
                    assert per >= decode.MIN_BLOCKS_PER_SPLIT
                    assert ctas * (splits - 1) < decode.DECODE_CTAS_PER_SM * sms, "no more splits than needed"
                if ctas >= decode.DECODE_CTAS_PER_SM * sms:
                    assert splits == 1


@pytest.mark.parametrize("seqlen_q, h, hk, alibi, left, packed", [
    (1, 32, 8, False, -1, True),
    (1, 32, 1, False, -1, True),    # MQA
    (1, 8, 8, False, -1, False),    # no group to pack
    (2, 32, 8, False, -1, False),   # two queries: their causal masks differ
    (1, 32, 8, True, -1, False),    # ALiBi: a bias per query head
    (1, 32, 8, False, 100, False),  # left window: the rows would need different masks
    (1, 32, 8, False, 0, False),
])
def test_pack_gqa_decision(seqlen_q, h, hk, alibi, left, packed):
    assert decode.pack_gqa(seqlen_q, h, hk, alibi, left) is packed


def test_combine_splits_equals_one_softmax():
    gen = torch.Generator().manual_seed(0)
    scores = torch.randn(2, 3, 4, 50, generator=gen, dtype=torch.float64) * 3
    scores[0, 1, 2] = -math.inf  # a row that sees no key
    v = torch.randn(50, 8, generator=gen, dtype=torch.float64)
    bounds = [(0, 13), (13, 13), (13, 40), (40, 50)]  # the second split is empty
    o_parts, lse_parts = [], []
    for a, b in bounds:
        s = scores[..., a:b]
        lse = torch.logsumexp(s, -1) if b > a else torch.full(s.shape[:-1], -math.inf, dtype=s.dtype)
        seen = torch.isfinite(lse)
        p = torch.exp(s - torch.where(seen, lse, 0).unsqueeze(-1))
        o_parts.append(torch.where(seen.unsqueeze(-1), p @ v[a:b], 0))
        lse_parts.append(lse)
    out, lse = decode.combine_splits(torch.stack(o_parts), torch.stack(lse_parts))
    full_lse = torch.logsumexp(scores, -1)
    seen = torch.isfinite(full_lse)
    want = torch.where(seen.unsqueeze(-1), torch.softmax(scores, -1).nan_to_num(0.0) @ v, 0)
    assert torch.allclose(out, want, rtol=1e-12, atol=1e-12)
    assert torch.allclose(lse[seen], full_lse[seen], rtol=1e-12, atol=1e-12)
    assert torch.isposinf(lse[0, 1, 2]) and torch.equal(out[0, 1, 2], torch.zeros(8, dtype=torch.float64))
    assert int((~seen).sum()) == 1


# --- the tile table and the parameter mirror (CPU) --------------------------------------------------------------------


@pytest.mark.parametrize("arch", [70, 90])
def test_decode_tiles_cover_every_head_dim(arch):
    names = set()
    for head_dim in tiles.SUPPORTED_HEAD_DIMS:
        tile = tiles.decode_tile(head_dim, arch)
        assert 16 <= tile.block_m <= 32 and head_dim % (8 * (4 // tile.quad_pair_rows)) == 0
        assert tile.block_n * head_dim / 8 / tile.threads <= 8, "K/V staging chunks per thread"
        for softcap in (False, True):
            variant = tiles.decode_variant(head_dim, tile, softcap)
            assert variant.name_expressions[0].startswith("flash_fwd_kernel<")
            assert variant.name_expressions[0].endswith(", true, false>>")  # SPLIT_KV, then LAZY_RESCALE (off)
            names.add(variant.name)
    shipped = {v.name for v in tiles.shipped_variants(arch)}
    assert names <= shipped and len(names) == 2 * len(tiles.SUPPORTED_HEAD_DIMS)
    combines = {v.name for v in tiles.shipped_combine_variants()}
    assert combines <= shipped and len(combines) == len(tiles.SUPPORTED_HEAD_DIMS)


def _struct_fields(source: str, struct: str) -> list[tuple[str, str]]:
    """(kind, name) of each field of `struct` in params.cuh, in order: kind "ptr", "i64", "u64", "i32" or "f32"."""
    body = re.search(r"struct " + struct + r"\b[^{]*\{(.*?)\n\};", source, re.S).group(1)
    fields = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if not line.endswith(";") or "(" in line:
            continue
        decl, names = re.match(r"(.*?)\s*(\w+(?:\s*,\s*\w+)*);$", line.replace("*", "* ")).groups()[0:2]
        kind = ("ptr" if "*" in decl else "i64" if "long long" in decl else "u64" if "u64" in decl
                else "f32" if "float" in decl else "i32")
        fields += [(kind, name.strip()) for name in names.split(",")]
    return fields


def _ctypes_kind(ctype) -> str:
    import ctypes
    return {ctypes.c_void_p: "ptr", ctypes.c_longlong: "i64", ctypes.c_ulonglong: "u64", ctypes.c_int: "i32",
            ctypes.c_uint: "i32", ctypes.c_float: "f32"}[ctype]


def test_split_kv_params_mirror_the_cuda_code():
    source = (csrc_dir() / "params.cuh").read_text()
    base = [(_ctypes_kind(t), n) for n, t in KernelParams._fields_]
    extra = [(_ctypes_kind(t), n) for n, t in SplitKvKernelParams._fields_]
    assert _struct_fields(source, "AttentionParams") == base
    assert re.search(r"struct SplitKvParams\s*:\s*AttentionParams\s*\{", source), "derived: the same bytes first"
    assert _struct_fields(source, "SplitKvParams") == extra
    from volta_train.kernels import nvrtc
    try:
        nvrtc.find_nvrtc(70)
    except Exception as error:  # noqa: BLE001 - no NVRTC here: nothing to compile with
        pytest.skip(f"no libnvrtc for sm_70: {error}")
    import ctypes
    lines = ['#include "flash_fwd_kernel.cuh"',
             f'static_assert(sizeof(AttentionParams) == {ctypes.sizeof(KernelParams)}, "AttentionParams");',
             f'static_assert(sizeof(SplitKvParams) == {ctypes.sizeof(SplitKvKernelParams)}, "SplitKvParams");']
    variants = {v.name: v for arch in (70, 90) for v in tiles.shipped_decode_variants(arch)}
    for n, v in enumerate(variants.values()):  # the decoding tiles build the SPLIT_KV kernel (its SplitKvParams)
        traits = re.match(r"flash_fwd_kernel<(.*)>$", v.name_expressions[0]).group(1)
        lines.append(f"using DT{n} = {traits};")
        lines.append(f'static_assert(DT{n}::kSplitKv, "{v.name}");')
    lines.append("__global__ void params_check_kernel() {}")
    nvrtc.compile_program("\n".join(lines) + "\n", ["params_check_kernel"], 70, (), [csrc_dir()], "params_check.cu")


# --- GPU -------------------------------------------------------------------------------------------------------------

TABLES = ("default", "sm70")


def _gpu():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 7:
        pytest.skip("needs a CUDA GPU of sm_70 or newer")


def _case(batch, seqlen_q, h, hk, d, *, seqlen_cache=333, new=0, seqlens=None, batch_idx=False, leftpad=False,
          rotary=None, alibi=False, seed=None, device="cuda"):
    """fp16 inputs; seqlens defaults to lengths drawn in [0, seqlen_cache - new] with 0 and the full cache among
    them."""
    seed = random.getrandbits(31) if seed is None else seed
    gen = torch.Generator(device=device).manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device).half()  # noqa: E731
    batch_cache = batch + 2 if batch_idx else batch
    # the longest past: the full cache, or with rotary the last position the rotary table must still hold
    room = seqlen_cache - (max(new, seqlen_q) if rotary else new)
    if seqlens is None:
        seqlens = [0, room] + torch.randint(0, room + 1, (max(0, batch - 2),), generator=gen, device=device).tolist()
        seqlens = seqlens[:batch]
    c = dict(q=rnd(batch, seqlen_q, h, d), k_cache=rnd(batch_cache, seqlen_cache, hk, d),
             v_cache=rnd(batch_cache, seqlen_cache, hk, d), k=rnd(batch, new, hk, d) if new else None,
             v=rnd(batch, new, hk, d) if new else None, rotary_cos=None, rotary_sin=None,
             cache_seqlens=torch.tensor(seqlens, dtype=torch.int32, device=device),
             cache_batch_idx=None, cache_leftpad=None, alibi_slopes=None, rotary_interleaved=rotary != "neox")
    if batch_idx:
        c["cache_batch_idx"] = torch.randperm(batch_cache, generator=gen, device=device)[:batch].int()
    if alibi:
        c["alibi_slopes"] = torch.rand(batch, h, generator=gen, device=device) * 0.5
    if leftpad:
        c["cache_leftpad"] = torch.tensor([random.randint(0, n) for n in seqlens], dtype=torch.int32, device=device)
    if rotary:
        angle = torch.rand(seqlen_cache, d // 4, generator=gen, device=device) * 2 * math.pi
        c["rotary_cos"], c["rotary_sin"] = angle.cos(), angle.sin()
    return c


def _options(c, causal=False, window=(-1, -1), softcap=0.0, scale=None):
    d = c["q"].shape[-1]
    return AttentionOptions(softmax_scale=scale if scale is not None else d**-0.5, causal=causal,
                            window_left=window[0], window_right=window[1], softcap=softcap)


_ARGS = ("k", "v", "rotary_cos", "rotary_sin", "cache_seqlens", "cache_batch_idx", "cache_leftpad")


def _kernel(c, prm, table="default", num_splits=None, poison=True, extent=True, block_table=None):
    """decode.forward_with_kvcache on c's own caches (appended in place), outputs and partials NaN-poisoned.

    extent: pass the cache extent (key_end, longest) as the API does after reading the lengths on the host; False:
    leave it unknown, as with VOLTA_TRAIN_KVCACHE_CHECK=device (the kernel is given the whole cache)."""
    q = c["q"]
    tile = {"tile": tiles.decode_tile(_kernel_d(q), 70)} if table == "sm70" else {}
    if extent:
        new = 0 if c["k"] is None else c["k"].shape[1]
        ends = c["cache_seqlens"].long() + new
        pads = c["cache_leftpad"].long() if c["cache_leftpad"] is not None else torch.zeros_like(ends)
        tile.update(key_end=int(ends.max()), longest=int((ends - pads).max()))
    buffers = {}
    if poison:
        buffers = dict(out=torch.full_like(q, float("nan")),
                       lse=torch.full((q.shape[0], q.shape[2], q.shape[1]), float("nan"), device=q.device),
                       partial_fill=float("nan"))
    return decode.forward_with_kvcache(q, c["k_cache"], c["v_cache"], *(c[a] for a in _ARGS), prm, c["alibi_slopes"],
                                       c["rotary_interleaved"], num_splits=num_splits, block_table=block_table,
                                       **tile, **buffers)


def _kernel_d(q) -> int:
    return min(d for d in tiles.SUPPORTED_HEAD_DIMS if d >= q.shape[-1])


def _reference_copy(c, prm):
    """The reference backend on copies of the caches: (out, lse, k_cache, v_cache) and the rotated q."""
    k_cache, v_cache = c["k_cache"].clone(), c["v_cache"].clone()
    q_rot, rows, ends = kvcache.append(c["q"], k_cache.clone(), v_cache.clone(), c["k"], c["v"],
                                                  c["rotary_cos"], c["rotary_sin"], c["cache_seqlens"],
                                                  c["cache_batch_idx"], prm, c["rotary_interleaved"])
    out, lse = reference.reference_kvcache_forward(c["q"], k_cache, v_cache, *(c[a] for a in _ARGS), prm,
                                                    c["alibi_slopes"], c["rotary_interleaved"])
    return out, lse, k_cache, v_cache, q_rot, rows, ends


def _oracle(c, prm, k_cache, v_cache, q_rot, rows, ends):
    """float64 truth, PyTorch fp16 yardstick and float64 lse, entry by entry over its visible cache keys."""
    window = (prm.window_left, prm.window_right)
    pads = c["cache_leftpad"].tolist() if c["cache_leftpad"] is not None else [0] * q_rot.shape[0]
    truth, yard, lses = [], [], []
    for b, (row, end) in enumerate(zip(rows.tolist(), ends.tolist())):
        kk, vv = k_cache[row : row + 1, pads[b] : end], v_cache[row : row + 1, pads[b] : end]
        slopes = c["alibi_slopes"][b : b + 1] if c["alibi_slopes"] is not None else None
        kw = dict(causal=prm.causal, softmax_scale=prm.softmax_scale, window_size=window, alibi_slopes=slopes,
                  softcap=prm.softcap)
        out64, lse64 = naive_attention(q_rot[b : b + 1], kk, vv, **kw)
        truth.append(out64)
        yard.append(torch_fp16_attention(q_rot[b : b + 1], kk, vv, **kw))
        lses.append(lse64)
    return torch.cat(truth), torch.cat(yard), torch.cat(lses)


def _check(c, prm, table="default", num_splits=None, what="", extent=True):
    """Kernel against the float64 truth (the standard), the reference backend's caches, key-less rows."""
    out_ref, lse_ref, k_ref, v_ref, q_rot, rows, ends = _reference_copy(c, prm)
    out, lse = _kernel(c, prm, table, num_splits, extent=extent)
    assert torch.equal(c["k_cache"], k_ref) and torch.equal(c["v_cache"], v_ref), f"{what}: caches after the append"
    truth, yard, lse64 = _oracle(c, prm, k_ref, v_ref, q_rot, rows, ends)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any(), f"{what}: NaN / inf in out or NaN in lse"
    e = error_vs_yardstick(out, yard, truth)
    assert e.ok, f"{what}: {e}"
    empty = torch.isinf(lse64)
    assert torch.equal(torch.isposinf(lse), empty), f"{what}: lse must be +inf exactly on the key-less rows"
    assert torch.equal(torch.isposinf(lse), torch.isposinf(lse_ref)), what
    keyless = empty.transpose(1, 2)
    assert torch.equal(out[keyless], torch.zeros_like(out[keyless])), f"{what}: key-less rows must be exactly 0"
    seen = ~empty
    err = (lse[seen].double() - lse64[seen]).abs().max().item() if seen.any() else 0.0
    assert err <= 2e-3 * max(1.0, lse64[seen].abs().max().item() if seen.any() else 1.0), f"{what}: lse error {err}"
    return out, lse


# batch, seqlen_q, h, hk, d, new, causal, window, softcap, alibi, rotary, batch_idx, leftpad
CASES = [
    (4, 1, 32, 8, 128, 1, True, (-1, -1), 0.0, False, "interleaved", True, False),  # packed GQA 4, decode step
    (3, 1, 16, 2, 64, 0, False, (-1, -1), 0.0, False, None, False, True),  # packed GQA 8, leftpad, no append
    (3, 1, 8, 8, 64, 1, True, (-1, -1), 30.0, False, "neox", False, False),  # MHA (group 1), softcap
    (2, 3, 8, 2, 128, 5, True, (-1, -1), 0.0, False, "neox", True, False),  # 3 queries: not packed
    (3, 16, 8, 2, 96, 5, True, (-1, -1), 0.0, False, "interleaved", False, True),
    (2, 16, 8, 1, 64, 1, True, (7, -1), 0.0, False, None, True, False),  # causal + left window
    (2, 40, 4, 2, 64, 3, True, (-1, -1), 0.0, False, None, False, False),  # 40 queries: 3 query blocks per head
    (2, 3, 4, 4, 80, 5, False, (-1, 1), 0.0, False, None, False, False),  # right window
    (3, 1, 16, 2, 128, 1, False, (40, -1), 0.0, False, None, False, False),  # left window: not packed
    (2, 1, 8, 2, 112, 1, True, (-1, -1), 0.0, True, None, False, True),  # ALiBi: not packed
    (2, 5, 8, 4, 48, 5, True, (-1, -1), 20.0, True, None, True, False),  # softcap + ALiBi
    (2, 1, 8, 2, 40, 1, True, (-1, -1), 0.0, False, "interleaved", False, False),  # head_dim 40 padded to 48
    (2, 1, 4, 1, 16, 0, False, (-1, -1), 0.0, False, None, False, False),
    (2, 16, 4, 2, 32, 1, False, (-1, -1), 0.0, False, None, False, False),
    (3, 1, 16, 2, 256, 1, True, (-1, -1), 0.0, False, None, True, False),  # d256: the 1x4, 4-warp tile, 8 rows
    (2, 16, 4, 2, 256, 5, True, (-1, -1), 10.0, False, "neox", False, True),  # d256, 16 rows: two warps active
]


def _case_id(c):
    b, sq, h, hk, d, new, causal, window, cap, alibi, rotary, idx, pad = c
    return (f"b{b}_q{sq}_h{h}/{hk}_d{d}_new{new}{'_causal' if causal else ''}"
            f"{'' if window == (-1, -1) else f'_win{window[0]}.{window[1]}'}{f'_softcap{cap:g}' if cap else ''}"
            f"{'_alibi' if alibi else ''}{f'_rot-{rotary}' if rotary else ''}{'_idx' if idx else ''}"
            f"{'_leftpad' if pad else ''}")


# --- the Python side against an emulated kernel (CPU) -----------------------------------------------------------------
# decode.forward_with_kvcache with the launch replaced by a float64 model of the SPLIT_KV kernel that reads and
# writes the memory SplitKvParams points to, as csrc/params.cuh documents it: checks the packing views, the strides,
# the partial buffers' layout, the combine and the unpacking without a GPU.


def _flat(ptr: int, dtype: torch.dtype, count: int) -> torch.Tensor:
    """count elements of raw CPU memory at ptr as a writable flat tensor."""
    import ctypes
    size = count * torch.empty((), dtype=dtype).element_size()
    return torch.frombuffer((ctypes.c_byte * size).from_address(ptr), dtype=dtype)


class _EmulatedKernel:
    last_num_bh = None
    def __init__(self, variant):
        meta = variant.meta
        self.d, self.block_n, self.softcap = meta["head_dim"], meta["tile"].block_n, meta["softcap"]
        self.geometry = types.SimpleNamespace(block_m=meta["tile"].block_m, block_n=meta["tile"].block_n)

    def launch(self, grid, args):  # (threads and shared memory: the compiled kernel's own, LoadedKernel)
        (p,) = args
        d, bn = self.d, self.block_n
        x, y, splits = grid
        num_bh = y if p.m_blocks_fastest else x
        _EmulatedKernel.last_num_bh = num_bh  # what the combine's grid must cover
        heads = p.nheads
        batch = num_bh // heads
        ints = lambda ptr, n=batch: _flat(ptr, torch.int32, n).tolist() if ptr else None  # noqa: E731
        used, kv_batch, pad = ints(p.seqused_k), ints(p.k_batch_index), ints(p.leftpad_k)
        kv_batch = kv_batch or list(range(batch))
        pad = pad or [0] * batch
        # each entry's queries (SequenceExtent): dense rows [0, seqlen_q), or packed through cu_seqlens_q
        cu_q = ints(p.cu_seqlens_q, batch + 1) or [b * p.seqlen_q for b in range(batch + 1)]
        assert not p.cu_seqlens_k, "the decoding kernel takes the key counts from seqused_k"
        q_rows = cu_q[-1] if p.cu_seqlens_q else p.seqlen_q  # rows of q / o per batch stride
        span = lambda b, r, h, n_b, n_r, n_h: (n_b - 1) * b + (n_r - 1) * r + (n_h - 1) * h + d  # noqa: E731
        q = _flat(p.q, torch.float16, span(p.q_batch_stride, p.q_row_stride, p.q_head_stride, batch, q_rows, heads))
        n_kv = heads // p.heads_per_kv
        kv_rows, kv_batches = max(used), max(kv_batch) + 1
        pages = None
        if p.block_table:  # paged (csrc/params.cuh key_block_base): one table read per key block, which is in one page
            page = p.page_block_size
            assert page % bn == 0 and not p.k_batch_index and not p.leftpad_k
            pages = _flat(p.block_table, torch.int32, batch * p.block_table_batch_stride).view(batch, -1).long()
            used_pages = torch.cat([pages[b, : -(-used[b] // page)] for b in range(batch)])
            assert not used_pages.numel() or int(used_pages.min()) >= 0
            kv_rows, kv_batches = page, int(used_pages.max()) + 1 if used_pages.numel() else 1

        def key_rows(b, keys, batch_stride, row_stride):
            """The element offsets of logical keys [n, 1] of entry b (the kernel's k_base / key_block_base)."""
            if pages is None:
                return kv_batch[b] * batch_stride + (pad[b] + keys) * row_stride
            logical_page = (keys // bn) * bn // page  # the page of each key's block
            return pages[b][logical_page] * batch_stride + (keys - logical_page * page) * row_stride

        k, v = (_flat(ptr, torch.float16, span(b, r, h, kv_batches, kv_rows, n_kv))
                for ptr, b, r, h in ((p.k, p.k_batch_stride, p.k_row_stride, p.k_head_stride),
                                     (p.v, p.v_batch_stride, p.v_row_stride, p.v_head_stride)))
        scale = p.scale_log2 / decode_log2e()
        cols = torch.arange(d)
        for b in range(batch):
            seqlen_k = used[b] - pad[b]
            rows = cu_q[b + 1] - cu_q[b]
            first_row = cu_q[b] if p.cu_seqlens_q else 0  # the entry's first row of the packed q / o / lse
            assert rows <= p.seqlen_q
            shift = seqlen_k - rows
            for h in range(heads):
                kvh, bh = h // p.heads_per_kv, b * heads + h
                row_index = torch.arange(first_row, first_row + rows)
                qi = b * p.q_batch_stride + h * p.q_head_stride + row_index.view(-1, 1) * p.q_row_stride + cols
                keys = torch.arange(seqlen_k).view(-1, 1)
                kb = key_rows(b, keys, p.k_batch_stride, p.k_row_stride) + kvh * p.k_head_stride + cols
                vb = key_rows(b, keys, p.v_batch_stride, p.v_row_stride) + kvh * p.v_head_stride + cols
                s_all = q[qi].double() @ k[kb].double().T * scale
                if self.softcap:
                    cap = p.softcap_log2 / decode_log2e()
                    s_all = cap * torch.tanh(s_all / cap)
                i, j = torch.arange(rows).view(-1, 1), torch.arange(seqlen_k).view(1, -1)
                if p.alibi_slopes:
                    slope = _flat(p.alibi_slopes, torch.float32, b * p.alibi_batch_stride + heads)[
                        b * p.alibi_batch_stride + h].item()
                    s_all = s_all - slope * (i + shift - j).abs()
                ok = torch.ones(rows, seqlen_k, dtype=torch.bool)
                if p.window_right >= 0:
                    ok &= j <= i + shift + p.window_right
                if p.window_left >= 0:
                    ok &= j >= i + shift - p.window_left
                for split in range(splits):
                    in_split = (j >= split * p.blocks_per_split * bn) & (j < (split + 1) * p.blocks_per_split * bn)
                    s = s_all.masked_fill(~(ok & in_split), -math.inf)
                    m = s.amax(-1, keepdim=True) if seqlen_k else torch.full((rows, 1), -math.inf, dtype=s.dtype)
                    e = torch.exp(s - torch.where(torch.isinf(m), 0, m))
                    l = e.sum(-1, keepdim=True)
                    o = torch.where(l > 0, (e @ v[vb].double()) / torch.where(l > 0, l, 1), 0)
                    lse = torch.where(l > 0, m + torch.log(torch.where(l > 0, l, 1)), -math.inf).view(-1)
                    if not rows:
                        continue
                    if splits > 1:  # seqlen_q (the most) rows per (split, batch, head); the entry's first `rows`
                        base = (split * num_bh + bh) * p.seqlen_q
                        _flat(p.o_partial, torch.float32, (base + rows) * d)[base * d:] = o.float().reshape(-1)
                        _flat(p.lse_partial, torch.float32, base + rows)[base:] = lse.float()
                    else:
                        oi = (b * p.o_batch_stride + h * p.o_head_stride + cols
                              + row_index.view(-1, 1) * p.o_row_stride)
                        _flat(p.o, torch.float16, int(oi.max()) + 1)[oi] = o.half()
                        li = b * p.lse_batch_stride + h * p.lse_head_stride + row_index
                        lse = torch.where(torch.isinf(lse), math.inf, lse).float()  # the key-less convention
                        _flat(p.lse, torch.float32, int(li.max()) + 1)[li] = lse


class _EmulatedCombine:
    """The split combine (csrc/split_kv_combine.cu) on the same parameters: decode.combine_splits over the partials
    the emulated kernel wrote, written through the params' o / lse strides; checks the launch covers every row."""

    def __init__(self, variant):
        assert variant.meta["pass"] == "combine"
        self.d = variant.meta["head_dim"]

    def launch(self, grid, args):
        (p,) = args
        d, (num_bh, row_blocks, z) = self.d, grid
        rows, splits, heads = p.seqlen_q, p.num_splits, p.nheads
        assert num_bh == _EmulatedKernel.last_num_bh, "grid x must be the split kernel's batch x heads"
        assert z == 1
        assert row_blocks * tiles.COMBINE_ROWS_PER_CTA >= rows > (row_blocks - 1) * tiles.COMBINE_ROWS_PER_CTA
        o_part = _flat(p.o_partial, torch.float32, splits * num_bh * rows * d).view(splits, num_bh, rows, d)
        lse_part = _flat(p.lse_partial, torch.float32, splits * num_bh * rows).view(splits, num_bh, rows)
        cu_q = _flat(p.cu_seqlens_q, torch.int32, num_bh // heads + 1).tolist() if p.cu_seqlens_q else None
        for bh in range(num_bh):
            b, h = divmod(bh, heads)
            first, n = (cu_q[b], cu_q[b + 1] - cu_q[b]) if cu_q else (0, rows)  # the entry's rows (SequenceExtent)
            if not n:
                continue
            out, lse = decode.combine_splits(o_part[:, bh, :n], lse_part[:, bh, :n])  # only the entry's own rows
            row_index = torch.arange(first, first + n)
            oi = b * p.o_batch_stride + h * p.o_head_stride + row_index.view(-1, 1) * p.o_row_stride + torch.arange(d)
            _flat(p.o, torch.float16, int(oi.max()) + 1)[oi] = out.half()
            li = b * p.lse_batch_stride + h * p.lse_head_stride + row_index
            _flat(p.lse, torch.float32, int(li.max()) + 1)[li] = lse.float()


def decode_log2e() -> float:
    return 1.0 / math.log(2.0)


@pytest.fixture
def emulated_kernel(monkeypatch):
    class Properties:
        multi_processor_count = 80

    monkeypatch.setattr(decode, "_arch", lambda device: 70)
    monkeypatch.setattr(decode, "_kernel", lambda variant, device: (
        _EmulatedCombine(variant) if variant.meta["pass"] == "combine" else _EmulatedKernel(variant)))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: Properties())


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_decode_python_side_with_an_emulated_kernel(case, emulated_kernel):
    b, sq, h, hk, d, new, causal, window, cap, alibi, rotary, idx, pad = case
    c = _case(b, sq, h, hk, d, seqlen_cache=77, new=new, batch_idx=idx, leftpad=pad, rotary=rotary, alibi=alibi,
              device="cpu")
    prm = _options(c, causal, window, cap, scale=d**-0.5 * random.uniform(0.7, 1.3))
    snapshot = {k: c[k].clone() for k in ("k_cache", "v_cache")}
    for num_splits, extent in ((1, True), (3, True), (None, False), (3, False)):  # (the rule gives 1 on 77 keys)
        c.update({k: v.clone() for k, v in snapshot.items()})
        _check(c, prm, "default", num_splits, what=f"emulated num_splits={num_splits} extent={extent}", extent=extent)


# --- paged KV cache (block_table) -------------------------------------------------------------------------------------

def _paginate(cache, page_size, spare_pages, gen):
    """A contiguous cache [B, L, Hk, D] (L a multiple of page_size) as a shuffled page pool [B * L / page_size +
    spare_pages, page_size, Hk, D] (the spare pages, never referenced, hold NaN: a read of one shows) and the block
    table (int32 [B, L / page_size]); the same layout for every call with the same generator state."""
    batch, length = cache.shape[:2]
    n = length // page_size
    perm = torch.randperm(batch * n + spare_pages, generator=gen)[: batch * n]
    pool = torch.full((batch * n + spare_pages, page_size) + tuple(cache.shape[2:]), float("nan"), dtype=cache.dtype,
                      device=cache.device)
    table = perm.view(batch, n).to(device=cache.device, dtype=torch.int32)
    pool[table.long()] = cache.unflatten(1, (n, page_size))
    return pool, table


def _unpaginate(pool, table):
    return pool[table.long()].flatten(1, 2)


def _check_paged(c, prm, page_size, table="default", num_splits=None, extent=True, spare=3, what=""):
    """The same logical cache contiguous (checked against float64 by _check) and paged through a shuffled block table:
    outputs and lse bit-identical, the appended caches equal page for page."""
    gen = torch.Generator().manual_seed(page_size * 1000 + (num_splits or 0))
    pool_k, block_table = _paginate(c["k_cache"], page_size, spare, gen)
    pool_v = torch.full_like(pool_k, float("nan"))
    pool_v[block_table.long()] = c["v_cache"].unflatten(1, (-1, page_size))
    paged = dict(c, k_cache=pool_k, v_cache=pool_v)
    out_c, lse_c = _check(c, prm, table, num_splits, what=what, extent=extent)
    out_p, lse_p = _kernel(paged, prm, table, num_splits, extent=extent, block_table=block_table)
    assert torch.equal(out_p, out_c) and torch.equal(lse_p, lse_c), f"{what}: paged != contiguous"
    assert torch.equal(_unpaginate(pool_k, block_table), c["k_cache"]), f"{what}: k pages after the append"
    assert torch.equal(_unpaginate(pool_v, block_table), c["v_cache"]), f"{what}: v pages after the append"
    untouched = sorted(set(range(pool_k.shape[0])) - set(block_table.flatten().tolist()))
    assert torch.isnan(pool_k[untouched]).all() and torch.isnan(pool_v[untouched]).all(), f"{what}: spare pages written"


# the CASES without cache_batch_idx / cache_leftpad (flash-attn refuses them with a block table)
PAGED_CASES = [c[:11] + (False, False) for c in CASES if not (c[11] and c[12])]


@pytest.mark.parametrize("page_size", [32, 64])
@pytest.mark.parametrize("case", PAGED_CASES, ids=_case_id)
def test_decode_paged_python_side_with_an_emulated_kernel(case, page_size, emulated_kernel):
    """decode.forward_with_kvcache with a block table against the emulated kernel, which reads K/V through the table
    as csrc/params.cuh key_block_base does: bit-identical to the same cache contiguous, appends crossing pages."""
    b, sq, h, hk, d, new, causal, window, cap, alibi, rotary, idx, pad = case
    c = _case(b, sq, h, hk, d, seqlen_cache=3 * page_size, new=new, rotary=rotary, alibi=alibi, device="cpu",
              seqlens=([page_size - 1, 0, 3 * page_size - max(new, sq)] * 2)[:b])  # appends across page 0's end
    prm = _options(c, causal, window, cap, scale=d**-0.5 * random.uniform(0.7, 1.3))
    snapshot = {k: c[k].clone() for k in ("k_cache", "v_cache")}
    for num_splits, extent in ((1, True), (3, True), (None, False), (3, False)):
        c.update({k: v.clone() for k, v in snapshot.items()})
        _check_paged(c, prm, page_size, "default", num_splits, extent, what=f"paged emulated {num_splits} {extent}")


def test_decode_paged_refuses_a_page_size_the_tile_splits(emulated_kernel):
    c = _case(1, 1, 4, 2, 128, seqlen_cache=64, device="cpu")
    table = torch.zeros(1, 1, dtype=torch.int32)
    pool = torch.zeros(1, 8, 2, 128, dtype=torch.float16)
    with pytest.raises(ValueError, match="page_block_size 8.*accepted: a multiple of 16"):
        decode.forward_with_kvcache(c["q"], pool, pool.clone(), None, None, None, None, c["cache_seqlens"].clamp(max=8),
                                    None, None, _options(c), None, True, block_table=table)


@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [256, 64])
@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("case", PAGED_CASES, ids=_case_id)
def test_decode_paged_bitwise_equals_contiguous(case, table, page_size):
    """On the GPU kernel: a paged cache gives bit-identical outputs to the same logical cache held contiguous (which
    _check holds to the float64 standard), unsplit, split by the rule and split 5 ways, with the extent known or not."""
    _gpu()
    b, sq, h, hk, d, new, causal, window, cap, alibi, rotary, idx, pad = case
    c = _case(b, sq, h, hk, d, seqlen_cache=2 * page_size, new=new, rotary=rotary, alibi=alibi,
              seqlens=([page_size - 2, 0, 2 * page_size - max(new, sq)] * 2)[:b])
    prm = _options(c, causal, window, cap)
    snapshot = {k: c[k].clone() for k in ("k_cache", "v_cache")}
    for num_splits, extent in ((1, True), (None, True), (5, True), (None, False)):
        c.update({k: v.clone() for k, v in snapshot.items()})
        _check_paged(c, prm, page_size, table, num_splits, extent, what=f"{table} splits={num_splits} {extent}")


@pytest.mark.gpu
def test_decode_paged_long_cache_many_splits():
    """Logical caches of 20,480 keys in 40 pages of 512 each (80 pages, shuffled), GQA 4 packed, rotary: paged ==
    contiguous bitwise over the split rule's many splits."""
    _gpu()
    c = _case(2, 1, 32, 8, 128, seqlen_cache=40 * 512, new=1, seqlens=[40 * 512 - 1, 12345], rotary="neox")
    _check_paged(c, _options(c, causal=True), 512, what="long paged")


@pytest.mark.gpu
@pytest.mark.parametrize("check", ["host", "device"])
def test_decode_paged_through_the_api_matches_the_reference_backend(monkeypatch, check):
    """volta_train.flash_attn_with_kvcache with a block_table on the kernel and on the reference backend (pages of 256,
    flash-attn's size; an append crossing a page; rotary; GQA packed): bit-equal pages, outputs and lse within the
    tolerance of the contiguous API test."""
    _gpu()
    monkeypatch.setenv("VOLTA_TRAIN_KVCACHE_CHECK", check)
    gen = torch.Generator(device="cuda").manual_seed(7)
    rnd = lambda *s: torch.randn(*s, generator=gen, device="cuda").half()  # noqa: E731
    pool_k, pool_v = rnd(9, 256, 2, 64), rnd(9, 256, 2, 64)
    table = torch.tensor([[4, 1, 7], [0, 8, 2]], dtype=torch.int32, device="cuda")
    q, k, v = rnd(2, 1, 8, 64), rnd(2, 3, 2, 64), rnd(2, 3, 2, 64)
    lens = torch.tensor([254, 700], dtype=torch.int32, device="cuda")  # entry 0 appends across pages 4 -> 1
    angle = torch.rand(1024, 16, generator=gen, device="cuda") * 2 * math.pi
    cases = {}
    for backend in ("kernel", "reference"):
        monkeypatch.setenv("VOLTA_TRAIN_BACKEND", backend)
        k_pages, v_pages = pool_k.clone(), pool_v.clone()
        out, lse = volta_train.flash_attn_with_kvcache(q, k_pages, v_pages, k, v, angle.cos(), angle.sin(),
                                                       cache_seqlens=lens, block_table=table, causal=True,
                                                       rotary_interleaved=False, return_softmax_lse=True)
        cases[backend] = (out, lse, k_pages, v_pages)
    (out, lse, k1, v1), (ref, ref_lse, k2, v2) = cases["kernel"], cases["reference"]
    assert torch.equal(k1, k2) and torch.equal(v1, v2), "the append is shared: bit-equal pages"
    assert (out.double() - ref.double()).abs().max().item() <= 1e-2 * max(1.0, ref.double().abs().max().item())
    assert torch.allclose(lse, ref_lse, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_decode_within_twice_pytorch_fp16(case, table):
    _gpu()
    b, sq, h, hk, d, new, causal, window, cap, alibi, rotary, idx, pad = case
    c = _case(b, sq, h, hk, d, new=new, batch_idx=idx, leftpad=pad, rotary=rotary, alibi=alibi)
    prm = _options(c, causal, window, cap, scale=d**-0.5 * random.uniform(0.7, 1.3))
    # the split rule's choice, one split (out / lse by the kernel), several (the combine); the extent read on the
    # host, or unknown (the whole cache given, as with VOLTA_TRAIN_KVCACHE_CHECK=device)
    runs = ((None, True), (1, True), (4, True), (None, False), (4, False))
    snapshot = {k: c[k].clone() for k in ("k_cache", "v_cache")}
    for num_splits, extent in runs:
        c.update({k: v.clone() for k, v in snapshot.items()})
        _check(c, prm, table, num_splits, what=f"{table} num_splits={num_splits} extent={extent}", extent=extent)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 7])
def test_decode_repeated_calls_are_bitwise_equal(num_splits):
    _gpu()
    c = _case(3, 1, 32, 8, 128, new=1, batch_idx=True, rotary="interleaved")
    prm = _options(c, causal=True)
    first_out, first_lse = _kernel(c, prm, num_splits=num_splits)  # appends: later calls rewrite the same values
    caches = (c["k_cache"].clone(), c["v_cache"].clone())
    for _ in range(3):
        out, lse = _kernel(c, prm, num_splits=num_splits)
        assert torch.equal(out, first_out) and torch.equal(lse, first_lse)
        assert torch.equal(c["k_cache"], caches[0]) and torch.equal(c["v_cache"], caches[1])


@pytest.mark.gpu
@pytest.mark.parametrize("h, hk", [(32, 8), (8, 8)])
def test_decode_long_cache_many_splits(h, hk):
    _gpu()
    c = _case(1, 1, h, hk, 128, seqlen_cache=20000, new=1, seqlens=[19999])
    prm = _options(c, causal=True)
    tile = tiles.decode_tile(128, 70)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    heads = hk if decode.pack_gqa(1, h, hk, False, -1) else h
    splits, _ = decode.split_plan(heads, -(-20000 // tile.block_n), sms)
    assert splits >= 8, "the rule splits a lone sequence many ways"
    for table in TABLES:
        for num_splits in (None, 64):
            c["k_cache"], c["v_cache"] = c["k_cache"].clone(), c["v_cache"].clone()
            _check(c, prm, table, num_splits, what=f"{table} 20000 keys, num_splits={num_splits}")


@pytest.mark.gpu
@pytest.mark.parametrize("check", ["host", "device"])
def test_decode_through_the_api_matches_the_reference_backend(monkeypatch, check):
    _gpu()
    monkeypatch.setenv("VOLTA_TRAIN_KVCACHE_CHECK", check)
    c = _case(4, 1, 16, 4, 64, new=1, batch_idx=True, rotary="neox")
    cases = {}
    for backend in ("kernel", "reference"):
        monkeypatch.setenv("VOLTA_TRAIN_BACKEND", backend)
        k_cache, v_cache = c["k_cache"].clone(), c["v_cache"].clone()
        out, lse = volta_train.flash_attn_with_kvcache(
            c["q"], k_cache, v_cache, c["k"], c["v"], c["rotary_cos"], c["rotary_sin"], c["cache_seqlens"],
            c["cache_batch_idx"], causal=True, rotary_interleaved=False, return_softmax_lse=True)
        cases[backend] = (out, lse, k_cache, v_cache)
    (out, lse, k1, v1), (ref, ref_lse, k2, v2) = cases["kernel"], cases["reference"]
    assert torch.equal(k1, k2) and torch.equal(v1, v2), "the append is shared: bit-equal caches"
    assert out.shape == ref.shape and lse.shape == ref_lse.shape == (4, 16, 1) and lse.dtype == torch.float32
    assert (out.double() - ref.double()).abs().max().item() <= 1e-2 * max(1.0, ref.double().abs().max().item())
    assert torch.equal(torch.isposinf(lse), torch.isposinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert torch.allclose(lse[finite], ref_lse[finite], rtol=1e-4, atol=1e-4)


# --- flash_attn_varlen_func on a paged cache: the decoding kernel with packed queries --------------------------------
# decode.forward_paged_varlen (SplitKvParams cu_seqlens_q + block_table): the emulated kernel (CPU) and the GPU kernel
# against float64 attention over each sequence's logical keys; the API's routes (kernel / reference / gather).

# lens_q, lens_k (as multiples of the page size p: (pages, extra keys)), h, hk, d, causal, window, softcap, alibi
VARLEN_PAGED_CASES = [
    # GQA 4; 20 queries on 9 keys, causal (11 rows see no key); 7 queries on no key; an empty sequence; 3 pages
    ([3, 20, 7, 0, 1], [(2, 5), (0, 9), (0, 0), (0, 40), (1, 0)], 8, 2, 128, True, (-1, -1), 0.0, False),
    ([17, 2, 40], [(1, 1), (0, 33), (3, -7)], 4, 4, 64, False, (5, 3), 0.0, True),  # window, ALiBi, 3 query blocks
    ([1, 5, 12], [(0, 7), (1, 0), (2, 0)], 6, 2, 96, True, (30, -1), 20.0, False),  # causal + left window, softcap
    ([1, 1, 1, 1], [(0, 0), (0, 1), (1, 3), (2, 0)], 32, 8, 128, True, (-1, -1), 0.0, False),  # one query each: packed
    ([16, 3], [(1, -1), (2, 1)], 4, 2, 256, True, (-1, -1), 10.0, False),  # d256: the 4-warp tile
    ([2, 9], [(0, 30), (1, 2)], 4, 1, 40, False, (-1, -1), 0.0, False),  # head_dim 40 padded to 48, MQA
]


def _varlen_paged_id(c):
    lens_q, lens_k, h, hk, d, causal, window, cap, alibi = c
    return (f"q{'.'.join(map(str, lens_q))}_h{h}/{hk}_d{d}{'_causal' if causal else ''}"
            f"{'' if window == (-1, -1) else f'_win{window[0]}.{window[1]}'}{f'_softcap{cap:g}' if cap else ''}"
            f"{'_alibi' if alibi else ''}")


def _varlen_paged(case, page_size, dtype=torch.float16, device="cuda", seed=None):
    """Packed q, page pools (each sequence's pages shuffled among spare pages of garbage; table entries past a
    sequence's last page -1, never read), cu_seqlens, the options, and the float64 truth per sequence."""
    lens_q, lens_k, h, hk, d, causal, window, cap, alibi = case
    lens_k = [pages * page_size + extra for pages, extra in lens_k]
    gen = torch.Generator(device=device).manual_seed(random.getrandbits(31) if seed is None else seed)
    rnd = lambda *s: torch.randn(*s, generator=gen, device=device).to(dtype)  # noqa: E731
    needed = [-(-n // page_size) for n in lens_k]
    width, num_pages = max(max(needed), 1) + 1, sum(needed) + 3
    order = torch.randperm(num_pages, generator=gen, device=device).tolist()
    table = torch.full((len(lens_q), width), -1, dtype=torch.int32)
    for b, n in enumerate(needed):
        table[b, :n] = torch.tensor([order.pop() for _ in range(n)], dtype=torch.int32)
    cu = lambda lens: torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32, device=device)  # noqa: E731
    c = dict(q=rnd(sum(lens_q), h, d), k_pages=rnd(num_pages, page_size, hk, d), v_pages=rnd(num_pages, page_size, hk, d),
             cu_q=cu(lens_q), cu_k=cu(lens_k), table=table.to(device), lens_q=lens_q, lens_k=lens_k,
             alibi=torch.rand(len(lens_q), h, generator=gen, device=device) * 0.5 if alibi else None)
    c["prm"] = AttentionOptions(softmax_scale=d**-0.5 * random.uniform(0.7, 1.3), causal=causal, window_left=window[0],
                                window_right=window[1], softcap=cap)
    return c


def _varlen_paged_truth(c):
    """float64 truth, PyTorch's fp16 yardstick (fp16 inputs) and float64 lse [H, total_q], sequence by sequence over
    its logical keys (gathered here from the pages by indexing, independently of kvcache / reference)."""
    prm, page = c["prm"], c["k_pages"].shape[1]
    truth, yard, lses = [], [], []
    for b, (n_q, n_k) in enumerate(zip(c["lens_q"], c["lens_k"])):
        q0 = int(c["cu_q"][b])
        pages = c["table"][b, : -(-n_k // page)].long()
        k_b = c["k_pages"][pages].flatten(0, 1)[:n_k][None]
        v_b = c["v_pages"][pages].flatten(0, 1)[:n_k][None]
        q_b = c["q"][q0 : q0 + n_q][None]
        kw = dict(causal=prm.causal, softmax_scale=prm.softmax_scale, window_size=(prm.window_left, prm.window_right),
                  alibi_slopes=c["alibi"][b : b + 1] if c["alibi"] is not None else None, softcap=prm.softcap)
        out64, lse64 = naive_attention(q_b, k_b, v_b, **kw)
        truth.append(out64[0])
        lses.append(lse64[0])
        if c["q"].dtype == torch.float16:
            yard.append(torch_fp16_attention(q_b, k_b, v_b, **kw)[0])
    return torch.cat(truth), torch.cat(yard) if yard else None, torch.cat(lses, dim=1)


def _kernel_paged_varlen(c, table="default", num_splits=None, poison=True):
    q = c["q"]
    kw = {"tile": tiles.decode_tile(_kernel_d(q), 70)} if table == "sm70" else {}
    if poison:
        kw.update(out=torch.full_like(q, float("nan")), partial_fill=float("nan"),
                  lse=torch.full((q.shape[1], q.shape[0]), float("nan"), device=q.device))
    return decode.forward_paged_varlen(q, c["k_pages"], c["v_pages"], c["cu_q"], c["cu_k"], c["table"],
                                       max(c["lens_q"]), max(c["lens_k"]), c["prm"], c["alibi"],
                                       num_splits=num_splits, **kw)


def _check_varlen_paged(c, out, lse, what=""):
    """out / lse against the float64 truth: flash-attn's standard (fp16 inputs) or 1e-9 (float64), key-less rows
    exactly 0 with lse +inf, lse within 2e-3."""
    truth, yard, lse64 = _varlen_paged_truth(c)
    assert torch.isfinite(out).all() and not torch.isnan(lse).any(), f"{what}: NaN / inf in out or NaN in lse"
    if yard is not None:
        e = error_vs_yardstick(out, yard, truth)
        assert e.ok, f"{what}: {e}"
    else:
        assert torch.allclose(out, truth, rtol=1e-9, atol=1e-9), what
    empty = torch.isinf(lse64)
    assert torch.equal(torch.isposinf(lse), empty), f"{what}: lse must be +inf exactly on the key-less rows"
    keyless = empty.t()
    assert torch.equal(out[keyless], torch.zeros_like(out[keyless])), f"{what}: key-less rows must be exactly 0"
    seen = ~empty
    err = (lse[seen].double() - lse64[seen]).abs().max().item() if seen.any() else 0.0
    assert err <= 2e-3 * max(1.0, lse64[seen].abs().max().item() if seen.any() else 1.0), f"{what}: lse error {err}"


@pytest.mark.parametrize("page_size", [256, 512])
@pytest.mark.parametrize("case", VARLEN_PAGED_CASES, ids=_varlen_paged_id)
def test_varlen_paged_python_side_with_an_emulated_kernel(case, page_size, emulated_kernel):
    """decode.forward_paged_varlen on the emulated kernel: packed q / o / lse strides, seqused_k from cu_seqlens_k,
    the block table, the padded partials and the combine's per-sequence rows, the one-query-per-sequence packing."""
    c = _varlen_paged(case, page_size, device="cpu")
    for num_splits in (1, 3, None):
        out, lse = _kernel_paged_varlen(c, num_splits=num_splits)
        _check_varlen_paged(c, out, lse, what=f"emulated num_splits={num_splits}")


def _spy(monkeypatch, owner, name):
    calls = []
    real = getattr(owner, name)

    def spy(*args, **kwargs):
        calls.append(name)
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, spy)
    return calls


def _api(c, grad=False, **kw):
    q = c["q"].clone().requires_grad_(grad)
    return volta_train.flash_attn_varlen_func(q, c["k_pages"], c["v_pages"], c["cu_q"], c["cu_k"], max(c["lens_q"]),
                                              max(c["lens_k"]), softmax_scale=c["prm"].softmax_scale,
                                              causal=c["prm"].causal, window_size=(c["prm"].window_left,
                                                                                   c["prm"].window_right),
                                              softcap=c["prm"].softcap, alibi_slopes=c["alibi"], block_table=c["table"],
                                              return_attn_probs=True, **kw)


@pytest.mark.parametrize("page_size", [256, 512])
@pytest.mark.parametrize("case", VARLEN_PAGED_CASES, ids=_varlen_paged_id)
def test_varlen_paged_reference_and_gather_paths_equal_float64(case, page_size, monkeypatch):
    """CPU, float64: without gradients the reference backend reads each sequence's pages (no gather); with them the
    pages are gathered and the call runs packed; both equal float64 attention over the logical keys (and each other),
    the gradient reaching only the used pages."""
    c = _varlen_paged(case, page_size, dtype=torch.float64, device="cpu")
    gathers = _spy(monkeypatch, kvcache, "gather_paged_varlen")
    pages_read = _spy(monkeypatch, reference, "reference_paged_varlen_forward")
    out_r, lse_r, _ = _api(c)
    assert pages_read and not gathers, "no gradient: the reference backend reads the pages itself"
    _check_varlen_paged(c, out_r, lse_r, what="reference, paged")
    c["k_pages"].requires_grad_(True)
    out_g, lse_g, _ = _api(c, grad=True)
    assert gathers == ["gather_paged_varlen"] and len(pages_read) == 1, "gradients: the gather path"
    _check_varlen_paged(c, out_g.detach(), lse_g, what="gather")
    assert torch.allclose(out_r, out_g.detach(), rtol=1e-12, atol=1e-12) and torch.equal(lse_r.isinf(), lse_g.isinf())
    out_g.sum().backward()
    used = {int(p) for p in c["table"].flatten() if p >= 0}
    unused = sorted(set(range(c["k_pages"].shape[0])) - used)
    assert not c["k_pages"].grad[unused].any()


def test_varlen_paged_routes_and_their_log(monkeypatch, caplog):
    """Which path a paged varlen call takes, logged once with its reason: dropout and gradients gather; no gradient
    reads the pages (reference backend on the CPU); VOLTA_TRAIN_BACKEND=kernel on the CPU gathers and then refuses;
    sinks fold into the paged path's output as into the gather path's."""
    import logging

    from volta_train import dispatch

    monkeypatch.setattr(dispatch, "_logged_reasons", set())
    c = _varlen_paged(VARLEN_PAGED_CASES[0], 256, dtype=torch.float64, device="cpu")
    gathers = _spy(monkeypatch, kvcache, "gather_paged_varlen")
    with caplog.at_level(logging.INFO, logger="volta_train"):
        _api(c, dropout_p=0.1)
        assert len(gathers) == 1
        with torch.no_grad():
            _api(c, grad=True)
        _api(c)
        assert len(gathers) == 1, "no gradient (grad mode off, or no input requiring one): the pages are read"
    lines = [r.getMessage() for r in caplog.records if "varlen with block_table" in r.getMessage()]
    assert any("gather backend (dropout_p=0.1: the paged path has no dropout)" in line for line in lines), lines
    assert sum("reference backend" in line for line in lines) == 1, lines  # the same reason: logged once
    sinks = torch.randn(c["q"].shape[1], dtype=torch.float32)
    out_s, lse_s, _ = _api(c, sinks=sinks)
    out_gs, lse_gs, _ = _api(c, grad=True, sinks=sinks)
    assert torch.allclose(out_s, out_gs.detach(), rtol=1e-12, atol=1e-12) and torch.allclose(lse_s, lse_gs)
    monkeypatch.setenv("VOLTA_TRAIN_BACKEND", "kernel")
    with pytest.raises(dispatch.BackendUnavailableError, match="needs a CUDA GPU"):
        _api(c)


def test_varlen_paged_kernel_capability(monkeypatch):
    """support.unsupported_reason of a paged varlen call (a faked V100 with NVRTC): the decoding kernel takes fp32
    accumulation, one head_dim for q/k/v and pages of whole key blocks; every other call goes to the gather path."""
    import dataclasses

    from volta_train import kernels
    from volta_train.kernels import support

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 0))
    monkeypatch.setattr(support, "_compiler_problem", lambda arch: None)
    q = torch.empty(10, 8, 64, device="meta")
    pages = torch.empty(4, 256, 2, 64, device="meta")
    call = kernels.describe(q, pages, pages, AttentionOptions(softmax_scale=0.1), varlen=True, alibi=False,
                            page_block_size=256)
    call = dataclasses.replace(call, device=torch.device("cuda", 0), dtype=torch.float16, aligned=True)
    assert kernels.unsupported_reason(call) is None
    fp16 = dataclasses.replace(call, options=AttentionOptions(softmax_scale=0.1, accum="fp16"))
    assert "accum='fp16': the decoding kernel that reads pages accumulates in fp32" in kernels.unsupported_reason(fp16)
    assert "v_cache's head_dim 32 differs" in kernels.unsupported_reason(dataclasses.replace(call, value_head_dim=32))
    block_n = tiles.decode_tile(64, 70).block_n
    odd = dataclasses.replace(call, page_block_size=block_n + block_n // 2)
    assert f"reads key blocks of {block_n} within one page" in kernels.unsupported_reason(odd)
    assert kernels.unsupported_reason(dataclasses.replace(call, page_block_size=0)) is None  # (not a paged call)


@pytest.mark.gpu
@pytest.mark.parametrize("table", TABLES)
@pytest.mark.parametrize("page_size", [256, 512])
@pytest.mark.parametrize("case", VARLEN_PAGED_CASES, ids=_varlen_paged_id)
def test_varlen_paged_kernel_matches_float64_and_the_gather_path(case, page_size, table):
    """The GPU kernel reading pages (outputs and split partials NaN-poisoned; one split, three, the rule's) meets
    flash-attn's standard against float64, and agrees with the gather path (the varlen forward kernel on gathered
    keys) within 6e-3 of the output's scale, lse within 1e-3."""
    _gpu()
    from volta_train.kernels import launch

    c = _varlen_paged(case, page_size)
    k, v = kvcache.gather_paged_varlen(c["k_pages"], c["v_pages"], c["table"], c["lens_k"])
    out_g, lse_g = launch.forward(c["q"], k, v, c["cu_q"], c["cu_k"], max(c["lens_q"]), max(c["lens_k"]), c["prm"],
                                  c["alibi"])
    scale = max(1.0, out_g.float().abs().max().item())
    for num_splits in (1, 3, None):
        out, lse = _kernel_paged_varlen(c, table, num_splits)
        what = f"{table} splits={num_splits}"
        _check_varlen_paged(c, out, lse, what=what)
        assert (out.float() - out_g.float()).abs().max().item() <= 6e-3 * scale, f"{what}: kernel vs gather path"
        assert torch.equal(torch.isposinf(lse), torch.isposinf(lse_g)), what
        seen = torch.isfinite(lse)
        assert (lse[seen] - lse_g[seen]).abs().max().item() <= 1e-3 * max(1.0, lse_g[seen].abs().max().item()), what


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 1, 5])
def test_varlen_paged_kernel_repeats_bitwise(num_splits):
    _gpu()
    c = _varlen_paged(VARLEN_PAGED_CASES[0], 256)
    first = _kernel_paged_varlen(c, num_splits=num_splits)
    for _ in range(3):
        again = _kernel_paged_varlen(c, num_splits=num_splits)
        assert all(torch.equal(a, b) for a, b in zip(first, again))


@pytest.mark.gpu
@pytest.mark.parametrize("case", VARLEN_PAGED_CASES[:4], ids=_varlen_paged_id)
def test_varlen_paged_api_runs_the_kernel_without_gradients(case, monkeypatch):
    """volta_train.flash_attn_varlen_func with a block_table: without gradients the decoding kernel runs (the pages
    are not gathered) and meets the standard; with them the pages are gathered, the varlen kernels run forward and
    backward, and the forward agrees with the kernel path's."""
    _gpu()
    from volta_train import kernels

    monkeypatch.setenv("VOLTA_TRAIN_BACKEND", "kernel")
    c = _varlen_paged(case, 256)
    gathers = _spy(monkeypatch, kvcache, "gather_paged_varlen")
    paged = _spy(monkeypatch, kernels, "forward_paged_varlen")
    out, lse, _ = _api(c)
    assert paged == ["forward_paged_varlen"] and not gathers, "no gradient: the decoding kernel reads the pages"
    _check_varlen_paged(c, out, lse, what="api kernel path")
    c["k_pages"].requires_grad_(True)
    out_g, lse_g, _ = _api(c, grad=True)
    assert gathers and len(paged) == 1, "gradients: the gather path"
    scale = max(1.0, out_g.float().abs().max().item())
    assert (out.float() - out_g.detach().float()).abs().max().item() <= 6e-3 * scale
    out_g.float().sum().backward()
    assert torch.isfinite(c["k_pages"].grad).all()


# --- the decoding benchmark's arithmetic (CPU) -----------------------------------------------------------------------


def _bench_decode():
    import importlib.util
    path = ROOT / "scripts" / "bench_decode.py"
    spec = importlib.util.spec_from_file_location("bench_decode", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_bench_decode_counts_and_table():
    bench = _bench_decode()
    assert bench.decode_flops(8, 32, 4096, 128) == 4 * 8 * 32 * 4096 * 128
    assert bench.kv_bytes(8, 8, 4096, 128) == 2 * 8 * 8 * 4096 * 128 * 2  # K and V, fp16, read once
    assert bench.input_sets_for(2 * 2**20, 100.0) == 50 and bench.input_sets_for(2**30, 100.0) == 1
    assert bench.input_sets_for(1.0, 100.0) == 64
    args = bench.build_parser().parse_args(["--seqlens", "1024", "--batches", "1"])
    assert args.kv_heads == [8, 32] and args.head_dims == [64, 128] and args.heads == 32
    row = dict(batch=1, heads=32, kv_heads=8, head_dim=128, seqlen_q=1, seqlen_k=1024, page=256,
               backend="volta-kernel-paged", splits=16, ms=0.0125, ms_stream=0.01,
               tflops=bench.decode_flops(1, 32, 1024, 128) / 0.0125 / 1e9,
               gbps=bench.kv_bytes(1, 8, 1024, 128) / 0.0125 / 1e6, max_abs=1.5e-4, note="")
    table = bench.markdown([row], args, {"gpu": "test"})
    assert ("| 1 | 32 | 8 | 128 | 1 | 1024 | 256 | volta-kernel-paged | 16 | 0.0125 | 0.0100 | 1.34 | 336 | 1.5e-04 |  |"
            in table), table
    assert args.page_sizes == [] and not args.varlen_paged and args.varlen_q == [1, 16]
    assert args.burst == 20 and "volta-kernel-device-checks" in args.backends
    assert bench.main(["--kv-heads", "5"]) == 2  # no GPU here, or 5 does not divide 32: refused either way


def test_bench_decode_paged_inputs_hold_the_same_keys():
    """bench_decode.py's paged layout: every logical key of every sequence where the block table says, in the
    shuffled pools; the varlen case's packed queries and cumulative lengths."""
    bench = _bench_decode()
    case = dict(q=torch.randn(3, 1, 4, 16).half(), k_cache=torch.randn(3, 70, 2, 16).half(),
                v_cache=torch.randn(3, 70, 2, 16).half())
    p = bench.paged(case, 32, torch.Generator().manual_seed(1))
    assert p["block_table"].shape == (3, 3) and sorted(p["block_table"].flatten().tolist()) == list(range(9))
    for name in ("k_cache", "v_cache"):
        logical = p[name][p["block_table"].long()].flatten(1, 2)[:, :70]
        assert torch.equal(logical, case[name])
    v = bench.varlen_case(p, 5, 69)
    assert v["q_packed"].shape == (15, 4, 16) and v["cu_q"].tolist() == [0, 5, 10, 15]
    assert v["cu_k"].tolist() == [0, 69, 138, 207]
