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
