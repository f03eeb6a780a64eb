"""The dK/dV kernel's shared-memory tile layouts (csrc/kernel_traits.cuh TileRows / TileVector, issue 16): the
Python mirror (lab/bank_model.py bwd_layouts / fwd_layouts) against the C++ constants, and, per tile,
the writer's and every reader's addresses as csrc/ computes them (including the readers' per-lane base + per-tile
step decompositions): distinct, in bounds, disjoint from the other tiles, and the readers read what the writers
wrote."""

import re

import pytest

import bank_model as bm
from volta_train.kernels import tiles


def _next_bwd_variants():
    """The dK/dV variants of the tiles the V100 table takes next (tiles.BWD_TILES_SM70_NEXT), with and without atomics."""
    return [tiles.bwd_variant(d, tile, f16, False, atomic, False) for d, tile in tiles.BWD_TILES_SM70_NEXT.items()
            for f16 in (False, True) for atomic in (True, False)]


def _variants(pass_name: str, traits_name: str):
    """(variant, traits expression) of every distinct shipped traits instance of one kernel, both tables, and of the
    V100 table's next tiles."""
    seen, out = set(), []
    for arch in (70, 90):
        shipped = tiles.shipped_fwd_variants(arch, softcap=(False,)) + tiles.shipped_bwd_variants(arch, softcap=(False,))
        for v in shipped + (_next_bwd_variants() if arch == 70 else []):
            if v.meta["pass"] != pass_name:
                continue
            traits = re.search(rf"<({traits_name}<.*>)>$", v.name_expressions[0]).group(1)
            if traits not in seen:
                seen.add(traits)
                out.append((v, traits))
    return out


def _dkdv_variants():
    return _variants("bwd_dkdv", "BwdKernelTraits")


def _dq_variants():
    return _variants("bwd_dq", "FwdKernelTraits")


def _fwd_variants():
    return _variants("fwd", "FwdKernelTraits")


def _dq_shape(v) -> bm.FwdShape:
    t = v.meta["tile"]
    return bm.FwdShape(v.meta["head_dim"], t.quad_pair_rows, t.m_tiles, t.warps, t.block_n, False, t.q_in_smem,
                       t.split_masked)


def _shape(v) -> bm.BwdShape:
    t = v.meta["tile"]
    return bm.bwd_tile_shape(t, v.meta["head_dim"], "_dqatomic" in v.name, v.meta["accum_f16"])


# --- the C++ constants against the mirror (NVRTC static_asserts; no GPU) ---------------------------------------------

_ROW_TILES = {"q": "QRows", "do": "QRows", "qt": "QtRows", "dot": "QtRows", "kt": "KtRows", "ds": "DsRows",
              "k": "KvRows", "v": "KvRows"}
_OFFSETS = {"q": "kOffQ", "do": "kOffDo", "qt": "kOffQt", "dot": "kOffDot", "kt": "kOffKt", "ds": "kOffDs",
            "k": "kOffK", "v": "kOffV", "lse": "kOffLse", "dsum": "kOffDsum"}


def _rows_assert(rows_type: str, lay, count: int, what: str) -> str:
    """static_assert that the TileRows `rows_type` starts its first `count` rows where the mirror's layout does."""
    want = ", ".join(str(lay.row_chunk(r) * 8) for r in range(count))
    return f'static_assert(rows_are<{rows_type}>({{{want}}}), "{what}");'


def _key_tile_asserts(traits: str, s, vt, name: str) -> list[str]:
    """static_asserts of FwdKernelTraits' K / V rows (KRows) and V^T / K^T rows (VtRows) against the mirror."""
    k = bm.fwd_layouts(s, "fwd")["k"]
    return [_rows_assert(f"{traits}::KRows", k, s.block_n, f"{name}: K rows"),
            f'static_assert({traits}::kTileBytes == {16 * k.chunks(s.block_n)}, "{name}: kTileBytes");',
            _rows_assert(f"{traits}::VtRows", vt, s.head_dim, f"{name}: V^T rows"),
            f'static_assert({traits}::kVtTileBytes == {16 * vt.chunks(s.head_dim)}, "{name}: kVtTileBytes");']


def test_traits_layouts_equal_the_mirror():
    from volta_train.kernels import nvrtc
    from volta_train.kernels.variants import csrc_dir
    try:
        nvrtc.find_nvrtc(70)
    except Exception as error:  # noqa: BLE001 - no NVRTC here: nothing to compile with
        pytest.skip(f"no libnvrtc for sm_70: {error}")
    lines = ['#include "flash_bwd_dq_kernel.cuh"', '#include "flash_fwd_kernel.cuh"',
             "template <class R, int N> __host__ __device__ constexpr bool rows_are(const int (&want)[N]) {",
             "    for (int r = 0; r < N; ++r) if (R::offset(r) != want[r]) return false;",
             "    return true;", "}",
             "template <class V, int N> __host__ __device__ constexpr bool vector_is(const int (&want)[N]) {",
             "    for (int i = 0; i < N; ++i) if (V::index(i) != want[i]) return false;",
             "    return true;", "}"]
    for n, (v, traits) in enumerate(_dkdv_variants()):
        s = _shape(v)
        L = bm.bwd_layouts(s)
        rows = bm.bwd_tile_rows(s)
        lines.append(f"using KT{n} = {traits};")
        lines.append(f'static_assert(KT{n}::kSmemBytes == {bm.variant_smem_bytes(v)}, "{v.name}: kSmemBytes");')
        lines.append(f"static_assert(KT{n}::kDqWarps == {s.dq_warps} && KT{n}::kDqRowsPerWarp == {s.dq_rows_per_warp} && "
                     f'KT{n}::kDqColWarps == {s.dq_col_warps}, "{v.name}: the dQ warps");')
        for name, count in rows.items():
            lay = L[name]
            lines.append(f'static_assert(KT{n}::{_OFFSETS[name]} == {lay.base}, "{v.name}: {name} base");')
            if isinstance(lay, bm.VectorLayout):
                want = ", ".join(str((lay.addr(i) - lay.base) // 4) for i in range(count))
                lines.append(f'static_assert(vector_is<KT{n}::Vector>({{{want}}}), "{v.name}: {name}");')
            else:
                want = ", ".join(str((lay.addr(r, 0) - lay.base) // 2) for r in range(count))
                lines.append(f'static_assert(rows_are<KT{n}::{_ROW_TILES[name]}>({{{want}}}), "{v.name}: {name}");')
    for n, (v, traits) in enumerate(_dq_variants()):
        s = _dq_shape(v)
        L = bm.fwd_layouts(s, "dq")
        lines.append(f"using DT{n} = {traits};")
        lines.append(f'static_assert(DqLayout<DT{n}>::kBytes == {bm.variant_smem_bytes(v)}, "{v.name}: kBytes");')
        lines += _key_tile_asserts(f"DT{n}", s, L["kt"], v.name)
        lines.append(_rows_assert(f"DT{n}::QRows", L["q"], s.block_m, f"{v.name}: Q / dO rows"))
        lines.append(_rows_assert(f"DT{n}::OStageRows", L["o_stage"], s.block_m, f"{v.name}: dQ staging rows"))
    for n, (v, traits) in enumerate(_fwd_variants()):
        s = _dq_shape(v)
        L = bm.fwd_layouts(s, "fwd")
        lay = L["q"]
        lines.append(f"using FT{n} = {traits};")
        lines.append(f'static_assert(FT{n}::kSmemBytes == {bm.variant_smem_bytes(v)}, "{v.name}: kSmemBytes");')
        lines += _key_tile_asserts(f"FT{n}", s, L["vt"], v.name)
        lines.append(_rows_assert(f"FT{n}::OStageRows", L["o_stage"], s.block_m, f"{v.name}: O staging rows"))
        if s.q_in_smem:
            lines.append(f'static_assert(FT{n}::kTileBytes + FT{n}::kVtTileBytes == {lay.base}, "{v.name}: Q base");')
            lines.append(_rows_assert(f"FT{n}::QRows", lay, s.block_m, f"{v.name}: Q rows"))
    lines.append("__global__ void layout_check_kernel() {}")
    # (for sm_90: the emulated table's d128 tile exceeds the V100's 96 KB, which only sm_70 builds assert)
    nvrtc.compile_program("\n".join(lines) + "\n", ["layout_check_kernel"], 90, (), [csrc_dir()],
                          "layout_check.cu")


# --- every writer and reader of each tile, as csrc/ computes the addresses ---------------------------------------------


def _op_row(lane):
    return bm.operand_row(lane)


def _lanes(s):
    for tid in range(s.threads):
        yield tid, tid & 31


def _writes(s, L):
    """(tile, row, half column) -> address of every 16-byte store of the query block's loaders and the prologue
    (load_rows_and_transpose, load_kv_operand, the dS transposes); lse / dsum as (tile, element, 0)."""
    out = {}

    def put(key, addr):
        assert key not in out, f"{key} written twice"
        out[key] = addr

    cpr = s.head_dim // 8

    def rows_and_transpose(rows_n, rows, trans, trans_cols):
        for chunk in range(rows_n * cpr):
            group8 = chunk >> 3
            row, col = 8 * (group8 // cpr) + (chunk & 7), (group8 % cpr) * 8
            if rows:
                put((rows, row, col), L[rows].addr(row, col))
            if trans and col < trans_cols:  # after the 8x8 transpose: column col + (chunk & 7), rows (row & ~7) .. + 7
                # (split tiles: the columns of slice 0; another slice's are these, moved by its first column)
                d = col + (chunk & 7)
                if (trans, d, row & ~7) not in out:
                    put((trans, d, row & ~7), L[trans].addr(d, row & ~7))

    rows_and_transpose(s.block_m, "q", None if s.dkdv_row_b else "qt", s.out_dim)
    rows_and_transpose(s.block_m, "do", None if s.dkdv_row_b else "dot", s.out_dim)
    if s.dq_atomic:
        if not s.dq_k_rows:
            rows_and_transpose(s.block_n, None, "kt", s.head_dim)
        for tid, lane in _lanes(s):  # dS^T -> dS: key_in_block is the quad-pair's 8-key tile
            for nt in range(s.s_tiles):
                q = s.stile_q0(lane, 0, nt) + _op_row(lane)
                put(("ds", q, s.key_in_block(tid)), L["ds"].addr(q, s.key_in_block(tid)))
    if s.kv_in_smem:
        for name in ("k", "v"):
            for chunk in range(s.block_n * cpr):
                row, col = chunk // cpr, chunk % cpr * 8
                put((name, row, col), L[name].addr(row, col))
    for name in ("lse", "dsum"):
        for i in range(s.block_m):
            put((name, i, 0), L[name].addr(i))
    return out


def _reads(s, L):
    """(tile, row, half column, address) of every 16-byte load (lse / dsum: 4-byte elements) of the query block, the
    addresses computed the way csrc/flash_bwd_kernel.cuh does (per-lane base plus the offset of a per-tile step
    where the code adds one)."""
    def off(name, row):
        lay = L[name]
        return lay.base + 16 * lay.row_chunk(row)

    def step(name, rows):  # TileRows::offset(rows) in bytes, no base
        return 16 * L[name].row_chunk(rows)

    for tid, lane in _lanes(s):
        qp_n = s.qp_mn(lane)[1]
        for b_name in ("q", "do"):  # bwd_rows_times_tile: QRows::offset(stile_q0(0, nt) + operand_row()) + 8 kk
            for nt in range(s.s_tiles):
                row = s.stile_q0(lane, 0, nt) + _op_row(lane)
                for kk in range(s.head_dim // 8):
                    yield b_name, row, 8 * kk, off(b_name, row) + 16 * kk
        if s.kv_in_smem:  # KvOperand: tile_row = KvRows::offset(key) + 8 kk
            row = s.key_in_block(tid) + _op_row(lane)
            for name in ("k", "v"):
                for kk in range(s.head_dim // 8):
                    yield name, row, 8 * kk, off(name, row) + 16 * kk
        for name in ("lse", "dsum"):  # padded: Vector::index(the pair's even query) + (i & 1), else the query
            for nt in range(s.s_tiles):
                for i in range(8):
                    q = s.stile_q0(lane, 0, nt) + bm.acc_col(lane, i)
                    pad = L[name].pad
                    even = s.stile_q0(lane, 0, nt) + bm.acc_col(lane, i & ~1)
                    index = even + pad * (even >> 5) + (i & 1) if pad else q
                    yield name, q, 0, L[name].base + 4 * index
        # bwd_frags_times_rows (dkdv_row_b): cols = rows tile + o_col(0, 0) (the column slot) + 8 hi, then
        # QRows::offset(q0 + t) and QRows::offset(q0 + 4 + t), + 16 j
        for b_name in ("do", "q") if s.dkdv_row_b else ():
            col0 = ((qp_n & 1) * 2 + (qp_n >> 1)) * s.o_cols + 8 * (lane >> 4)
            for j in range(s.o_tiles // 2):
                for x in range(s.qp_cols):
                    for nt in range(s.s_tiles):
                        for half in (0, 4):
                            row = s.stile_q0(lane, x, nt) + half + (lane & 3)
                            yield b_name, row, col0 + 16 * j, off(b_name, row) + 2 * (col0 + 16 * j)
        # bwd_frags_times_tile: bt_rows = QtRows::offset(lane's row), + offset(8 ot)
        for bt in ("qt", "dot") if not s.dkdv_row_b else ():
            base_row = qp_n * s.o_cols + _op_row(lane)
            for ot in range(s.o_tiles):
                for x in range(s.qp_cols):
                    for nt in range(s.s_tiles):
                        q0 = s.stile_q0(lane, x, nt)
                        yield bt, base_row + 8 * ot, q0, off(bt, base_row) + step(bt, 8 * ot) + 2 * q0
        # bwd_dq_atomic, on the first kDqWarps warps: a_row = DsRows::offset(row0 + operand_row()); b_rows +
        # KtRows::offset(8 ot)
        if s.dq_atomic and tid < 32 * s.dq_warps:
            dq_cols = s.dq_cols_per_quad_pair
            row0, col0 = s.dq_origin(tid)
            a_row = row0 + _op_row(lane)
            b_row = col0 + _op_row(lane)
            for kc in range(s.block_n // 8):
                yield "ds", a_row, 8 * kc, off("ds", a_row) + 16 * kc
                if s.dq_k_rows:  # b_rows = KvRows::offset(t) + col0 + 8 hi, + KvRows::offset(8 kc (+ 4)) + 16 j
                    for j in range(dq_cols // 16):
                        for k_step in (0, 4):
                            row, col = 8 * kc + k_step + (lane & 3), col0 + 16 * j + 8 * (lane >> 4)
                            yield "k", row, col, off("k", lane & 3) + step("k", 8 * kc + k_step) + 2 * col
                    continue
                for ot in range(dq_cols // 8):
                    yield "kt", b_row + 8 * ot, 8 * kc, off("kt", b_row) + step("kt", 8 * ot) + 16 * kc


@pytest.mark.parametrize("variant,traits", _dkdv_variants(), ids=lambda x: getattr(x, "name", None) or "")
def test_readers_read_what_writers_wrote(variant, traits):
    s = _shape(variant)
    L = bm.bwd_layouts(s)
    smem = bm.variant_smem_bytes(variant)
    writes = _writes(s, L)
    # every write in bounds, the 16-byte chunks (4-byte elements) distinct
    owner = {}
    for key, addr in writes.items():
        width = 4 if key[0] in ("lse", "dsum") else 16
        assert 0 <= addr and addr + width <= smem, (key, addr, smem)
        assert addr % width == 0, (key, addr)
        for b in range(addr, addr + width, 4):
            assert b not in owner, f"{key} overlaps {owner[b]} at byte {b}"
            owner[b] = key
    # every read hits exactly a written chunk of its tile at its (row, column)
    n = 0
    for name, row, col, addr in _reads(s, L):
        key = (name, row, col)
        if name in ("qt", "dot"):  # transposed writes are keyed by their first query (col & ~7)
            key = (name, row, col & ~7)
            addr -= 2 * (col & 7)
        assert key in writes, f"{name} row {row} col {col} read, never written"
        assert writes[key] == addr, f"{name} row {row} col {col}: read at {addr}, written at {writes[key]}"
        n += 1
    assert n > 0


def test_plain_layout_is_the_old_one_and_1x4_layout_is_the_sm70_design():
    s = bm.BwdShape(64, 1, 8, 64, dq_atomic=True)
    plain = bm.bwd_layouts(s, plain=True)
    assert bm.bwd_smem_bytes(s, plain) == 55808  # the traits before issue 16
    L = bm.bwd_layouts(s)
    assert L["q"].gaps == ((4, 4),) and L["qt"].pitch == 10 and L["lse"].pad == 4 and L["kt"].gaps == ((3, 2),)
    tile = tiles.BwdTile(quad_pair_rows=1, warps=8, block_m=64)
    assert bm.bwd_smem_bytes(s, L) == bm.bwd_tile_smem_bytes(tile, 64, True) == 59264


@pytest.mark.parametrize("variant,traits", [vt for vt in _dq_variants() + _fwd_variants() if vt[0].meta["tile"].q_in_smem],
                         ids=lambda x: getattr(x, "name", None) or "")
def test_q_tiles_read_what_load_q_wrote(variant, traits):
    """load_q's row-major stores against QOperand::chunk's loads (tile_row = QRows::offset(the lane's row of
    m-tile 0), + offset(a * 8 * kQuadPairRows) + 8 kk), for the forward's Q and the dQ kernel's Q and dO."""
    s = _dq_shape(variant)
    kernel = "fwd" if variant.meta["pass"] == "fwd" else "dq"
    L = bm.fwd_layouts(s, kernel)
    names = ("q",) if kernel == "fwd" else ("q", "do")
    smem, cpr = bm.variant_smem_bytes(variant), s.head_dim // 8
    writes = {}
    for name in names:
        for chunk in range(s.block_m * cpr):
            row, col = chunk // cpr, chunk % cpr * 8
            addr = L[name].addr(row, col)
            assert 0 <= addr and addr + 16 <= smem
            writes[(name, row, col)] = addr
    assert len(set(writes.values())) == len(writes)
    before = L["vt"].base + 16 * L["vt"].chunks(s.head_dim) if kernel == "fwd" else L["v"].base + 16 * L["v"].chunks(s.block_n)
    assert min(writes.values()) >= before  # after K and V^T (forward), after K, K^T and V (dQ kernel)
    for tid in range(s.threads):
        lane = tid & 31
        row0 = s.mtile_row0(tid, 0) + bm.operand_row(lane)
        for name in names:
            lay = L[name]
            tile_row = lay.base + 16 * lay.row_chunk(row0)
            for a in range(s.m_tiles):
                row = s.mtile_row0(tid, a) + bm.operand_row(lane)
                for kk in range(cpr):
                    addr = tile_row + 16 * lay.row_chunk(a * 8 * s.quad_pair_rows) + 16 * kk
                    assert writes[(name, row, 8 * kk)] == addr, (name, tid, a, kk)


def test_split_tiles_transpose_their_slice_in_warp_uniform_branches():
    """load_rows_and_transpose with a column range (split dK/dV tiles): the transposes' shuffles run only where the
    chunk is in the slice, so every warp's chunks of one iteration must be all in or all out of it, for every
    slice; and the slices together transpose every column once."""
    split = [v for v, _ in _dkdv_variants() if v.meta["tile"].out_split > 1]
    assert split, "no shipped split tile (head_dim 256)"
    for v in split:
        s = _shape(v)
        cpr, out_chunks = s.head_dim // 8, s.out_dim // 8
        n = s.block_m * cpr
        covered = []
        for c in range((n + s.threads - 1) // s.threads):
            for w in range(s.warps):
                slices = {(((w * 32 + lane + c * s.threads) >> 3) % cpr) // out_chunks for lane in range(32)}
                assert len(slices) == 1, (v.name, c, w, slices)
            covered += [(chunk >> 3) % cpr for chunk in range(c * s.threads, min(n, (c + 1) * s.threads))]
        assert sorted(set(covered)) == list(range(cpr))
