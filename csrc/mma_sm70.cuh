// The Volta tensor-core instruction, mma.sync.aligned.m8n8k4, and its fragment layouts.
//
// One warp-wide m8n8k4 runs four independent 8x8x4 products, one per quad-pair (QP):
// QP q is lanes 4q..4q+3 (the "low group") plus lanes 4q+16..4q+19 (the "high group").
// Inside a QP, with t = lane & 3 and hi = lane >> 4 (PTX ISA, "Matrix Fragments for mma.m8n8k4"):
//   A, row-major   : the lane holds row t + 4*hi, k = 0..3                 (two f16x2 registers)
//   B, col-major   : the lane holds column t + 4*hi, k = 0..3              (two f16x2 registers)
//   B, row-major   : the lane holds k-row t, columns 4*hi .. 4*hi+3        (two f16x2 registers)
//   C/D, f16       : the lane holds row t + 4*hi, columns 0..7             (four f16x2 registers)
//   C/D, f32       : element i is row (lane & 1) + (i & 2) + 4*hi,
//                    column (i & 4) + (lane & 2) + (i & 1)                 (eight f32 registers)
// The f32 layout is the non-obvious one: a lane holds two rows (r and r + 2) and the column
// pairs {c, c+1, c+4, c+5} with c = lane & 2; lanes t and t^2 together hold full rows.
#pragma once
#include "vt_numeric.cuh"

struct LaneInQuadPair {
    int quad_pair;  // 0..3
    int t;          // lane & 3
    int hi;         // 0: low group (lanes 0-15), 1: high group (lanes 16-31)

    __device__ __forceinline__ explicit LaneInQuadPair(int lane)
        : quad_pair((lane >> 2) & 3), t(lane & 3), hi(lane >> 4) {}

    // Row of A (row-major) or of an f16 C fragment held by this lane; column of B (col-major).
    __device__ __forceinline__ int operand_row() const { return t + 4 * hi; }
    // f32 C fragment: row and column of accumulator element i.
    __device__ __forceinline__ int acc_row(int i) const { return (t & 1) + (i & 2) + 4 * hi; }
    __device__ __forceinline__ int acc_col(int i) const { return (i & 4) + (t & 2) + (i & 1); }
};

// D = A * B + D, fp32 accumulation, A row-major, B col-major.
__device__ __forceinline__ void mma_rc_f32(float (&d)[8], u32 a0, u32 a1, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 "
        "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
}

// D = A * B + D, fp32 accumulation, A row-major, B row-major.
__device__ __forceinline__ void mma_rr_f32(float (&d)[8], u32 a0, u32 a1, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.row.f32.f16.f16.f32 "
        "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9}, {%10,%11}, {%0,%1,%2,%3,%4,%5,%6,%7};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
}

// D = A * B + D, fp16 accumulation (FP16-ACC), A row-major, B col-major.
__device__ __forceinline__ void mma_rc_f16(u32 (&d)[4], u32 a0, u32 a1, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.col.f16.f16.f16.f16 {%0,%1,%2,%3}, {%4,%5}, {%6,%7}, {%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
}

// D = A * B + D, fp16 accumulation, A row-major, B row-major.
__device__ __forceinline__ void mma_rr_f16(u32 (&d)[4], u32 a0, u32 a1, u32 b0, u32 b1) {
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.row.f16.f16.f16.f16 {%0,%1,%2,%3}, {%4,%5}, {%6,%7}, {%0,%1,%2,%3};\n"
        : "+r"(d[0]), "+r"(d[1]), "+r"(d[2]), "+r"(d[3])
        : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
}

// D = A * B + D, A row-major, B col-major, in the accumulator's type: f16x2 registers (FP16-ACC) or fp32.
__device__ __forceinline__ void mma_rc(u32 (&d)[4], u32 a0, u32 a1, u32 b0, u32 b1) { mma_rc_f16(d, a0, a1, b0, b1); }
__device__ __forceinline__ void mma_rc(float (&d)[8], u32 a0, u32 a1, u32 b0, u32 b1) { mma_rc_f32(d, a0, a1, b0, b1); }

// ---- Hand-over from the f32 C/D layout to the A-operand layout (P of S = Q K^T becomes A of O = P V).

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

// One 8x8 accumulator tile as this lane's fp16 row fragment: row operand_row(), columns 0..7 (16 bytes), so an
// epilogue stages a tile with one 16-byte shared store per lane instead of four 4-byte stores at the f32 layout's
// scattered (row, column) pairs (those conflict: lanes t and t ^ 2 hit the same bank group). FP16-layout tiles
// (kF32Layout false: row operand_row(), columns i) already are that fragment; f32 tiles trade half with lane t ^ 2.
// Every lane of the warp must call it (shuffles). The fp16 rounding is the same as packing in place.
template <bool kF32Layout>
__device__ __forceinline__ void acc_tile_to_row_fragment(const float (&x)[8], int t, u32 (&frag)[4]) {
    if (kF32Layout) {
        f32_acc_to_row_fragment(x, t, frag);
    } else {
#pragma unroll
        for (int k = 0; k < 4; ++k) frag[k] = pack_half2(x[2 * k], x[2 * k + 1]);
    }
}

// The lane whose row fragment this lane stores when a warp stages its accumulator tiles. A 16-byte shared store
// runs in quarter-warps (lanes 8j .. 8j + 7); as the fragments lie, a quarter-warp holds rows 0-3 of two quad-pairs
// (lanes 0-3 quad-pair 0, lanes 4-7 quad-pair 1; the high lanes 16-31 rows 4-7), which in 1x4 tiles meet on a bank
// whenever the quad-pairs' column offset is not a multiple of 64 bytes (d96: 2-way) and in 2x2 tiles are rows 8
// apart. Lanes 4-7 trade with 16-19 and 12-15 with 24-27 (quad-pair bit 0 != hi: lane ^ 20), so that each
// quarter-warp stores all 8 rows of one quad-pair's tile at one column: conflict-free in every arrangement wherever
// 8 consecutive rows start on 8 different 16-byte bank groups (an odd pitch in chunks). An involution.
__device__ __forceinline__ int staging_lane(int lane) { return ((lane >> 2) & 1) != (lane >> 4) ? lane ^ 20 : lane; }

// Stages one (already scaled) 8x8 accumulator tile with one 16-byte shared store per lane: the row fragment of
// staging_lane(lane) (this lane's own when that is itself; staged_row_fragment) at `row_start`, the address of that lane's row
// operand_row() at the tile's first column, i.e. computed with the staging lane's geometry. Every lane of the warp
// must call it (shuffles).
template <bool kF32Layout>
__device__ __forceinline__ void staged_row_fragment(const float (&x)[8], int lane, u32 (&frag)[4]) {
    acc_tile_to_row_fragment<kF32Layout>(x, lane & 3, frag);
#pragma unroll
    for (int k = 0; k < 4; ++k) frag[k] = __shfl_sync(0xffffffffu, frag[k], staging_lane(lane));
}
template <bool kF32Layout>
__device__ __forceinline__ void stage_acc_tile_row(const float (&x)[8], int lane, void* row_start) {
    u32 frag[4];
    staged_row_fragment<kF32Layout>(x, lane, frag);
    store_shared_16B(row_start, u32x4{frag[0], frag[1], frag[2], frag[3]});
}
