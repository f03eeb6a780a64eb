// Philox 4x32-10 and the dropout keep/drop function, identical to volta_train/_philox.py:
//
//   key     = (lo32(seed), hi32(seed) ^ hi32(offset))
//   counter = (col >> 3, row, batch * nheads + head, lo32(offset))
//   keep(col) = 16-bit chunk (col & 7) of the four output words, low half first, >= threshold
//
// One call decides the eight consecutive keys [8g, 8g + 8) of one query row: exactly what a lane
// holds of P after the softmax (see softmax.cuh), so no random bits are wasted.
#pragma once
#include "vt_numeric.cuh"

constexpr u32 kPhiloxM0 = 0xD2511F53u;
constexpr u32 kPhiloxM1 = 0xCD9E8D57u;
constexpr u32 kPhiloxW0 = 0x9E3779B9u;
constexpr u32 kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

__device__ __forceinline__ u32x4 philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < kPhiloxRounds; ++round) {
        const u32 hi0 = __umulhi(kPhiloxM0, c0), lo0 = kPhiloxM0 * c0;
        const u32 hi1 = __umulhi(kPhiloxM1, c2), lo1 = kPhiloxM1 * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += kPhiloxW0;
        k1 += kPhiloxW1;
    }
    return u32x4{c0, c1, c2, c3};
}

struct DropoutRng {
    u32 key0, key1, offset_lo, threshold, batch_head;

    __device__ __forceinline__ DropoutRng(u64 seed, u64 offset, u32 threshold_, u32 batch_head_)
        : key0((u32)seed), key1((u32)(seed >> 32) ^ (u32)(offset >> 32)), offset_lo((u32)offset),
          threshold(threshold_), batch_head(batch_head_) {}

    // Two-element keep mask for one random word: 0xffff in each half that is kept.
    __device__ __forceinline__ u32 keep_mask_pair(u32 word) const {
        const u32 lo = (word & 0xffffu) >= threshold ? 0x0000ffffu : 0u;
        const u32 hi = (word >> 16) >= threshold ? 0xffff0000u : 0u;
        return lo | hi;
    }

    // Keep bits of the keys [8 * group, 8 * group + 8) of one row: bit j for key 8 * group + j.
    __device__ __forceinline__ u32 keep_bits(u32 group, u32 row) const {
        const u32x4 r = philox4x32_10(group, row, batch_head, offset_lo, key0, key1);
        const u32 words[4] = {r.x, r.y, r.z, r.w};
        u32 bits = 0;
#pragma unroll
        for (int w = 0; w < 4; ++w) {
            bits |= ((words[w] & 0xffffu) >= threshold ? 1u : 0u) << (2 * w);
            bits |= ((words[w] >> 16) >= threshold ? 1u : 0u) << (2 * w + 1);
        }
        return bits;
    }

    // Zeroes the dropped elements of the keys [8 * group, 8 * group + 8) of one row, held as four
    // f16x2 registers in key order.
    __device__ __forceinline__ void apply(u32 (&p)[4], u32 group, u32 row) const {
        const u32x4 r = philox4x32_10(group, row, batch_head, offset_lo, key0, key1);
        p[0] &= keep_mask_pair(r.x);
        p[1] &= keep_mask_pair(r.y);
        p[2] &= keep_mask_pair(r.z);
        p[3] &= keep_mask_pair(r.w);
    }
};

// Two-element keep mask (0xffff per kept half) for elements 2k and 2k + 1 of an 8-bit keep pattern.
__device__ __forceinline__ u32 keep_mask_of_bits(u32 bits, int k) {
    return (((bits >> (2 * k)) & 1u) ? 0x0000ffffu : 0u) | (((bits >> (2 * k + 1)) & 1u) ? 0xffff0000u : 0u);
}

// The backward holds P^T: each lane of a quad-pair one key row (r = t + 4 * hi) and eight consecutive query
// columns, while one Philox call decides eight keys of one query row. So lane r computes the call for query
// column r of the 8x8 tile (keys of its quad-pair's 8-key group) and the eight lanes swap the bytes: the
// result is this lane's key across the eight queries, bit c for query column c.
__device__ __forceinline__ u32 keep_bits_transposed_in_quad_pair(u32 my_query_bits, int lane) {
    const int r = (lane & 3) + 4 * (lane >> 4);
    u32 lo = r < 4 ? my_query_bits << (8 * r) : 0u;  // byte r of the 64-bit gather
    u32 hi = r < 4 ? 0u : my_query_bits << (8 * (r - 4));
#pragma unroll
    for (int distance = 1; distance <= 16; distance <<= 1) {
        if (distance == 4 || distance == 8) continue;  // quad-pair lanes differ in bits 0, 1 and 4
        lo |= __shfl_xor_sync(0xffffffffu, lo, distance);
        hi |= __shfl_xor_sync(0xffffffffu, hi, distance);
    }
    u32 bits = 0;
#pragma unroll
    for (int c = 0; c < 8; ++c) bits |= (((c < 4 ? lo >> (8 * c) : hi >> (8 * (c - 4))) >> r) & 1u) << c;
    return bits;
}
