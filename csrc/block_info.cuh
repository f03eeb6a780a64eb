// The prologue the forward, decoding and dQ kernels share: which query block of which (batch, head) a CTA owns,
// where that sequence's rows start in the tensors, and which key blocks its rows see.
#pragma once
#include "masking.cuh"
#include "params.cuh"

// A CTA's query block. Blocks are issued x fastest. Full attention: (query blocks, batch * heads), so the CTAs running
// together share K and V in L2. Causal: (batch * heads, query blocks), so every (batch, head) gets its last query
// block (the longest) in the first waves and the short ones fill the tail. Params: AttentionParams or SplitKvParams
// (whose SequenceExtent reads the decoding kernel's key lengths).
template <class KT>
struct QueryBlockInfo {
    int bh;              // batch * nheads + head
    int m_block;         // the query block, last first
    int head, batch;
    SequenceExtent seq;  // the batch entry's offsets and lengths
    int m0;              // the block's first query row

    template <class Params>
    __device__ __forceinline__ explicit QueryBlockInfo(const Params& prm)
        : bh(prm.m_blocks_fastest ? (int)blockIdx.y : (int)blockIdx.x),
          m_block(prm.num_m_blocks - 1 - (int)(prm.m_blocks_fastest ? blockIdx.x : blockIdx.y)),
          head(bh % prm.nheads),
          batch(bh / prm.nheads),
          seq(prm, batch),
          m0(m_block * KT::kBlockM) {}

    // The block starts past the sequence's last query row (varlen, or fewer rows than the grid's longest).
    __device__ __forceinline__ bool empty() const { return m0 >= seq.seqlen_q; }

    // Row 0 of the sequence in a [batch, row, head, dim] query-side tensor (Q, O, dO, dQ).
    template <class T>
    __device__ __forceinline__ T* query_rows(T* base, long long batch_stride, long long row_stride,
                                             long long head_stride) const {
        return base + batch * batch_stride + seq.q_start * row_stride + head * head_stride;
    }
    // Row 0 of the sequence in a key-side tensor (K, V) of K/V batch kv_batch and head kv_head.
    template <class T>
    __device__ __forceinline__ T* key_rows(T* base, long long batch_stride, long long row_stride,
                                           long long head_stride, int kv_batch, int kv_head) const {
        return base + kv_batch * batch_stride + seq.k_start * row_stride + kv_head * head_stride;
    }
    // Element 0 of the sequence in a per-row vector laid out like lse (lse, dsum).
    template <class T>
    __device__ __forceinline__ T* row_vector(T* base, long long batch_stride, long long head_stride) const {
        return base + batch * batch_stride + head * head_stride + seq.q_start;
    }
};

// The key blocks [begin, end) that the block's rows [m0, row_end) may see (begin == end: none).
struct KeyBlockRange {
    int row_end;  // one past the block's last row inside the sequence
    int begin, end;
};
template <class KT>
__device__ __forceinline__ KeyBlockRange visible_key_blocks(const VisibleKeys& vis, int m0, int seqlen_q) {
    const int row_end = min(m0 + KT::kBlockM, seqlen_q);
    const int begin = vis.first_key(m0) / KT::kBlockN;
    const int key_end = vis.end_key(row_end);
    const int end = key_end > vis.first_key(m0) ? (key_end + KT::kBlockN - 1) / KT::kBlockN : begin;
    return {row_end, begin, end};
}
