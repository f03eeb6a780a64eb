"""Issue 16: shared-memory layouts of the sm_70 tiles designed with the offline bank model (bank_model.py).

The designs not in the kernels yet, costed per kernel by ``lab/smem_bank_model.py --fixes`` against the
code's layouts (bank_model.bwd_layouts / fwd_layouts; in csrc already, see kernel_traits.cuh: the 1x4 dK/dV
tiles' layout, the 2x2 A-from-shared-memory tiles' (K / V, the forward's Q and the dQ kernel's Q / dO: 4 chunks
before rows 8, 24, 40, ..., which separates the same rows as a gap every 8 rows in less memory; dS pitch C + 2) and
the 1x4 forward-shaped tiles' K / V rows and V^T / K^T rows (FwdKernelTraits KRows, VtRows)). The forward-shaped
kernels' fills and epilogue drains move chunks in groups of eight rows where a row is not a multiple of 8 chunks
(tile_io.cuh tile_chunk_position). No design is left here. Each design keeps every reader and writer of a tile on one layout
(RowLayout: row r starts at chunk r * pitch + sum(gap * (r >> shift)), i.e. a per-row base offset computed once per
lane: no per-load address arithmetic), and is checked against 96 KB.

Designs (C = 16-byte chunks per row of the unpadded tile; today every tile has pitch C + 1):

* quad-pair pairs of a quarter-warp reading rows R apart at the same chunk (1x4 B tiles: R = 8 * S tiles per quad-pair;
  A from shared memory in 2x2 tiles: R = 8): a gap of 4 chunks every R rows (shift log2 R): the two quad-pairs'
  four rows land on the two halves of the 128-byte line (pitch C + 1 odd keeps 8 consecutive rows, the writers'
  transposed stores, conflict-free);
* 1x4 transposed tiles (Q^T, dO^T: quad-pair pairs read rows R apart at chunks c and c ^ 2): pitch C + 2 (rows of a
  quad-pair on even positions), one chunk more every 4 rows (the writers' 8 rows back on odd ones) and one more every
  R rows (the partner quad-pair's rows on odd positions);
* lse / dsum vectors: 4 words of padding every 32 (the 1x4 quad-pairs read queries 16 apart: 2-way at 64 bits);
* dS [query][key] of the 2x2 dQ-atomic tiles (quad-pairs of a quarter-warp store the same queries at key chunks c,
  c + 1): pitch C + 2.
"""

from __future__ import annotations


from . import bank_model as bm


def dkdv_layouts(s: bm.BwdShape) -> dict:
    """The dK/dV kernel's layouts with the designs not yet in csrc: none left (bm.bwd_layouts)."""
    return bm.bwd_layouts(s)


def fwd_layouts(s: bm.FwdShape) -> dict:
    """The forward's layouts with the designs not yet in csrc: none left (bm.fwd_layouts)."""
    return bm.fwd_layouts(s, "fwd")


def dq_layouts(s: bm.FwdShape) -> dict:
    """The dQ kernel's layouts with the designs not yet in csrc: none left (bm.fwd_layouts)."""
    return bm.fwd_layouts(s, "dq")


def layouts_for_variant(variant) -> dict:
    m = variant.meta
    t, d = m["tile"], m["head_dim"]
    if m["pass"] == "fwd":
        return fwd_layouts(bm.FwdShape(d, t.quad_pair_rows, t.m_tiles, t.warps, t.block_n, m["accum_f16"],
                                       t.q_in_smem, t.split_masked))
    if m["pass"] == "bwd_dq":
        return dq_layouts(bm.FwdShape(d, t.quad_pair_rows, t.m_tiles, t.warps, t.block_n, False, t.q_in_smem))
    return dkdv_layouts(bm.BwdShape(d, t.quad_pair_rows, t.warps, t.block_m, m["accum_f16"],
                                    "_dqatomic" in variant.name, t.kv_in_smem, t.lean))
