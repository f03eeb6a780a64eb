"""Offline model of the shared-memory bank conflicts of the Volta kernels (csrc/*.cuh); dependency-free.

Every warp-wide shared-memory access site of the kernels is reproduced per lane (the byte address each lane reads or
writes, as the kernel source computes it) for one traits instance, and costed the way the hardware serves it:

* 32 banks of 4 bytes; within one *phase* a bank serves one 32-bit word per wavefront, lanes reading the same word
  share it (broadcast; stores to one word merge), so a phase takes max over banks of the distinct words in that bank;
* 32-bit accesses: one phase of 32 lanes; 64-bit: two phases (half-warps, lanes 0-15 and 16-31); 128-bit: four
  phases (quarter-warps of 8 lanes), so the minimum ("ideal") is 1, 2 and 4 wavefronts;
* a 64/128-bit access whose lanes pair up on one address (lane n and n ^ 1, or n and n ^ 2, for every lane) is
  served for the unique lanes only (half the phases: CC 7.x "uniform" rule);
* a phase without an active lane costs nothing; an instruction executed with no active lane counts as an instruction.

Sources for the rules: NVIDIA developer forums, "Clarification: bank_conflicts metric vs wavefronts for shared memory
LDS.128" (forums.developer.nvidia.com/t/359822: LDS.128 minimum 4 wavefronts of 128 bytes, bank conflicts = the
wavefronts beyond it) and "Unexpected shared memory bank conflict" (t/77228: the pair rule on CC 7.0-7.5); the
half-/quarter-warp phases are the usual reading of those (a phase moves at most 128 bytes). They are checked against
the Nsight Compute counts of lab/results/smem_conflicts_sm70_tiles_h100.md by lab/tests/test_smem_bank_model.py and
``lab/smem_bank_model.py --validate``.

Workload weights: the profiled one (batch 1, 8 heads, seqlen 1024, non-causal, every block full), so every CTA
runs every main-loop iteration alike and the model costs one CTA's warps per iteration.

Tile layouts (``RowLayout``): a tile is rows of 16-byte chunks; row r starts at chunk
``r * pitch + sum(gap * (r >> shift))`` (csrc/kernel_traits.cuh TileRows; plain padded rows: pitch = chunks per
row + 1, no gaps). ``bwd_layouts`` and ``fwd_layouts`` describe the kernels' code as it is. Every reader and writer
of a tile goes through the same layout. The layouts also give the shared memory of candidate tiles that were never
compiled (lab/v100_estimate.py); the package launches with the size each compiled kernel exports instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace

BANKS = 32
SEQLEN = 1024
HEADS = 8
BATCH = 1


# --- the hardware rule ---------------------------------------------------------------------------------------------


def _phase_wavefronts(addrs: list[int], width: int) -> int:
    """Wavefronts of one phase: max over banks of the distinct 32-bit words that fall into it."""
    words_per_bank: dict[int, set[int]] = {}
    for a in addrs:
        for w in range(a // 4, (a + width + 3) // 4):  # the words a `width`-byte access at a touches
            words_per_bank.setdefault(w % BANKS, set()).add(w)
    return max((len(s) for s in words_per_bank.values()), default=0)


def _paired(addrs: list[int | None], distance: int) -> bool:
    return all(a is None or addrs[n ^ distance] == a for n, a in enumerate(addrs))


def wavefronts(addrs: list[int | None], width: int, pair_rule: bool = True) -> tuple[int, int]:
    """(wavefronts, ideal wavefronts) of one warp-wide access: addrs[lane] is the byte address of lane's access
    (None: lane inactive), width its size in bytes (1, 2, 4, 8 or 16)."""
    if len(addrs) != 32:
        raise ValueError(f"addrs: one address per lane (32), got {len(addrs)}")
    if width not in (1, 2, 4, 8, 16):
        raise ValueError(f"width {width}: accepted 1, 2, 4, 8, 16 (bytes)")
    if all(a is None for a in addrs):
        return 0, 0
    if width <= 4:
        groups = [list(range(32))]
    else:
        lanes = list(range(32))
        if pair_rule and any(_paired(addrs, d) for d in (1, 2)):
            d = 1 if _paired(addrs, 1) else 2
            lanes = [n for n in lanes if not n & d]  # the unique lanes
        per = 128 // width  # lanes per phase: 16 (64-bit) or 8 (128-bit)
        groups = [lanes[i:i + per] for i in range(0, len(lanes), per)]
    wf = ideal = 0
    for g in groups:
        active = [addrs[n] for n in g if addrs[n] is not None]
        if active:
            wf += _phase_wavefronts(active, width)
            ideal += 1
    return wf, ideal


# --- lane geometry (csrc/mma_sm70.cuh) -------------------------------------------------------------------------------


def qp_of(lane: int) -> int:
    return (lane >> 2) & 3


def operand_row(lane: int) -> int:
    return (lane & 3) + 4 * (lane >> 4)


def staging_lane(lane: int) -> int:
    """The lane whose row fragment a lane stores in the epilogues (mma_sm70.cuh staging_lane): lanes 4-7 trade with
    16-19 and 12-15 with 24-27, so that each quarter-warp stores the 8 rows of one quad-pair's tile."""
    return lane ^ 20 if ((lane >> 2) & 1) != (lane >> 4) else lane


def acc_row(lane: int, i: int) -> int:
    return (lane & 1) + (i & 2) + 4 * (lane >> 4)


def acc_col(lane: int, i: int) -> int:
    return (i & 4) + (lane & 2) + (i & 1)


# --- tile layouts ---------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RowLayout:
    """A tile of rows of 16-byte chunks at byte offset `base`: row r starts at chunk
    r * pitch + sum(g * (r >> s) for s, g in gaps)."""

    base: int
    pitch: int  # chunks (16 bytes) per row step
    gaps: tuple[tuple[int, int], ...] = ()

    def row_chunk(self, row: int) -> int:
        return row * self.pitch + sum(g * (row >> s) for s, g in self.gaps)

    def addr(self, row: int, col: int) -> int:
        """Byte address of half `col` of row `row`."""
        return self.base + 16 * self.row_chunk(row) + 2 * col

    def chunks(self, rows: int) -> int:
        """Chunks the tile spans for `rows` rows (its size / 16)."""
        return self.row_chunk(rows - 1) + self.pitch if rows else 0


@dataclass(frozen=True)
class VectorLayout:
    """A float vector (lse / dsum of a query block) at `base`: element q at word q + pad * (q >> 5)."""

    base: int
    pad: int = 0

    def addr(self, q: int) -> int:
        return self.base + 4 * (q + self.pad * (q >> 5))

    def words(self, n: int) -> int:
        return n + self.pad * ((n - 1) >> 5) if n else 0


# --- accounting ------------------------------------------------------------------------------------------------------


@dataclass
class SiteCost:
    op: str  # "ld" or "st"
    width: int
    inst: int = 0
    wf: int = 0
    ideal: int = 0

    @property
    def factor(self) -> float:
        return self.wf / self.ideal if self.ideal else 1.0


@dataclass
class Prediction:
    kernel: str
    sites: dict[str, SiteCost] = field(default_factory=dict)
    smem_bytes: int = 0

    def add(self, site: str, op: str, width: int, warp_addrs: list[list[int | None]], times: int) -> None:
        """One execution by every warp of a CTA (warp_addrs[w][lane]), repeated `times` times per CTA."""
        cost = self.sites.setdefault(site, SiteCost(op, width))
        for addrs in warp_addrs:
            wf, ideal = wavefronts(addrs, width)
            cost.inst += times
            cost.wf += wf * times
            cost.ideal += ideal * times

    def scaled(self, ctas: int) -> "Prediction":
        out = Prediction(self.kernel, smem_bytes=self.smem_bytes)
        for name, c in self.sites.items():
            out.sites[name] = SiteCost(c.op, c.width, c.inst * ctas, c.wf * ctas, c.ideal * ctas)
        return out

    def totals(self, op: str) -> SiteCost:
        t = SiteCost(op, 0)
        for c in self.sites.values():
            if c.op == op:
                t.inst += c.inst
                t.wf += c.wf
                t.ideal += c.ideal
        return t


def _warps(threads: int, fn) -> list[list[int | None]]:
    """fn(tid) -> address or None, for every warp of the CTA."""
    return [[fn(w * 32 + lane) for lane in range(32)] for w in range(threads // 32)]


# --- shared helpers: loaders (csrc/tile_io.cuh) --------------------------------------------------------------------


def _load_rows_and_transpose(p: Prediction, name: str, rows_n: int, head_dim: int, threads: int,
                             rows: RowLayout | None, transposed: RowLayout | None, times: int,
                             transposed_cols: int | None = None) -> None:
    """transposed_cols: only head_dim columns [0, transposed_cols) are transposed (a split tile's slice 0; the
    warps of the other chunks skip the transposes)."""
    chunks_per_row = head_dim // 8
    transposed_cols = head_dim if transposed_cols is None else transposed_cols
    n_chunks = rows_n * chunks_per_row
    for c in range((n_chunks + threads - 1) // threads):
        def geo(tid):
            chunk = tid + c * threads
            group8 = chunk >> 3
            row = 8 * (group8 // chunks_per_row) + (chunk & 7)
            col = (group8 % chunks_per_row) * 8
            return chunk < n_chunks, chunk, row, col
        def transposed_addr(tid):
            ok, ch, r, col = geo(tid)
            return transposed.addr(col + (ch & 7), r & ~7) if ok and col < transposed_cols else None
        if rows is not None:
            p.add(f"{name}.rows", "st", 16,
                  _warps(threads, lambda tid: (lambda ok, ch, r, col: rows.addr(r, col) if ok else None)(*geo(tid))),
                  times)
        if transposed is not None:
            warp_addrs = _warps(threads, transposed_addr)
            if transposed_cols < head_dim:  # warps without a chunk of the slice branch around the store
                warp_addrs = [w for w in warp_addrs if any(a is not None for a in w)]
            p.add(f"{name}.transposed", "st", 16, warp_addrs, times)


def _chunk_rc(chunk: int, cpr: int, groups8: bool) -> tuple[int, int]:
    """(row, column) of a loader's chunk: row-major (chunk / cpr, chunk % cpr), or in groups of eight rows of one
    column chunk (load_v_block's order; `groups8`)."""
    if groups8:
        g = chunk >> 3
        return 8 * (g // cpr) + (chunk & 7), (g % cpr) * 8
    return chunk // cpr, chunk % cpr * 8


def _row_major_fill(p: Prediction, name: str, rows_n: int, head_dim: int, threads: int, tile: RowLayout,
                    times: int, loop: bool, groups8: bool = False) -> None:
    """store_kv_block / load_q / load_kv_operand: chunk -> (chunk / chunks_per_row, chunk % chunks_per_row) (or
    `groups8`, see _chunk_rc). loop: a `for (chunk = tid; chunk < n; chunk += threads)` loop (warps past the end
    skip it), else a fixed count of predicated iterations."""
    cpr = head_dim // 8
    n = rows_n * cpr
    for c in range((n + threads - 1) // threads):
        warp_addrs = _warps(threads, lambda tid: tile.addr(*_chunk_rc(tid + c * threads, cpr, groups8))
                            if tid + c * threads < n else None)
        if loop:
            warp_addrs = [w for w in warp_addrs if any(a is not None for a in w)]
        p.add(name, "st", 16, warp_addrs, times)


def _row_major_drain(p: Prediction, name: str, rows_n: int, head_dim: int, threads: int, tile: RowLayout,
                     times: int, groups8: bool = False) -> None:
    """The epilogues' `for (chunk = tid; ...)` reads of a staged tile, 16 bytes per chunk (order: _chunk_rc;
    groups8 only where a row is not a multiple of 8 chunks, as chunk_position in tile_io.cuh)."""
    cpr = head_dim // 8
    groups8 = groups8 and cpr % 8 != 0
    n = rows_n * cpr
    for c in range((n + threads - 1) // threads):
        warp_addrs = _warps(threads, lambda tid: tile.addr(*_chunk_rc(tid + c * threads, cpr, groups8))
                            if tid + c * threads < n else None)
        p.add(name, "ld", 16, [w for w in warp_addrs if any(a is not None for a in w)], times)


# --- forward-shaped kernels: flash_fwd_kernel and flash_bwd_dq_kernel (warp_tile.cuh) --------------------------------


class _QuadPairGeometry:
    """What the forward- and backward-shaped traits share (kernel_traits.cuh): quad-pair columns, threads, and the
    output columns (head_dim) per quad-pair column in 8-column tiles."""

    @property
    def qp_cols(self):
        return 4 // self.quad_pair_rows

    @property
    def threads(self):
        return 32 * self.warps

    @property
    def o_cols(self):
        return self.head_dim // self.qp_cols

    @property
    def o_tiles(self):
        return self.o_cols // 8


@dataclass(frozen=True)
class FwdShape(_QuadPairGeometry):
    head_dim: int
    quad_pair_rows: int
    m_tiles: int
    warps: int
    block_n: int
    accum_f16: bool = False
    q_in_smem: bool = False
    split_masked: bool = False  # the split masked loop: plain Q rows (kernel_traits.cuh kQGap)

    @property
    def rows_per_warp(self):
        return 8 * self.quad_pair_rows * self.m_tiles

    @property
    def block_m(self):
        return self.warps * self.rows_per_warp

    @property
    def s_tiles(self):
        return self.block_n // 8 // self.qp_cols

    def qp_mn(self, lane):
        qp = qp_of(lane)
        return qp % self.quad_pair_rows, qp // self.quad_pair_rows

    def mtile_row0(self, tid, a):  # within the CTA's rows
        qp_m, _ = self.qp_mn(tid & 31)
        return (tid >> 5) * self.rows_per_warp + 8 * (a * self.quad_pair_rows + qp_m)


def fwd_layouts(s: FwdShape, kernel: str, plain: bool = False) -> dict:
    """The kernels' layouts (kernel_traits.cuh FwdKernelTraits, flash_bwd_dq_kernel.cuh DqLayout); plain=True: every
    tile as plain rows (before issue 16)."""
    c = s.head_dim // 8
    # K / V [key][head_dim] (KRows) and V^T / K^T [head_dim][key] (VtRows): in 1x4 tiles the quad-pairs of a
    # quarter-warp read rows 8 * S-tiles apart at the same chunk (K, V) and o_cols apart (V^T)
    key_rows, vt_rows = RowLayout(0, c + 1), RowLayout(0, s.block_n // 8 + 1)
    # at key chunks S-tiles apart: odd S-tiles take a pitch of C + 2 and one chunk more every 4 rows)
    if s.quad_pair_rows == 1 and not plain:
        if (8 * s.s_tiles) & (8 * s.s_tiles - 1) == 0:
            key_rows = replace(key_rows, gaps=((log2_exact(8 * s.s_tiles), 4),))
        if s.s_tiles % 2 == 1:
            vt_rows = RowLayout(0, s.block_n // 8 + 2, ((2, 1),))
    k_bytes = 16 * key_rows.chunks(s.block_n)
    vt_bytes = 16 * vt_rows.chunks(s.head_dim)
    # the Q tile (QRows; the dQ kernel's Q and dO tiles): 2x2 quad-pairs of a quarter-warp read A rows 8 apart
    q_rows = RowLayout(0, c + 1, A_ROWS_8_APART if s.q_in_smem and s.quad_pair_rows == 2 and not s.split_masked
                       and not plain else ())
    q_bytes = 16 * q_rows.chunks(s.block_m) if s.q_in_smem else 0
    # tile_chunk_position (tile_io.cuh): the loaders' and epilogues' chunks in groups of eight rows of one column
    # where a row is not a multiple of 8 chunks ("fill_groups8", not a tile)
    groups8 = c % 8 != 0 and not plain
    # the epilogue's staging tile (OStageRows): plain rows; a quarter-warp stores 8 consecutive rows of one column
    # (staging_lane). (From the row fragments until the staging lanes, 2x2 tiles had QRows' gaps here: a quarter-warp
    # stored two quad-pairs' rows 8 apart.)
    o_stage = RowLayout(0, c + 1)
    # the epilogues stage accumulator tiles as 16-byte row fragments ("row_fragments"; plain: the 32-bit stores before)
    # of the staging lanes ("staging_lanes"; False: each lane its own fragment, the code of 2026-11-27 morning)
    if kernel == "fwd":
        return {"k": key_rows, "vt": replace(vt_rows, base=k_bytes), "q": replace(q_rows, base=k_bytes + vt_bytes),
                "o_stage": o_stage, "fill_groups8": groups8, "row_fragments": not plain, "staging_lanes": not plain}
    off_v = k_bytes + vt_bytes
    return {"k": key_rows, "kt": replace(vt_rows, base=k_bytes), "v": replace(key_rows, base=off_v),
            "q": replace(q_rows, base=off_v + k_bytes), "do": replace(q_rows, base=off_v + k_bytes + q_bytes),
            "o_stage": o_stage, "fill_groups8": groups8, "row_fragments": not plain, "staging_lanes": not plain}


@functools.lru_cache(maxsize=None)  # a pure function of the frozen shape
def fwd_smem_bytes(s: FwdShape) -> int:
    """FwdKernelTraits::kSmemBytes (kernel_traits.cuh) for fwd_layouts(s, "fwd")."""
    L = fwd_layouts(s, "fwd")
    end = L["q"].base + (16 * L["q"].chunks(s.block_m) if s.q_in_smem else 0)
    return max(end, 16 * L["o_stage"].chunks(s.block_m))


@functools.lru_cache(maxsize=None)
def dq_smem_bytes(s: FwdShape) -> int:
    """DqLayout::kBytes (flash_bwd_dq_kernel.cuh) for fwd_layouts(s, "dq")."""
    L = fwd_layouts(s, "dq")
    end = L["v"].base + 16 * L["v"].chunks(s.block_n)
    if s.q_in_smem:
        end = L["do"].base + 16 * L["do"].chunks(s.block_m)
    return max(end, 16 * L["o_stage"].chunks(s.block_m))


def _rows_times_tile_rows(p: Prediction, s: FwdShape, name: str, b: RowLayout, a_tile: RowLayout | None,
                          times: int) -> None:
    """accumulate_rows_times_tile_rows: B rows of a [key][head_dim] tile per (nt, kk); A (Q or dO) from shared
    memory per (nt, kk, m-tile) when it lives there (loaded again for every use: the counts of the measured table
    say the compiler keeps no A chunk across the asm volatile mma of the next S tile)."""
    for kk in range(s.head_dim // 8):
        for nt in range(s.s_tiles):
            p.add(f"{name}.B", "ld", 16, _warps(s.threads, lambda tid: b.addr(
                (s.qp_mn(tid & 31)[1] * s.s_tiles + nt) * 8 + operand_row(tid & 31), 8 * kk)), times)
            for a in range(s.m_tiles if a_tile is not None else 0):
                p.add(f"{name}.A", "ld", 16, _warps(s.threads, lambda tid: a_tile.addr(
                    s.mtile_row0(tid, a) + operand_row(tid & 31), 8 * kk)), times)


def _rows_times_transposed_tile(p: Prediction, s: FwdShape, name: str, bt: RowLayout, times: int) -> None:
    """accumulate_rows_times_transposed_tile: B = rows of a [column][key] tile per (x, nt, ot)."""
    for x in range(s.qp_cols):
        for nt in range(s.s_tiles):
            for ot in range(s.o_tiles):
                def addr(tid):
                    lane = tid & 31
                    qp_n = s.qp_mn(lane)[1]
                    return bt.addr(qp_n * s.o_cols + operand_row(lane) + 8 * ot, ((qp_n ^ x) * s.s_tiles + nt) * 8)
                p.add(f"{name}.B", "ld", 16, _warps(s.threads, addr), times)


def _stage_accumulators(p: Prediction, s: FwdShape, name: str, stage: RowLayout, f16_layout: bool,
                        row_fragments: bool, staging_lanes: bool, times: int) -> None:
    """Epilogue: each 8x8 accumulator tile into a [row][head_dim] staging tile. The code: one 16-byte store per lane
    of staging_lane(lane)'s row fragment at that lane's operand row (stage_acc_tile_row, mma_sm70.cuh: f32-layout
    tiles trade halves with lane t ^ 2 first). Before (row_fragments False, the plain layouts' code): f32-layout
    tiles as four 32-bit stores at the scattered (row, column) pairs of the accumulator layout; staging_lanes False
    (the code of 2026-11-27 morning): each lane its own fragment."""
    src = staging_lane if staging_lanes else (lambda lane: lane)
    for a in range(s.m_tiles):
        for ot in range(s.o_tiles):
            def col0(lane):
                return s.qp_mn(lane)[1] * s.o_cols + 8 * ot
            if f16_layout or row_fragments:
                p.add(name, "st", 16, _warps(s.threads, lambda tid: stage.addr(
                    s.mtile_row0((tid & ~31) | src(tid & 31), a) + operand_row(src(tid & 31)), col0(src(tid & 31)))),
                      times)
            else:
                for i in range(0, 8, 2):
                    p.add(name, "st", 4, _warps(s.threads, lambda tid: stage.addr(
                        s.mtile_row0(tid, a) + acc_row(tid & 31, i), col0(tid & 31) + acc_col(tid & 31, i))), times)


def predict_fwd(s: FwdShape, layouts: dict | None = None) -> Prediction:
    """flash_fwd_kernel (sm_70 table: Q in registers unless q_in_smem), whole grid."""
    L = {**fwd_layouts(s, "fwd"), **(layouts or {})}
    p = Prediction(f"fwd_d{s.head_dim}")
    blocks = SEQLEN // s.block_n
    g8 = L["fill_groups8"]
    if s.q_in_smem:
        _row_major_fill(p, "q.fill", s.block_m, s.head_dim, s.threads, L["q"], 1, loop=True, groups8=g8)
    _row_major_fill(p, "k.fill", s.block_n, s.head_dim, s.threads, L["k"], blocks, loop=False, groups8=g8)
    # the last key block's `if (next_block >= 0) store_kv_block` runs predicated off: instructions, no wavefronts
    # (by the warps that hold a chunk of that iteration; the others branch around the store)
    n = s.block_n * s.head_dim // 8
    for c in range((n + s.threads - 1) // s.threads):
        holders = sum(1 for w in range(s.warps) if w * 32 + c * s.threads < n)
        p.add("k.fill", "st", 16, [[None] * 32 for _ in range(holders)], 1)
    _rows_times_tile_rows(p, s, "S=QK^T", L["k"], L["q"] if s.q_in_smem else None, blocks)
    _vt_store(p, s, L["vt"], blocks)
    _rows_times_transposed_tile(p, s, "O+=PV", L["vt"], blocks)
    _stage_accumulators(p, s, "o_stage.st", L["o_stage"], s.accum_f16, L["row_fragments"], L["staging_lanes"], 1)
    _row_major_drain(p, "o_stage.ld", s.block_m, s.head_dim, s.threads, L["o_stage"], 1, groups8=g8)
    return p.scaled(ctas=(SEQLEN // s.block_m) * HEADS * BATCH)


def _vt_store(p: Prediction, s: FwdShape, vt: RowLayout, times: int) -> None:
    """store_vt_block: lane groups of 8 store one transposed 8x8 chunk (d row, 8 keys) each."""
    cpr = s.head_dim // 8
    n = s.block_n * cpr
    for c in range((n + s.threads - 1) // s.threads):
        def addr(tid):
            chunk = tid + c * s.threads
            if chunk >= n:
                return None
            group8 = chunk >> 3
            return vt.addr((group8 % cpr) * 8 + (chunk & 7), 8 * (group8 // cpr))
        p.add("vt.fill", "st", 16, _warps(s.threads, addr), times)


def predict_dq(s: FwdShape, layouts: dict | None = None) -> Prediction:
    """flash_bwd_dq_kernel (deterministic path's dQ), whole grid."""
    L = {**fwd_layouts(s, "dq"), **(layouts or {})}
    p = Prediction(f"bwd_dq_d{s.head_dim}")
    blocks = SEQLEN // s.block_n
    g8 = L["fill_groups8"]
    if s.q_in_smem:
        _row_major_fill(p, "q.fill", s.block_m, s.head_dim, s.threads, L["q"], 1, loop=True, groups8=g8)
        _row_major_fill(p, "do.fill", s.block_m, s.head_dim, s.threads, L["do"], 1, loop=True, groups8=g8)
    _load_rows_and_transpose(p, "k.fill", s.block_n, s.head_dim, s.threads, L["k"], L["kt"], blocks)
    _load_rows_and_transpose(p, "v.fill", s.block_n, s.head_dim, s.threads, L["v"], None, blocks)
    _rows_times_tile_rows(p, s, "S=QK^T", L["k"], L["q"] if s.q_in_smem else None, blocks)
    _rows_times_tile_rows(p, s, "dP=dOV^T", L["v"], L["do"] if s.q_in_smem else None, blocks)
    _rows_times_transposed_tile(p, s, "dQ+=dSK", L["kt"], blocks)
    _stage_accumulators(p, s, "dq_stage.st", L["o_stage"], False, L["row_fragments"], L["staging_lanes"], 1)
    _row_major_drain(p, "dq_stage.ld", s.block_m, s.head_dim, s.threads, L["o_stage"], 1, groups8=g8)
    return p.scaled(ctas=(SEQLEN // s.block_m) * HEADS * BATCH)


# --- the dK/dV kernel (flash_bwd_kernel.cuh) -------------------------------------------------------------------------


@dataclass(frozen=True)
class BwdShape(_QuadPairGeometry):
    head_dim: int
    quad_pair_rows: int
    warps: int
    block_m: int
    accum_f16: bool = False
    dq_atomic: bool = False
    kv_in_smem: bool = False
    lean: bool = False
    out_split: int = 1  # CTAs per key block, each with head_dim / out_split columns of dK / dV (slice 0 modelled)
    dq_from_k: bool = False  # dQ's B from the K tile's rows (row-major B), no K^T tile (BwdKernelTraits::kDqFromK)
    dkdv_row_b: bool = False  # dK / dV's B from the Q / dO rows (row-major B), no Q^T / dO^T (kDkDvRowB)

    @property
    def out_dim(self):  # BwdKernelTraits::kOutDim: the dK / dV columns of one CTA
        return self.head_dim // self.out_split

    @property
    def o_cols(self):  # dK / dV columns per quad-pair column (of the CTA's slice)
        return self.out_dim // self.qp_cols

    @property
    def rows_per_warp(self):
        return 8 * self.quad_pair_rows

    @property
    def block_n(self):
        return self.warps * self.rows_per_warp

    @property
    def s_tiles(self):
        return self.block_m // 8 // self.qp_cols

    @property
    def dkdv_f16_products(self):
        return self.accum_f16 and not self.lean

    @property
    def dq_tile_cols(self):  # BwdKernelTraits::kDqTileCols: pairs of 8-column tiles from the K tile
        return 16 if self.dq_k_rows else 8

    @property
    def dq_warps(self):  # BwdKernelTraits::kDqWarps: the most warps that tile dQ (kernel_traits.cuh dq_split_warps)
        return max(1, dq_split_warps(self.warps, self.block_m, self.head_dim, self.dq_tile_cols))

    @property
    def dq_rows_per_warp(self):  # BwdKernelTraits::kDqRowsPerWarp: as few as the dQ warps can take
        return max(8, dq_split_rows(self.dq_warps, self.block_m, self.head_dim, self.dq_tile_cols))

    @property
    def dq_row_warps(self):
        return max(1, self.block_m // self.dq_rows_per_warp)

    @property
    def dq_col_warps(self):  # BwdKernelTraits::kDqColWarps: warps sharing a row range, splitting head_dim
        return max(1, self.dq_warps // self.dq_row_warps)

    @property
    def dq_cols_per_quad_pair(self):  # BwdKernelTraits::kDqColsPerQuadPair
        return self.head_dim // self.dq_col_warps // (4 // (self.dq_rows_per_warp // 8))

    def dq_origin(self, tid):
        """(row0, col0): the first query and dQ column of the lane's quad-pair tile (flash_bwd_kernel.cuh
        bwd_dq_atomic; from the K tile with 1x4 dQ quad-pairs, quad-pair q takes column slot (q & 1) * 2 + (q >> 1))."""
        qp_rows = self.dq_rows_per_warp // 8
        qp_m, qp_n = qp_of(tid & 31) % qp_rows, qp_of(tid & 31) // qp_rows
        slot = (qp_n & 1) * 2 + (qp_n >> 1) if self.dq_k_rows and qp_rows == 1 else qp_n
        row0 = ((tid >> 5) % self.dq_row_warps) * self.dq_rows_per_warp + 8 * qp_m
        col_warp = (tid >> 5) // self.dq_row_warps
        col0 = col_warp * (self.head_dim // self.dq_col_warps) + slot * self.dq_cols_per_quad_pair
        return row0, col0

    @property
    def dq_k_rows(self):  # dQ by atomics reading B from the K tile
        return self.dq_atomic and self.dq_from_k

    def qp_mn(self, lane):
        qp = qp_of(lane)
        return qp % self.quad_pair_rows, qp // self.quad_pair_rows

    def key_in_block(self, tid):  # mtile_key0 - n0
        return (tid >> 5) * self.rows_per_warp + 8 * self.qp_mn(tid & 31)[0]

    def stile_q0(self, lane, x, nt):
        return ((self.qp_mn(lane)[1] ^ x) * self.s_tiles + nt) * 8


def dq_split_ok(warps: int, rows: int, block_m: int, head_dim: int, tile_cols: int) -> bool:
    """csrc/kernel_traits.cuh dq_split_ok: ``warps`` warps of ``rows`` queries tile a dQ block in quad-pairs with a
    multiple of ``tile_cols`` columns each."""
    row_warps = block_m // rows if block_m % rows == 0 else 0
    col_warps = warps // row_warps if row_warps > 0 and warps % row_warps == 0 else 0
    return col_warps > 0 and head_dim % (col_warps * (32 // rows) * tile_cols) == 0


def dq_split_rows(warps: int, block_m: int, head_dim: int, tile_cols: int) -> int:
    """csrc/kernel_traits.cuh dq_split_rows: the fewest rows per warp (8, 16, 32) that tile; 0: none."""
    return next((r for r in (8, 16, 32) if dq_split_ok(warps, r, block_m, head_dim, tile_cols)), 0)


def dq_split_warps(warps: int, block_m: int, head_dim: int, tile_cols: int) -> int:
    """csrc/kernel_traits.cuh dq_split_warps: the most warps, up to ``warps``, that tile the dQ block; 0: none."""
    return next((w for w in range(warps, 0, -1) if dq_split_rows(w, block_m, head_dim, tile_cols)), 0)


def log2_exact(n: int) -> int:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"{n}: a power of two expected")
    return n.bit_length() - 1


def half_line_gap_chunks(rows_apart: int) -> int:
    """The smallest gap of whole chunks after every 8 rows that puts rows `rows_apart` apart (a multiple of 8)
    4 chunks (half a 128-byte line) apart modulo 8 chunks; 0 if none (kernel_traits.cuh half_line_gap_chunks)."""
    for g in range(1, 8):
        if (rows_apart // 8 * g) % 8 == 4:
            return g
    return 0


def restack(order: list[str], L: dict, rows: dict) -> dict:
    """Bases of the tiles in `order` that `rows` lists, one after the other; a vector's bytes rounded to 16 (the
    traits' offsets)."""
    out, off = dict(L), 0
    for name in order:
        if name not in rows:
            continue
        lay = out[name]
        out[name] = replace(lay, base=off)
        if isinstance(lay, VectorLayout):
            off += (4 * lay.words(rows[name]) + 15) // 16 * 16
        else:
            off += 16 * lay.chunks(rows[name])
    return out


BWD_TILE_ORDER = ["q", "do", "qt", "dot", "kt", "ds", "k", "v", "lse", "dsum"]
# 4 chunks before rows 8, 24, 40, ...: 4 * ((r >> 3) - (r >> 4)) (kernel_traits.cuh KvRows, QRows)
A_ROWS_8_APART = ((3, 4), (4, -4))


def bwd_tile_rows(s: BwdShape) -> dict:
    """Rows of each tile the dK/dV kernel's shared memory holds (vectors: elements)."""
    rows = {"q": s.block_m, "do": s.block_m, "lse": s.block_m, "dsum": s.block_m}
    if not s.dkdv_row_b:
        rows.update(qt=s.out_dim, dot=s.out_dim)
    if s.dq_atomic:
        rows.update(ds=s.block_m)
        if not s.dq_k_rows:
            rows.update(kt=s.head_dim)
    if s.kv_in_smem:
        rows.update(k=s.block_n, v=s.block_n)
    return rows


def _pow2(n: int) -> bool:
    return n > 0 and not n & (n - 1)


def bwd_1x4_layout(s: BwdShape) -> bool:
    """Whether the tile takes the 1x4 row layout (BwdKernelTraits::k1x4Layout: 1x4 quad-pairs whose row distance
    8 * S-tiles is a power of two, so that every gap comes after a power-of-two number of rows)."""
    return s.quad_pair_rows == 1 and _pow2(8 * s.s_tiles)


def bwd_layouts(s: BwdShape, plain: bool = False) -> dict:
    """BwdKernelTraits' shared memory (csrc/kernel_traits.cuh: QRows, QtRows, KtRows, DsRows, KvRows, Vector and
    the kOff* offsets). plain=True: every tile as plain padded rows (pitch C + 1 chunks, no gaps), the layout
    before issue 16."""
    c, cm, cn = s.head_dim // 8, s.block_m // 8, s.block_n // 8
    L = {"q": RowLayout(0, c + 1), "do": RowLayout(0, c + 1), "qt": RowLayout(0, cm + 1),
         "dot": RowLayout(0, cm + 1), "kt": RowLayout(0, cn + 1), "ds": RowLayout(0, cn + 1),
         "k": RowLayout(0, c + 1), "v": RowLayout(0, c + 1), "lse": VectorLayout(0), "dsum": VectorLayout(0),
         "o_stage": RowLayout(0, s.out_dim // 8 + 1)}
    if not plain and bwd_1x4_layout(s):
        # 1x4: quad-pairs of a quarter-warp read Q / dO rows 8 * S-tiles apart, Q^T / dO^T rows o_cols apart at
        # chunks c and c ^ 2, lse / dsum 16 queries apart, and store dS rows 8 * S-tiles apart
        shift = log2_exact(8 * s.s_tiles)
        for name in ("q", "do"):
            L[name] = replace(L[name], gaps=((shift, 4),))
        L["lse"] = replace(L["lse"], pad=4)
        L["dsum"] = replace(L["dsum"], pad=4)
        L["ds"] = replace(L["ds"], gaps=((shift, 4),))
    if not plain and s.quad_pair_rows == 1:
        # 1x4: Q^T / dO^T rows o_cols apart at query chunks S-tiles apart: pitch C + 2, a chunk every 4 rows, and one
        # every 2^z rows (z: trailing zeros of o_cols) when o_cols / 4 + S-tiles is even (BwdKernelTraits::QtRows)
        tz = (s.o_cols & -s.o_cols).bit_length() - 1
        gaps = ((2, 1), (tz, 1)) if (s.o_cols // 4 + s.s_tiles) % 2 == 0 else ((2, 1),)
        for name in ("qt", "dot"):
            L[name] = replace(L[name], pitch=cm + 2, gaps=gaps)
    if not plain and s.quad_pair_rows == 2 and s.kv_in_smem:
        # 2x2, K / V as A operands from shared memory: quad-pairs of a quarter-warp read rows 8 apart (the warp's
        # two 8-key tiles), store dS at key chunks c, c + 1
        for name in ("k", "v"):
            L[name] = replace(L[name], gaps=A_ROWS_8_APART)
        L["ds"] = replace(L["ds"], pitch=cn + 2)
    if not plain and (bwd_1x4_layout(s) or (s.quad_pair_rows == 2 and s.kv_in_smem)) and s.dq_rows_per_warp == 8:
        # 1x4 dQ: K^T rows kDqColsPerQuadPair apart
        L["kt"] = replace(L["kt"], gaps=((3, half_line_gap_chunks(s.head_dim // s.dq_col_warps // 4)),))
    return {**restack(BWD_TILE_ORDER, L, bwd_tile_rows(s)), "row_fragments": not plain, "staging_lanes": not plain}


@functools.lru_cache(maxsize=None)
def bwd_shape_smem_bytes(s: BwdShape) -> int:
    """BwdKernelTraits::kSmemBytes of the shape's own layouts (bwd_layouts(s))."""
    return bwd_smem_bytes(s, bwd_layouts(s))


def bwd_smem_bytes(s: BwdShape, L: dict) -> int:
    """Bytes the layouts span (BwdKernelTraits::kSmemBytes for bwd_layouts(s))."""
    end = 0
    for name, rows in bwd_tile_rows(s).items():
        lay = L[name]
        if isinstance(lay, VectorLayout):
            end = max(end, lay.base + (4 * lay.words(rows) + 15) // 16 * 16)
        else:
            end = max(end, lay.base + 16 * lay.chunks(rows))
    return max(end, 16 * L["o_stage"].chunks(s.block_n))


def predict_dkdv(s: BwdShape, layouts: dict | None = None) -> Prediction:
    """flash_bwd_dkdv_kernel, whole grid (one query head per kv head)."""
    L = {**bwd_layouts(s), **(layouts or {})}
    p = Prediction(f"bwd_dkdv_d{s.head_dim}")
    p.smem_bytes = bwd_smem_bytes(s, L)
    blocks = SEQLEN // s.block_m
    T = s.threads
    # prologue
    if s.kv_in_smem:
        # chunk_position (tile_io.cuh): groups of eight rows of one column where a row is not a multiple of 8 chunks
        g8 = L["staging_lanes"] and (s.head_dim // 8) % 8 != 0
        _row_major_fill(p, "k.fill", s.block_n, s.head_dim, T, L["k"], 1, loop=True, groups8=g8)
        _row_major_fill(p, "v.fill", s.block_n, s.head_dim, T, L["v"], 1, loop=True, groups8=g8)
    if s.dq_atomic and not s.dq_k_rows:
        _load_rows_and_transpose(p, "kt.fill", s.block_n, s.head_dim, T, None, L["kt"], 1)
    # per query block: loads of Q, dO (+ transposes), lse, dsum
    _load_rows_and_transpose(p, "q.fill", s.block_m, s.head_dim, T, L["q"], None if s.dkdv_row_b else L["qt"], blocks,
                             s.out_dim)
    _load_rows_and_transpose(p, "do.fill", s.block_m, s.head_dim, T, L["do"], None if s.dkdv_row_b else L["dot"],
                             blocks, s.out_dim)
    for name in ("lse", "dsum"):
        for c in range((s.block_m + T - 1) // T):
            wa = _warps(T, lambda tid: L[name].addr(tid + c * T) if tid + c * T < s.block_m else None)
            p.add(f"{name}.fill", "st", 4, [w for w in wa if any(a is not None for a in w)], blocks)
    # S^T = K Q^T, dP^T = V dO^T
    for prod, a_name, b_name in (("S^T=KQ^T", "k", "q"), ("dP^T=VdO^T", "v", "do")):
        for kk in range(s.head_dim // 8):
            for nt in range(s.s_tiles):
                p.add(f"{prod}.B", "ld", 16, _warps(T, lambda tid: L[b_name].addr(
                    s.stile_q0(tid & 31, 0, nt) + operand_row(tid & 31), 8 * kk)), blocks)
                if s.kv_in_smem:  # per use, like the forward's A (see _rows_times_tile_rows)
                    p.add(f"{prod}.A", "ld", 16, _warps(T, lambda tid: L[a_name].addr(
                        s.key_in_block(tid) + operand_row(tid & 31), 8 * kk)), blocks)
    # lse2 / dsum of the element's query: f32 accumulator columns (c, c+1) and (c+4, c+5): 64-bit loads
    for nt in range(s.s_tiles):
        for name in ("lse", "dsum"):
            for i in (0, 4):
                p.add(f"{name}.ld", "ld", 8, _warps(T, lambda tid: L[name].addr(
                    s.stile_q0(tid & 31, 0, nt) + acc_col(tid & 31, i))), blocks)
    # dV += P^T dO, dK += dS^T Q: B = rows of the transposed tiles, or (dkdv_row_b) of Q / dO: lane t loads rows
    # q0 + t and q0 + 4 + t at the quad-pair's column slot (qp & 1) * 2 + (qp >> 1), 16 columns per tile pair
    for prod, b_rows in (("dV+=PdO", "do"), ("dK+=dSQ", "q")) if s.dkdv_row_b else ():
        for j in range(s.o_tiles // 2):
            for x in range(s.qp_cols):
                for nt in range(s.s_tiles):
                    for half in (0, 4):
                        def addr(tid, j=j, x=x, nt=nt, half=half):
                            lane = tid & 31
                            qp_n = s.qp_mn(lane)[1]
                            slot = (qp_n & 1) * 2 + (qp_n >> 1)
                            return L[b_rows].addr(s.stile_q0(lane, x, nt) + half + (lane & 3),
                                                  slot * s.o_cols + 16 * j + 8 * (lane >> 4))
                        p.add(f"{prod}.B", "ld", 16, _warps(T, addr), blocks)
    for prod, bt in (("dV+=PdO", "dot"), ("dK+=dSQ", "qt")) if not s.dkdv_row_b else ():
        for ot in range(s.o_tiles):
            for x in range(s.qp_cols):
                for nt in range(s.s_tiles):
                    def addr(tid, ot=ot, x=x, nt=nt):
                        lane = tid & 31
                        return L[bt].addr(s.qp_mn(lane)[1] * s.o_cols + operand_row(lane) + 8 * ot,
                                          s.stile_q0(lane, x, nt))
                    p.add(f"{prod}.B", "ld", 16, _warps(T, addr), blocks)
    if s.dq_atomic:
        for nt in range(s.s_tiles):  # dS^T -> dS [query][key] (8x8 transposes in the quad-pair)
            p.add("ds.st", "st", 16, _warps(T, lambda tid: L["ds"].addr(
                s.stile_q0(tid & 31, 0, nt) + operand_row(tid & 31), s.key_in_block(tid))), blocks)
        TQ = 32 * s.dq_warps  # the warps that add dQ
        dq_cols = s.dq_cols_per_quad_pair

        def col0(tid):  # the quad-pair's first dQ column
            return s.dq_origin(tid)[1]

        for kc in range(s.block_n // 8):
            def a_addr(tid):
                return L["ds"].addr(s.dq_origin(tid)[0] + operand_row(tid & 31), 8 * kc)
            if s.dq_k_rows:  # one A load and two K-row loads (k-steps) per pair of 8-column tiles
                for j in range(dq_cols // 16):
                    p.add("dQ+=dSK.A", "ld", 16, _warps(TQ, a_addr), blocks)
                    for step in (0, 4):
                        def b_addr(tid, j=j, step=step):
                            lane = tid & 31
                            return L["k"].addr(8 * kc + step + (lane & 3), col0(tid) + 16 * j + 8 * (lane >> 4))
                        p.add("dQ+=dSK.B", "ld", 16, _warps(TQ, b_addr), blocks)
                continue
            for ot in range(dq_cols // 8):
                p.add("dQ+=dSK.A", "ld", 16, _warps(TQ, a_addr), blocks)  # per use
                def b_addr(tid, ot=ot):
                    lane = tid & 31
                    return L["kt"].addr(col0(tid) + operand_row(lane) + 8 * ot, 8 * kc)
                p.add("dQ+=dSK.B", "ld", 16, _warps(TQ, b_addr), blocks)
    # epilogue: dK and dV staged, then written in 16-byte rows
    for out in ("dk", "dv"):
        for ot in range(s.o_tiles):
            def col0(lane, ot=ot):
                return s.qp_mn(lane)[1] * s.o_cols + 8 * ot
            if s.dkdv_f16_products or L["row_fragments"]:  # one 16-byte row fragment per lane and tile
                src = staging_lane if L["staging_lanes"] else (lambda lane: lane)  # (see _stage_accumulators)
                p.add("kv_stage.st", "st", 16, _warps(T, lambda tid: L["o_stage"].addr(
                    s.key_in_block((tid & ~31) | src(tid & 31)) + operand_row(src(tid & 31)), col0(src(tid & 31)))), 1)
            else:  # before: four 32-bit stores per tile at the f32 layout's (row, column) pairs
                for i in range(0, 8, 2):
                    p.add("kv_stage.st", "st", 4, _warps(T, lambda tid: L["o_stage"].addr(
                        s.key_in_block(tid) + acc_row(tid & 31, i), col0(tid & 31) + acc_col(tid & 31, i))), 1)
        _row_major_drain(p, "kv_stage.ld", s.block_n, s.out_dim, T, L["o_stage"], 1, groups8=L["staging_lanes"])
    return p.scaled(ctas=-(-SEQLEN // s.block_n) * HEADS * BATCH * s.out_split)  # the grid: ceil(N / block_n) key blocks


# --- from the tile tables --------------------------------------------------------------------------------------------


def predict_variant(meta: dict, dq_atomic: bool | None = None, layouts: dict | None = None,
                    plain: bool = False) -> Prediction:
    """Prediction for a KernelVariant's meta (volta_train/kernels/tiles.py) of the sm_70 tables; plain=True: with
    the layouts before issue 16 (every tile plain padded rows), the code the H100 table measured."""
    tile, d, f16 = meta["tile"], meta["head_dim"], meta["accum_f16"]
    if meta["pass"] == "fwd":
        shape = FwdShape(d, tile.quad_pair_rows, tile.m_tiles, tile.warps, tile.block_n, f16, tile.q_in_smem,
                         tile.split_masked)
        if plain:
            layouts = {**fwd_layouts(shape, "fwd", plain=True), **(layouts or {})}
        return predict_fwd(shape, layouts)
    if meta["pass"] == "bwd_dq":
        shape = FwdShape(d, tile.quad_pair_rows, tile.m_tiles, tile.warps, tile.block_n, False, tile.q_in_smem)
        if plain:
            layouts = {**fwd_layouts(shape, "dq", plain=True), **(layouts or {})}
        return predict_dq(shape, layouts)
    if dq_atomic is None:
        raise ValueError("dq_atomic: needed for a bwd_dkdv variant (True or False)")
    shape = bwd_tile_shape(tile, d, dq_atomic, f16)
    if plain:
        layouts = {**bwd_layouts(shape, plain=True), **(layouts or {})}
    return predict_dkdv(shape, layouts)


def with_layouts(base: dict, **changes) -> dict:
    return {**base, **changes}


# --- shared memory of a tile (volta_train/kernels/tiles.py FwdTile / BwdTile) ---------------------------------------


def fwd_tile_smem_bytes(tile, head_dim: int) -> int:
    """FwdKernelTraits::kSmemBytes of a forward or decoding tile."""
    return fwd_smem_bytes(FwdShape(head_dim, tile.quad_pair_rows, tile.m_tiles, tile.warps, tile.block_n, False,
                                   tile.q_in_smem, tile.split_masked))


def dq_tile_smem_bytes(tile, head_dim: int) -> int:
    """DqLayout::kBytes of a dQ kernel tile."""
    return dq_smem_bytes(FwdShape(head_dim, tile.quad_pair_rows, tile.m_tiles, tile.warps, tile.block_n, False,
                                  tile.q_in_smem))


def bwd_tile_shape(tile, head_dim: int, dq_atomic: bool, accum_f16: bool = False) -> BwdShape:
    """The BwdShape of a dK/dV tile (volta_train/kernels/tiles.py BwdTile) at head_dim."""
    return BwdShape(head_dim, tile.quad_pair_rows, tile.warps, tile.block_m, accum_f16, dq_atomic, tile.kv_in_smem,
                    tile.lean, tile.out_split, tile.dq_from_k, tile.dkdv_row_b)


def bwd_tile_smem_bytes(tile, head_dim: int, dq_atomic: bool) -> int:
    """BwdKernelTraits::kSmemBytes of a dK/dV tile."""
    return bwd_shape_smem_bytes(bwd_tile_shape(tile, head_dim, dq_atomic))


def variant_smem_bytes(variant) -> int:
    """The modelled dynamic shared memory of a tile-table KernelVariant (0 for the split combine)."""
    meta = variant.meta
    if meta["pass"] in ("fwd", "decode"):
        return fwd_tile_smem_bytes(meta["tile"], meta["head_dim"])
    if meta["pass"] == "bwd_dq":
        return dq_tile_smem_bytes(meta["tile"], meta["head_dim"])
    if meta["pass"] == "bwd_dkdv":
        return bwd_tile_smem_bytes(meta["tile"], meta["head_dim"], "_dqatomic" in variant.name)
    return 0


__all__ = ["wavefronts", "RowLayout", "VectorLayout", "FwdShape", "BwdShape", "Prediction", "SiteCost",
           "predict_fwd", "predict_dq", "predict_dkdv", "predict_variant", "fwd_layouts", "bwd_layouts",
           "bwd_smem_bytes", "bwd_tile_shape", "fwd_tile_smem_bytes", "dq_tile_smem_bytes", "bwd_tile_smem_bytes",
           "variant_smem_bytes", "replace"]
