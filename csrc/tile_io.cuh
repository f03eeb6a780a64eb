// Global <-> shared memory tile movers of the kernels (16-byte chunks, rows past the sequence end read as zeros).
#pragma once
#include "transpose.cuh"

// A [rows][head_dim] block from global memory into shared memory (if `rows` is given; layout Rows, a TileRows) and
// its transpose [head_dim][rows] (if `transposed` is given; layout Transposed): groups of eight lanes read eight
// consecutive rows of one 8-column chunk, store them, transpose them across the group and store the columns.
// kTransposedCols < head_dim: only columns [transposed_col0, transposed_col0 + kTransposedCols) are transposed
// (rows 0.. of `transposed`); both multiples of 32, so that a warp's four 8-column chunks (consecutive, starting at
// a multiple of 4 chunks) are all in the range or all out of it and the transposes' shuffles stay warp-uniform.
template <class KT, int kRows, class Rows, class Transposed, int kTransposedCols = KT::kChunksPerRow * 8>
__device__ __forceinline__ void load_rows_and_transpose(const half_bits* base, long long row_stride, int row0,
                                                        int row_limit, int tid, half_bits* rows, half_bits* transposed,
                                                        int transposed_col0 = 0) {
    constexpr bool kAllColumns = kTransposedCols == KT::kChunksPerRow * 8;
    static_assert(kAllColumns || (kTransposedCols % 32 == 0 && KT::kChunksPerRow % 4 == 0),
                  "a transposed column range must be whole groups of 32 columns");
    constexpr int kChunks = kRows * KT::kChunksPerRow;
#pragma unroll
    for (int c = 0; c < (kChunks + KT::kThreads - 1) / KT::kThreads; ++c) {
        const int chunk = tid + c * KT::kThreads;
        const bool in_tile = (kChunks % KT::kThreads == 0) || chunk < kChunks;
        const int group8 = chunk >> 3;
        const int row = 8 * (group8 / KT::kChunksPerRow) + (chunk & 7), col = (group8 % KT::kChunksPerRow) * 8;
        u32x4 v = (in_tile && row0 + row < row_limit) ? load_global_16B(base + (long long)(row0 + row) * row_stride + col)
                                                       : zero_u32x4();
        if (in_tile && rows != nullptr) store_shared_16B(rows + Rows::offset(row) + col, v);
        if constexpr (kAllColumns) {
            if (transposed != nullptr) {
                transpose_8x8_halves(v, tid & 31);
                if (in_tile) store_shared_16B(transposed + Transposed::offset(col + (chunk & 7)) + (row & ~7), v);
            }
        } else {
            const int tcol = col - transposed_col0;
            if (transposed != nullptr && tcol >= 0 && tcol < kTransposedCols) {  // warp-uniform (see above)
                transpose_8x8_halves(v, tid & 31);
                if (in_tile) store_shared_16B(transposed + Transposed::offset(tcol + (chunk & 7)) + (row & ~7), v);
            }
        }
    }
}

// Row and column (halves) of chunk `chunk` of a [rows][kChunksPerRow chunks] tile moved in 16-byte chunks by the
// loaders and epilogues (tile_chunk_position: the forward-shaped kernels' [rows][head_dim] tiles). Rows of a multiple
// of 8 chunks: row-major (eight consecutive lanes, one quarter-warp store, move eight chunks of one row). Otherwise
// eight consecutive lanes move one chunk column of eight consecutive rows (load_v_block's order), which the odd row
// pitches keep on eight different bank groups; row-major, their eight chunks would straddle two rows and meet on a
// bank (the rows count is a multiple of 8).
template <int kChunksPerRow>
__device__ __forceinline__ void chunk_position(int chunk, int& row, int& col) {
    if (kChunksPerRow % 8 == 0) {
        row = chunk / kChunksPerRow;
        col = (chunk % kChunksPerRow) * 8;
    } else {
        const int group8 = chunk >> 3;
        row = 8 * (group8 / kChunksPerRow) + (chunk & 7);
        col = (group8 % kChunksPerRow) * 8;
    }
}

template <class KT>
__device__ __forceinline__ void tile_chunk_position(int chunk, int& row, int& col) {
    chunk_position<KT::kChunksPerRow>(chunk, row, col);
}

// Copies kBlockN rows x head_dim of K or V, starting at key row `key0`, from global memory into
// registers; rows at or past `seqlen_k` become zeros (never read garbage: 0 * inf would be NaN).
template <class KT>
__device__ __forceinline__ void load_kv_block(const half_bits* base, long long row_stride, int key0, int seqlen_k,
                                              int tid, u32x4 (&stage)[KT::kChunksPerThread]) {
#pragma unroll
    for (int c = 0; c < KT::kChunksPerThread; ++c) {
        const int chunk = tid + c * KT::kThreads;
        int row, col;
        tile_chunk_position<KT>(chunk, row, col);
        const bool in_tile = (KT::kTileChunks % KT::kThreads == 0) || chunk < KT::kTileChunks;
        stage[c] = (in_tile && key0 + row < seqlen_k) ? load_global_16B(base + (long long)(key0 + row) * row_stride + col)
                                                      : zero_u32x4();
    }
}

template <class KT>
__device__ __forceinline__ void store_kv_block(half_bits* tile, int tid, const u32x4 (&stage)[KT::kChunksPerThread]) {
#pragma unroll
    for (int c = 0; c < KT::kChunksPerThread; ++c) {
        const int chunk = tid + c * KT::kThreads;
        if ((KT::kTileChunks % KT::kThreads == 0) || chunk < KT::kTileChunks) {
            int row, col;
            tile_chunk_position<KT>(chunk, row, col);
            store_shared_16B(tile + KT::KRows::offset(row) + col, stage[c]);
        }
    }
}

// V block -> registers, in the order the 8x8 transposes need: each group of eight lanes takes one 8-column
// chunk of eight consecutive keys (lane i: key 8 * key_block8 + i). Rows past seqlen_k become zeros.
template <class KT>
__device__ __forceinline__ void load_v_block(const half_bits* base, long long row_stride, int key0, int seqlen_k,
                                             int tid, u32x4 (&stage)[KT::kChunksPerThread]) {
#pragma unroll
    for (int c = 0; c < KT::kChunksPerThread; ++c) {
        const int chunk = tid + c * KT::kThreads;
        const int group8 = chunk >> 3;
        const int key = 8 * (group8 / KT::kChunksPerRow) + (chunk & 7), col = (group8 % KT::kChunksPerRow) * 8;
        const bool in_tile = (KT::kTileChunks % KT::kThreads == 0) || chunk < KT::kTileChunks;
        stage[c] = (in_tile && key0 + key < seqlen_k) ? load_global_16B(base + (long long)(key0 + key) * row_stride + col)
                                                      : zero_u32x4();
    }
}

// Registers -> V^T block in shared memory: transposing each 8x8 chunk across its eight lanes turns
// "one key, eight head_dim columns" into "one head_dim column, eight keys", stored as one 16-byte row piece.
template <class KT>
__device__ __forceinline__ void store_vt_block(half_bits* vt_tile, int tid, u32x4 (&stage)[KT::kChunksPerThread]) {
#pragma unroll
    for (int c = 0; c < KT::kChunksPerThread; ++c) {
        const int chunk = tid + c * KT::kThreads;
        transpose_8x8_halves(stage[c], tid & 31);
        if ((KT::kTileChunks % KT::kThreads == 0) || chunk < KT::kTileChunks) {
            const int group8 = chunk >> 3;
            const int d = (group8 % KT::kChunksPerRow) * 8 + (chunk & 7), key = 8 * (group8 / KT::kChunksPerRow);
            store_shared_16B(vt_tile + KT::VtRows::offset(d) + key, stage[c]);
        }
    }
}
