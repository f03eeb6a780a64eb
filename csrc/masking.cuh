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

// Mask and ALiBi bias on a warp's S tiles s[a][nt][i] (m-tile a, S tile nt, element i; Layout says where
// element i sits, Geometry where the tiles sit, as in warp_tile.cuh): with needs_mask, an element whose row may
// not see its key becomes -inf; every other one gets -bias_per_step * |i + shift - j| (ALiBi; 0 without it).
template <class Layout, class Geometry, int kMTiles, int kSTiles>
__device__ __forceinline__ void mask_and_bias_scores(float (&s)[kMTiles][kSTiles][8], const Geometry& g,
                                                     const VisibleKeys& vis, int key0, bool needs_mask,
                                                     float bias_per_step) {
#pragma unroll
    for (int a = 0; a < kMTiles; ++a)
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int row = g.mtile_row0(a) + Layout::row(g.lq, i);
                const int key = key0 + g.stile_key0(nt) + Layout::phys_col(g.lq, i);
                if (needs_mask && !vis.visible(row, key)) s[a][nt][i] = neg_inf();
                else s[a][nt][i] -= bias_per_step * vis.diagonal_distance(row, key);
            }
}
