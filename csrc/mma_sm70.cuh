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
