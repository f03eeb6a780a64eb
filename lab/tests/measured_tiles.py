"""The sm_70 tile tables that the committed H100 conflict measurement (lab/results/smem_conflicts_sm70_tiles_h100.md)
was taken on, before the issue-16 8- and 12-warp tiles replaced several of them: tests that compare the bank model
with that measurement need the variants it names, whatever the tables ship now."""

from unittest import mock

from volta_train.kernels import tiles
from volta_train.kernels.tiles import BwdTile, FwdTile

MEASURED_FWD_SM70 = {
    48: FwdTile(quad_pair_rows=4, m_tiles=1, warps=4, block_n=32),
    64: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=32),
    96: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=32),
    128: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=16),
}
MEASURED_BWD_SM70 = {
    16: BwdTile(quad_pair_rows=2, warps=2, block_m=32, dq_atomic=False),
    32: BwdTile(quad_pair_rows=1, warps=8, block_m=64),
    48: BwdTile(quad_pair_rows=2, warps=2, block_m=32, dq_atomic=False),
    64: BwdTile(quad_pair_rows=1, warps=8, block_m=64),
    80: BwdTile(quad_pair_rows=2, warps=2, block_m=32, kv_in_smem=True, dq_atomic=False),
    96: BwdTile(quad_pair_rows=2, warps=4, block_m=32, kv_in_smem=True, lean=True),
    112: BwdTile(quad_pair_rows=2, warps=2, block_m=32, kv_in_smem=True, dq_atomic=False),
    128: BwdTile(quad_pair_rows=2, warps=4, block_m=32, kv_in_smem=True, lean=True),
}
MEASURED_DQ_SM70 = {
    64: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=32),
    80: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=16, q_in_smem=True),
    96: FwdTile(quad_pair_rows=1, m_tiles=1, warps=8, block_n=32),
    112: FwdTile(quad_pair_rows=2, m_tiles=1, warps=4, block_n=16, q_in_smem=True),
    128: FwdTile(quad_pair_rows=1, m_tiles=1, warps=8, block_n=32),
}


def measured_sm70_variants(head_dims=(16, 32, 48, 64, 80, 96, 112, 128)):
    """Every variant of the measured sm_70 tables (what tiles.shipped_variants(70) listed then), without softcap."""
    with mock.patch.object(tiles, "FWD_TILES_SM70", MEASURED_FWD_SM70), \
         mock.patch.object(tiles, "BWD_TILES_SM70", MEASURED_BWD_SM70), \
         mock.patch.object(tiles, "DQ_TILES_SM70", MEASURED_DQ_SM70), \
         mock.patch.object(tiles, "BWD_KERNEL_HEAD_DIMS_SM70", {}), \
         mock.patch.object(tiles, "SUPPORTED_HEAD_DIMS", tuple(head_dims)):
        return tiles.shipped_fwd_variants(70, softcap=(False,)) + tiles.shipped_bwd_variants(70, softcap=(False,))
