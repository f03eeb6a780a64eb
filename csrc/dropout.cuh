// Dropout keep bits, identical to volta_train/philox.py:
//
//   key     = (lo32(seed), hi32(seed) ^ hi32(offset))
//   counter = (col >> 3, row, batch * nheads + head, lo32(offset))
//   keep(col) = 16-bit chunk (col & 7) of the four output words, low half first, >= threshold
//
// One Philox call decides the eight consecutive keys [8g, 8g + 8) of one query row: exactly what a lane
// holds of P after the softmax in the A-operand layout (mma_sm70.cuh), so no random bits are wasted. The
// backward kernels hold other layouts and move the bits between the lanes of a quad-pair (below).
#pragma once
#include "philox.cuh"

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

// The 64 dropout keep bits of an 8x8 tile in every lane of a quad-pair: lane r (row r of the tile) computes
// its row's Philox call for the tile's 8 keys and the eight lanes exchange bytes; bit 8 * row + key.
__device__ __forceinline__ void keep_bits_of_tile(u32 my_row_bits, int lane, u32& lo, u32& hi) {
    const int r = (lane & 3) + 4 * (lane >> 4);
    lo = r < 4 ? my_row_bits << (8 * r) : 0u;
    hi = r < 4 ? 0u : my_row_bits << (8 * (r - 4));
#pragma unroll
    for (int distance = 1; distance <= 16; distance <<= 1) {
        if (distance == 4 || distance == 8) continue;  // quad-pair lanes differ in lane bits 0, 1 and 4
        lo |= __shfl_xor_sync(0xffffffffu, lo, distance);
        hi |= __shfl_xor_sync(0xffffffffu, hi, distance);
    }
}

// The keep bit of (row, col) of the 8x8 tile gathered by keep_bits_of_tile.
__device__ __forceinline__ bool tile_keep_bit(u32 lo, u32 hi, int row, int col) {
    const int bit = 8 * row + col;
    return ((bit < 32 ? lo >> bit : hi >> (bit - 32)) & 1u) != 0;
}

// The backward holds P^T: each lane of a quad-pair one key row (r = t + 4 * hi) and eight consecutive query
// columns, while one Philox call decides eight keys of one query row. So lane r computes the call for query
// column r of the 8x8 tile (keys of its quad-pair's 8-key group) and the eight lanes swap the bytes: the
// result is this lane's key across the eight queries, bit c for query column c.
__device__ __forceinline__ u32 keep_bits_transposed_in_quad_pair(u32 my_query_bits, int lane) {
    const int r = (lane & 3) + 4 * (lane >> 4);
    u32 lo, hi;  // byte c: the keep bits of query column c
    keep_bits_of_tile(my_query_bits, lane, lo, hi);
    u32 bits = 0;
#pragma unroll
    for (int c = 0; c < 8; ++c) bits |= (((c < 4 ? lo >> (8 * c) : hi >> (8 * (c - 4))) >> r) & 1u) << c;
    return bits;
}
