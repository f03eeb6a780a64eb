// Kernel parameters, passed by value as one struct. volta_train/kernels/params.py mirrors this layout
// field for field (ctypes); keep the two in the same order. All strides are in elements.
#pragma once
#include "vt_numeric.cuh"

struct AttentionParams {
    // 8-byte fields first: pointers, strides, RNG state
    const half_bits* q;
    const half_bits* k;
    const half_bits* v;
    half_bits* o;
    float* lse;                 // [B, H, Nq] (dense) or [H, total_q] (varlen), fp32
    const int* cu_seqlens_q;    // null: dense batch
    const int* cu_seqlens_k;
    const float* alibi_slopes;  // null: no ALiBi; else fp32 [H] or [B, H] (alibi_batch_stride 0 or H)
    long long alibi_batch_stride;
    long long q_batch_stride, q_row_stride, q_head_stride;
    long long k_batch_stride, k_row_stride, k_head_stride;
    long long v_batch_stride, v_row_stride, v_head_stride;
    long long o_batch_stride, o_row_stride, o_head_stride;
    long long lse_batch_stride, lse_head_stride;
    u64 seed, offset;           // dropout Philox state
    // 4-byte fields
    int seqlen_q, seqlen_k;     // dense lengths (varlen: the maxima)
    int nheads, heads_per_kv;   // query heads, query heads per key/value head (GQA)
    int num_m_blocks;           // query blocks per (batch, head)
    int window_left, window_right;  // keys [i + sk - sq - left, i + sk - sq + right]; -1 = unbounded
    float scale_log2;           // softmax_scale * log2(e)
    u32 dropout_threshold;      // keep iff 16-bit uniform >= threshold
    float dropout_rescale;      // 1 / (1 - p)
    int m_blocks_fastest;       // grid order: 1 = (query blocks, batch * heads), 0 = (batch * heads, query blocks)
    float softcap_log2;         // softcap * log2(e), read by the kernels built with SOFTCAP (softcap.cuh)
};

// The backward's extra tensors. dq_accum (fp32, zeroed by the caller, strides dq_*) receives the dK/dV
// kernel's dQ atomics; dq (fp16, same strides) the dQ kernel's result; dsum = rowsum(dO * O), laid out like lse.
struct BackwardParams {
    AttentionParams fwd;
    const half_bits* dout;
    float* dq_accum;
    half_bits* dq;
    half_bits* dk;
    half_bits* dv;
    const float* dsum;
    long long do_batch_stride, do_row_stride, do_head_stride;
    long long dq_batch_stride, dq_row_stride, dq_head_stride;
    long long dk_batch_stride, dk_row_stride, dk_head_stride;
    long long dv_batch_stride, dv_row_stride, dv_head_stride;
    float softmax_scale;
    int num_n_blocks;  // key blocks per (batch, kv head)
};

// The split-KV decoding kernel's parameters (flash_fwd_kernel of a FwdKernelTraits with SPLIT_KV): AttentionParams
// with the KV-cache fields appended after its last field (a derived struct: the same bytes as AttentionParams, then
// these), so that AttentionParams and BackwardParams, which embeds it, keep their layout and every other kernel its
// code. volta_train/kernels/params.py SplitKvKernelParams mirrors it.
// Batch entry b reads K/V batch k_batch_index[b], keys [leftpad_k[b], seqused_k[b]) of it, seen by the masks as keys
// 0 .. seqused_k[b] - leftpad_k[b] - 1 (bottom-right aligned as ever). Its queries: rows 0 .. seqlen_q - 1 of batch b
// (dense), or with cu_seqlens_q (varlen queries: flash_attn_varlen_func on a paged cache) the rows [cu_seqlens_q[b],
// cu_seqlens_q[b + 1]) of the packed q / o (batch strides 0) and lse [nheads, total_q], as the varlen forward lays
// them out, seqlen_q then being the longest; cu_seqlens_k is never read (seqused_k gives the keys). Grid z is the
// split: split s walks only the key blocks [s * blocks_per_split, (s + 1) * blocks_per_split) of its rows' visible
// range. With num_splits > 1 the kernel writes, instead of o / lse, its normalised partial output and log-sum-exp
// (natural log, -inf where the split saw no key), contiguous fp32 arrays indexed by (split, batch * nheads + head,
// row in the entry[, column]), seqlen_q rows per (split, batch, head) (varlen: rows past an entry's own are unused):
//   o_partial   [num_splits, B, nheads, seqlen_q, head_dim],   lse_partial [num_splits, B, nheads, seqlen_q];
// csrc/split_kv_combine.cu combines them. With num_splits == 1 the kernel writes o / lse like the forward kernel.
// Paged KV cache (block_table not null): K/V are [num_pages, page_block_size, kv_heads, head_dim] (k/v_batch_stride
// is the page stride) and logical key j of entry b is row j % page_block_size of page
// block_table[b * block_table_batch_stride + j / page_block_size]; page_block_size is a multiple of the tile's kBlockN
// (decode.py checks), so a key block lies in one page (key_block_base). Not with k_batch_index or leftpad_k (null).
struct SplitKvParams : AttentionParams {
    const int* seqused_k;      // [B] one past the last key of entry b; null: seqlen_k
    const int* k_batch_index;  // [B] K/V batch of entry b (cache_batch_idx); null: b
    const int* leftpad_k;      // [B] first key of entry b (cache_leftpad); null: 0
    float* o_partial;
    float* lse_partial;
    int num_splits;            // = gridDim.z
    int blocks_per_split;      // key blocks (of the tile's kBlockN keys) per split
    const int* block_table;    // [B, max_pages] int32 pages of each entry; null: contiguous K/V (no paging)
    int block_table_batch_stride;
    int page_block_size;       // keys per page
};

// The K/V batch of batch entry b: b itself, or the decoding kernel's k_batch_index[b]; 0 with a paged cache, whose
// page (the K/V batch axis) is looked up per key block (key_block_base).
__device__ __forceinline__ int kv_batch_of(const AttentionParams&, int batch) { return batch; }
__device__ __forceinline__ int kv_batch_of(const SplitKvParams& p, int batch) {
    if (p.block_table != nullptr) return 0;
    return p.k_batch_index != nullptr ? p.k_batch_index[batch] : batch;
}

// The pointer the K/V tile loaders index with row key0 + r (r < kBlockN) for the key block starting at logical key
// key0: `base` itself for contiguous K/V; for a paged cache, base moved to the block's page, less the page's first
// logical row, so that key0 + r lands on row (key0 + r) % page_block_size of it. One table read per key block (the
// same address in every lane); the block never leaves its page (page_block_size % kBlockN == 0, key0 % kBlockN == 0).
// The forward kernel's overload is the identity: its code does not change. The decoding kernel branches at run time
// on block_table (uniform across the grid), so that one compiled variant serves contiguous and paged caches.
__device__ __forceinline__ const half_bits* key_block_base(const AttentionParams&, const half_bits* base, long long,
                                                           long long, int, int) {
    return base;
}
__device__ __forceinline__ const half_bits* key_block_base(const SplitKvParams& p, const half_bits* base,
                                                           long long page_stride, long long row_stride, int batch,
                                                           int key0) {
    if (p.block_table == nullptr) return base;
    const int page = key0 / p.page_block_size;
    const int physical = p.block_table[batch * p.block_table_batch_stride + page];
    return base + ((long long)physical * page_stride - (long long)page * p.page_block_size * row_stride);
}

// ALiBi slope of (batch, head) times log2(e): the bias -slope * |i + sk - sq - j| in the log2 domain. 0 = none.
__device__ __forceinline__ float alibi_slope_log2(const AttentionParams& p, int batch, int head) {
    return p.alibi_slopes != nullptr ? p.alibi_slopes[batch * p.alibi_batch_stride + head] * kLog2e : 0.f;
}

// Where one sequence lives: its token offset in the packed tensors and its lengths.
struct SequenceExtent {
    int batch;
    long long q_start, k_start;
    int seqlen_q, seqlen_k;

    __device__ __forceinline__ SequenceExtent(const AttentionParams& p, int batch_) : batch(batch_) {
        if (p.cu_seqlens_q != nullptr) {
            q_start = p.cu_seqlens_q[batch];
            k_start = p.cu_seqlens_k[batch];
            seqlen_q = p.cu_seqlens_q[batch + 1] - (int)q_start;
            seqlen_k = p.cu_seqlens_k[batch + 1] - (int)k_start;
        } else {
            q_start = 0;
            k_start = 0;
            seqlen_q = p.seqlen_q;
            seqlen_k = p.seqlen_k;
        }
    }
    // The decoding kernel's batch entry: keys [leftpad_k[b], seqused_k[b]) of its K/V batch; queries dense, or packed
    // through cu_seqlens_q (a uniform branch: the pointer is the same for the whole grid).
    __device__ __forceinline__ SequenceExtent(const SplitKvParams& p, int batch_) : batch(batch_) {
        if (p.cu_seqlens_q != nullptr) {
            q_start = p.cu_seqlens_q[batch];
            seqlen_q = p.cu_seqlens_q[batch + 1] - (int)q_start;
        } else {
            q_start = 0;
            seqlen_q = p.seqlen_q;
        }
        const int first = p.leftpad_k != nullptr ? p.leftpad_k[batch] : 0;
        k_start = first;
        seqlen_k = (p.seqused_k != nullptr ? p.seqused_k[batch] : p.seqlen_k) - first;
    }
};
