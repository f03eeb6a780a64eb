"""Issue 16: shared-memory layouts of the sm_70 tiles designed with the offline bank model (bank_model.py).

Nothing here is used by the kernels yet: these are the designs, costed per kernel by
``scripts/smem_bank_model.py --fixes``. Each design keeps every reader and writer of a tile on one layout
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

from dataclasses import replace

from . import bank_model as bm


def _log2(n: int) -> int:
    if n <= 0 or n & (n - 1):
        raise ValueError(f"{n}: a power of two expected")
    return n.bit_length() - 1


def _gap_for(rows_apart: int) -> tuple[int, int]:
    """(shift, gap): a gap every 8 rows whose sum over `rows_apart` rows is 4 chunks mod 8."""
    groups = rows_apart // 8
    for g in range(1, 8):
        if (groups * g) % 8 == 4:
            return 3, g
    raise ValueError(f"rows_apart {rows_apart}: no gap every 8 rows separates them by 4 chunks")


def _restack(order: list[str], L: dict, rows: dict) -> dict:
    """Bases of the tiles in `order`, one after the other (16-byte aligned), as the traits lay them out."""
    out, off = dict(L), 0
    for name in order:
        if name not in rows:
            continue
        lay = out[name]
        if isinstance(lay, bm.VectorLayout):
            out[name] = replace(lay, base=off)
            off += 4 * lay.words(rows[name])
            off = (off + 15) // 16 * 16
        else:
            out[name] = replace(lay, base=off)
            off += 16 * lay.chunks(rows[name])
    return out


def dkdv_layouts(s: bm.BwdShape) -> dict:
    L = bm.bwd_layouts(s)
    c, cm, cn = s.head_dim // 8, s.block_m // 8, s.block_n // 8
    if s.quad_pair_rows == 1:
        r = 8 * s.s_tiles  # rows between the quad-pairs of a quarter-warp in S^T's B (Q, dO)
        for name in ("q", "do"):
            L[name] = replace(L[name], gaps=((_log2(r), 4),))
        for name in ("qt", "dot"):
            L[name] = replace(L[name], pitch=cm + 2, gaps=((2, 1), (_log2(s.o_cols), 1)))
        L["lse"] = replace(L["lse"], pad=4)
        L["dsum"] = replace(L["dsum"], pad=4)
        L["ds"] = replace(L["ds"], gaps=((_log2(r), 4),))
    else:
        for name in ("k", "v"):
            L[name] = replace(L[name], gaps=((3, 4),))
        L["ds"] = replace(L["ds"], pitch=cn + 2)
    if s.dq_atomic:
        dq_cols = s.head_dim // (4 // (s.dq_rows_per_warp // 8))
        L["kt"] = replace(L["kt"], gaps=(_gap_for(dq_cols),))
    rows = {"q": s.block_m, "do": s.block_m, "qt": s.head_dim, "dot": s.head_dim, "lse": s.block_m,
            "dsum": s.block_m}
    if s.dq_atomic:
        rows.update(kt=s.head_dim, ds=s.block_m)
    if s.kv_in_smem:
        rows.update(k=s.block_n, v=s.block_n)
    return _restack(["q", "do", "qt", "dot", "kt", "ds", "k", "v", "lse", "dsum"], L, rows)


def fwd_layouts(s: bm.FwdShape) -> dict:
    # K block stored in load_v_block's order (eight rows of one chunk per lane group): odd pitches keep it clean
    return {**bm.fwd_layouts(s, "fwd"), "k_fill_groups8": True}


def dq_layouts(s: bm.FwdShape) -> dict:
    L = bm.fwd_layouts(s, "dq")
    if s.quad_pair_rows == 1:
        for name in ("k", "v"):
            L[name] = replace(L[name], gaps=((_log2(8 * s.s_tiles), 4),))
    if s.q_in_smem:
        for name in ("q", "do"):
            L[name] = replace(L[name], gaps=((3, 4),))
    rows = {"k": s.block_n, "kt": s.head_dim, "v": s.block_n, "q": s.block_m, "do": s.block_m}
    if not s.q_in_smem:
        rows.pop("q"), rows.pop("do")
    return _restack(["k", "kt", "v", "q", "do"], L, rows)


def layouts_for_variant(variant) -> dict:
    m = variant.meta
    t, d = m["tile"], m["head_dim"]
    if m["pass"] == "fwd":
        return fwd_layouts(bm.FwdShape(d, t.quad_pair_rows, t.m_tiles, t.warps, t.block_n, m["accum_f16"],
                                       t.q_in_smem))
    if m["pass"] == "bwd_dq":
        return dq_layouts(bm.FwdShape(d, t.quad_pair_rows, t.m_tiles, t.warps, t.block_n, False, t.q_in_smem))
    return dkdv_layouts(bm.BwdShape(d, t.quad_pair_rows, t.warps, t.block_m, m["accum_f16"],
                                    "_dqatomic" in variant.name, t.kv_in_smem, t.lean))
