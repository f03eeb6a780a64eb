// Global <-> shared memory tile movers shared by the kernels.
#pragma once
#include "transpose.cuh"

// A [rows][head_dim] block from global memory into shared memory (if `rows` is given) and its transpose
// [head_dim][rows] (if `transposed` is given): groups of eight lanes read eight consecutive rows of one 8-column chunk,
// store them, transpose them across the group and store the columns.
template <class KT, int kRows>
__device__ __forceinline__ void load_rows_and_transpose(const half_bits* base, long long row_stride, int row0,
                                                        int row_limit, int tid, half_bits* rows, int rows_stride,
                                                        half_bits* transposed, int transposed_stride) {
    constexpr int kChunks = kRows * KT::kChunksPerRow;
#pragma unroll
    for (int c = 0; c < (kChunks + KT::kThreads - 1) / KT::kThreads; ++c) {
        const int chunk = tid + c * KT::kThreads;
        const bool in_tile = (kChunks % KT::kThreads == 0) || chunk < kChunks;
        const int group8 = chunk >> 3;
        const int row = 8 * (group8 / KT::kChunksPerRow) + (chunk & 7), col = (group8 % KT::kChunksPerRow) * 8;
        u32x4 v = (in_tile && row0 + row < row_limit) ? load_global_16B(base + (long long)(row0 + row) * row_stride + col)
                                                       : zero_u32x4();
        if (in_tile && rows != nullptr) store_shared_16B(rows + row * rows_stride + col, v);
        if (transposed != nullptr) {
            transpose_8x8_halves(v, tid & 31);
            if (in_tile) store_shared_16B(transposed + (col + (chunk & 7)) * transposed_stride + (row & ~7), v);
        }
    }
}

