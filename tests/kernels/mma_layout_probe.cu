// Test kernel of csrc/mma_sm70.cuh (not shipped): one warp runs the four m8n8k4 variants the kernels use,
// loading A/B fragments and storing C/D fragments with the layout formulas of mma_sm70.cuh. If a formula is
// wrong, tests/test_mma_layouts.py sees a wrong product.
#include "mma_sm70.cuh"

// a: [4 quad-pairs][8][4] row-major, b: [4][4][8] row-major, d: [4 variants][4 quad-pairs][8][8] fp32
__global__ void mma_layout_probe_kernel(const half_bits* a, const half_bits* b, float* d) {
    const int lane = threadIdx.x;
    const LaneInQuadPair lq(lane);
    const half_bits* qa = a + lq.quad_pair * 32;
    const half_bits* qb = b + lq.quad_pair * 32;
    const int row = lq.operand_row();
    // A row-major: row, k = 0..3
    const u32 a0 = qa[row * 4 + 0] | ((u32)qa[row * 4 + 1] << 16);
    const u32 a1 = qa[row * 4 + 2] | ((u32)qa[row * 4 + 3] << 16);
    // B col-major: column `row`, k = 0..3
    const u32 bc0 = qb[0 * 8 + row] | ((u32)qb[1 * 8 + row] << 16);
    const u32 bc1 = qb[2 * 8 + row] | ((u32)qb[3 * 8 + row] << 16);
    // B row-major: k-row t, columns 4*hi .. 4*hi+3
    const half_bits* brow = qb + lq.t * 8 + 4 * lq.hi;
    const u32 br0 = brow[0] | ((u32)brow[1] << 16);
    const u32 br1 = brow[2] | ((u32)brow[3] << 16);
    for (int variant = 0; variant < 4; ++variant) {
        float* out = d + (variant * 4 + lq.quad_pair) * 64;
        const bool col_major_b = variant == 0 || variant == 2;
        const u32 b0 = col_major_b ? bc0 : br0, b1 = col_major_b ? bc1 : br1;
        if (variant < 2) {
            float acc[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            if (col_major_b) mma_rc_f32(acc, a0, a1, b0, b1);
            else mma_rr_f32(acc, a0, a1, b0, b1);
            for (int i = 0; i < 8; ++i) out[lq.acc_row(i) * 8 + lq.acc_col(i)] = acc[i];
        } else {
            u32 acc[4] = {0u, 0u, 0u, 0u};
            if (col_major_b) mma_rc_f16(acc, a0, a1, b0, b1);
            else mma_rr_f16(acc, a0, a1, b0, b1);
            for (int i = 0; i < 8; ++i) {
                const u32 pair = acc[i / 2];
                out[row * 8 + i] = (i & 1) ? high_half_to_float(pair) : low_half_to_float(pair);
            }
        }
    }
}
