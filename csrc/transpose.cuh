// 8x8 transposes of fp16 values across groups of eight lanes (lane bits 0-2).
//
// Before: lane i of the group holds row i, columns 0..7, as four f16x2 words (word k = columns 2k, 2k+1).
// After:  lane i holds column i, rows 0..7, in the same packing (word k = rows 2k, 2k+1).
// Three butterfly stages (lane distance 4, 2, 1): at each stage a lane keeps the elements whose column
// bit matches its own lane bit, sends the others to its partner and stores what it receives in the slots
// it sent from, so the slot bit comes to mean the row bit. 6 shuffles and 14 ALU operations per lane.
#pragma once
#include "vt_numeric.cuh"

__device__ __forceinline__ u32 byte_permute(u32 a, u32 b, u32 selector) {
    u32 r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(selector));
    return r;
}

// Words (w0, w1) <-> (w2, w3) across the lanes whose row bit 2 differs (lane distance `distance`).
__device__ __forceinline__ void transpose_stage_word_pairs(u32x4& w, int lane, int distance) {
    const bool upper = (lane & distance) != 0;
    const u32 r0 = __shfl_xor_sync(0xffffffffu, upper ? w.x : w.z, distance);
    const u32 r1 = __shfl_xor_sync(0xffffffffu, upper ? w.y : w.w, distance);
    if (upper) { w.x = r0; w.y = r1; } else { w.z = r0; w.w = r1; }
}

// Words (w0, w2) <-> (w1, w3) across the lanes whose row bit 1 differs (lane distance 2).
__device__ __forceinline__ void transpose_stage_words(u32x4& w, int lane) {
    const bool upper = (lane & 2) != 0;
    const u32 r0 = __shfl_xor_sync(0xffffffffu, upper ? w.x : w.y, 2);
    const u32 r1 = __shfl_xor_sync(0xffffffffu, upper ? w.z : w.w, 2);
    if (upper) { w.x = r0; w.z = r1; } else { w.y = r0; w.w = r1; }
}

// The two halves of every word across lanes i, i ^ 1.
__device__ __forceinline__ void transpose_stage_halves(u32x4& w, int lane) {
    const bool upper = (lane & 1) != 0;
    const u32 pick = upper ? 0x5410u : 0x7632u;  // send low halves (upper lane) or high halves (lower lane)
    const u32 r0 = __shfl_xor_sync(0xffffffffu, byte_permute(w.x, w.y, pick), 1);
    const u32 r1 = __shfl_xor_sync(0xffffffffu, byte_permute(w.z, w.w, pick), 1);
    if (upper) {  // received halves become the low halves
        w.x = byte_permute(r0, w.x, 0x7610u);
        w.y = byte_permute(r0, w.y, 0x7632u);
        w.z = byte_permute(r1, w.z, 0x7610u);
        w.w = byte_permute(r1, w.w, 0x7632u);
    } else {      // received halves become the high halves
        w.x = byte_permute(w.x, r0, 0x5410u);
        w.y = byte_permute(w.y, r0, 0x7610u);
        w.z = byte_permute(w.z, r1, 0x5410u);
        w.w = byte_permute(w.w, r1, 0x7610u);
    }
}

// Groups of eight consecutive lanes (row = lane & 7).
__device__ __forceinline__ void transpose_8x8_halves(u32x4& w, int lane) {
    transpose_stage_word_pairs(w, lane, 4);
    transpose_stage_words(w, lane);
    transpose_stage_halves(w, lane);
}

// The eight lanes of a quad-pair (row = t + 4 * hi: lane bits 0, 1 and 4), e.g. an 8x8 tile held in the
// A-operand layout, one row per lane.
__device__ __forceinline__ void transpose_8x8_halves_in_quad_pair(u32x4& w, int lane) {
    transpose_stage_word_pairs(w, lane, 16);
    transpose_stage_words(w, lane);
    transpose_stage_halves(w, lane);
}
