"""bwd_dq_atomic (csrc/flash_bwd_kernel.cuh) replayed on the CPU for every tile that adds dQ by atomics: from each
quad-pair's origin (lab/bank_model.py BwdShape.dq_origin), the lanes' A / B fragments as the kernel loads them, each
quad-pair's m8n8k4 product as PTX defines it, and the atomics' targets (dq_column, the f32 / f16 accumulator
layouts). Integer-valued inputs make the sums exact: every dQ element of the query block must receive dS K once,
whatever the warp split (kDqWarps, kDqRowsPerWarp) and the column slots."""

import numpy as np
import pytest

import bank_model as bm
from volta_train.kernels import tiles


def _atomic_tiles():
    seen, out = set(), []
    for table in (tiles.BWD_TILES_SM70, tiles.BWD_TILES_EMULATED, tiles.BWD_TILES_EMULATED_FP16,
                  tiles.BWD_TILES_SM70_NEXT):
        for d, tile in table.items():
            if tile.dq_atomic and (d, tile) not in seen:
                seen.add((d, tile))
                out.append((d, tile))
    return [pytest.param(d, t, id=f"d{d}_qp{t.quad_pair_rows}_w{t.warps}_m{t.block_m}{'_kvsmem' if t.kv_in_smem else ''}"
                                 f"{'_dqk' if t.dq_from_k else ''}") for d, t in out]


def _replay(s: bm.BwdShape, ds: np.ndarray, k: np.ndarray, accum_f16: bool) -> np.ndarray:
    """dQ of one query block as the kernel's atomics add it (before the softmax scale)."""
    dq = np.zeros((s.block_m, s.head_dim))
    tiles_qp = s.dq_cols_per_quad_pair // 8
    from_k = s.dq_k_rows
    for warp in range(s.dq_warps):
        for qp in range(4):
            row0, col0 = s.dq_origin(32 * warp + 4 * qp)  # (lane 4 qp: the quad-pair's first)
            lanes = [(t, hi) for hi in (0, 1) for t in range(4)]
            for ot in range(tiles_qp):
                c = np.zeros((8, 8))  # the quad-pair's C tile, logical columns
                for kc in range(s.block_n // 8):
                    for step in (0, 4):  # two k-steps of 4 keys per 16-byte A load
                        a = np.zeros((8, 4))
                        b = np.zeros((4, 8))
                        for t, hi in lanes:
                            a[t + 4 * hi] = ds[row0 + t + 4 * hi, 8 * kc + step: 8 * kc + step + 4]
                            key = 8 * kc + step + t
                            for n in range(4):
                                # row-major B from K rows: lane (t, hi) holds k-row t, logical columns 4 hi + n
                                # (from the K tile: 16 bytes at col0 + 8 hi + 16 j, halves 4 e + n for tile 2 j + e)
                                col = (col0 + 16 * (ot >> 1) + 8 * hi + 4 * (ot & 1) + n if from_k
                                       else col0 + 8 * ot + 4 * hi + n)
                                b[t, 4 * hi + n] = k[key, col]
                        c += a @ b
                for t, hi in lanes:
                    for i in range(8):
                        if accum_f16:  # f16 C: the lane's row operand_row(), logical columns 0..7
                            r, cl = t + 4 * hi, i
                        else:  # f32 C: acc_row(i), acc_col(i)
                            r, cl = (t & 1) + (i & 2) + 4 * hi, (i & 4) + (t & 2) + (i & 1)
                        col = (col0 + 16 * (ot >> 1) + 8 * (cl >> 2) + 4 * (ot & 1) + (cl & 3) if from_k
                               else col0 + 8 * ot + cl)
                        dq[row0 + r, col] += c[r, cl]
    return dq


@pytest.mark.parametrize("accum_f16", [False, True], ids=["f32acc", "f16acc"])
@pytest.mark.parametrize("head_dim, tile", _atomic_tiles())
def test_dq_atomics_add_ds_k_once_per_element(head_dim, tile, accum_f16):
    s = bm.bwd_tile_shape(tile, head_dim, True, accum_f16)
    seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh inputs each run; the seed is in the message
    gen = np.random.default_rng(seed)
    ds = gen.integers(-3, 4, size=(s.block_m, s.block_n)).astype(float)
    k = gen.integers(-3, 4, size=(s.block_n, head_dim)).astype(float)
    assert np.array_equal(_replay(s, ds, k, accum_f16), ds @ k), f"seed {seed}"
