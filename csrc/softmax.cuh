// Online softmax on tensor-core fragments, and the hand-over of P from the accumulator layout of
// S = Q K^T to the A-operand layout of O = P V, in both accumulation modes.
//
// Everything runs in the log2 domain: p = 2^(s * scale * log2(e) - m). Row maxima m and partial
// row sums l stay fp32 in both modes. A row with no visible key keeps m = -inf; the "safe" max
// used in the exponent is then 0, so exp2(-inf - 0) = 0 and nothing becomes NaN.
#pragma once
#include "mma_sm70.cuh"

__device__ __forceinline__ float safe_row_max(float m) { return m == neg_inf() ? 0.f : m; }

__device__ __forceinline__ float max_over_lanes(float x, int lane_mask) {
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, lane_mask));
}

__device__ __forceinline__ float sum_over_lanes(float x, int lane_mask) {
    return x + __shfl_xor_sync(0xffffffffu, x, lane_mask);
}

// f32 accumulators: element i of an 8x8 tile belongs to the lane's row slot (i >> 1) & 1, i.e.
// row (t & 1) + 2 * slot + 4 * hi. The full row is spread over lanes t and t ^ 2 (xor 2) and,
// in the 2x2 arrangement, over the neighbouring quad-pair (xor 8).
__device__ __forceinline__ int f32_acc_row_slot(int i) { return (i >> 1) & 1; }

// Moves P from the f32 accumulator layout (two rows x columns {c, c+1, c+4, c+5}, c = lane & 2)
// to the A-operand layout (one row, columns 0..7 as four f16x2 registers): lane t keeps the half
// of its values that lies in row t and trades the other half with lane t ^ 2.
__device__ __forceinline__ void f32_acc_to_row_fragment(const float (&p)[8], int t, u32 (&frag)[4]) {
    const u32 row_slot0_cols01 = pack_half2(p[0], p[1]);
    const u32 row_slot1_cols01 = pack_half2(p[2], p[3]);
    const u32 row_slot0_cols45 = pack_half2(p[4], p[5]);
    const u32 row_slot1_cols45 = pack_half2(p[6], p[7]);
    const bool upper = (t & 2) != 0;  // lane t's own row is row slot 1 iff t >= 2
    const u32 keep_lo = upper ? row_slot1_cols01 : row_slot0_cols01;
    const u32 keep_hi = upper ? row_slot1_cols45 : row_slot0_cols45;
    const u32 send_lo = upper ? row_slot0_cols01 : row_slot1_cols01;
    const u32 send_hi = upper ? row_slot0_cols45 : row_slot1_cols45;
    const u32 recv_lo = __shfl_xor_sync(0xffffffffu, send_lo, 2);
    const u32 recv_hi = __shfl_xor_sync(0xffffffffu, send_hi, 2);
    frag[0] = upper ? recv_lo : keep_lo;  // columns 0, 1
    frag[1] = upper ? keep_lo : recv_lo;  // columns 2, 3
    frag[2] = upper ? recv_hi : keep_hi;  // columns 4, 5
    frag[3] = upper ? keep_hi : recv_hi;  // columns 6, 7
}
