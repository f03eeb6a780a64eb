// Which keys a query row sees: the key-length bound, causal and local windows, all aligned to the
// bottom-right corner as in flash-attn >= 2.1. Query row i sees key j iff
//   j < seqlen_k  and  i + shift - left <= j <= i + shift + right,   shift = seqlen_k - seqlen_q,
// where an unbounded side is -1 (causal is right = 0).
#pragma once
#include "params.cuh"

struct VisibleKeys {
    int seqlen_k, shift, left, right;

    __device__ __forceinline__ VisibleKeys(const AttentionParams& p, const SequenceExtent& seq)
        : seqlen_k(seq.seqlen_k), shift(seq.seqlen_k - seq.seqlen_q), left(p.window_left), right(p.window_right) {}

    // |i + shift - j|: the distance ALiBi penalises.
    __device__ __forceinline__ float diagonal_distance(int row, int key) const { return (float)abs(row + shift - key); }

    __device__ __forceinline__ bool visible(int row, int key) const {
        return key < seqlen_k && (right < 0 || key <= row + shift + right) && (left < 0 || key >= row + shift - left);
    }

    // First key block any of the rows [row_begin, row_end) may see.
    __device__ __forceinline__ int first_key(int row_begin) const {
        return left < 0 ? 0 : max(0, row_begin + shift - left);
    }
    // One past the last key any of the rows [row_begin, row_end) may see.
    __device__ __forceinline__ int end_key(int row_end) const {
        return right < 0 ? seqlen_k : max(0, min(seqlen_k, row_end - 1 + shift + right + 1));
    }
    // True if no row in [row_begin, row_end) sees any key in [key_begin, key_end).
    __device__ __forceinline__ bool tile_is_empty(int row_begin, int row_end, int key_begin, int key_end) const {
        return key_begin >= end_key(row_end) || key_end <= first_key(row_begin);
    }
    // First key block (of block_n keys) from which on every row before row_end sees whole blocks, as far
    // as the left window edge is concerned.
    __device__ __forceinline__ int first_full_block(int row_end, int block_n) const {
        if (left < 0) return 0;
        const int first_key_of_last_row = row_end - 1 + shift - left;
        return first_key_of_last_row <= 0 ? 0 : (first_key_of_last_row + block_n - 1) / block_n;
    }
    // One past the last key block that every row from row_begin on sees entirely (right edge, seqlen_k).
    __device__ __forceinline__ int end_full_block(int row_begin, int block_n) const {
        int keys = seqlen_k;
        if (right >= 0) keys = min(keys, row_begin + shift + right + 1);
        return keys <= 0 ? 0 : keys / block_n;
    }
    // True if every row in [row_begin, row_end) sees every key in [key_begin, key_end).
    __device__ __forceinline__ bool tile_is_full(int row_begin, int row_end, int key_begin, int key_end) const {
        const bool below_right = right < 0 || key_end - 1 <= row_begin + shift + right;
        const bool above_left = left < 0 || key_begin >= row_end - 1 + shift - left;
        return key_end <= seqlen_k && below_right && above_left;
    }
};
