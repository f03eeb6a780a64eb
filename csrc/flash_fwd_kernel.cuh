// The FlashAttention-2 forward kernel on Volta (sm_70) tensor cores: mma.sync.m8n8k4 only, no ldmatrix, no cp.async.
// The pieces live by concept: warp geometry, Q operand and the two products in warp_tile.cuh, the online
// softmax in softmax.cuh, mask and ALiBi in masking.cuh, dropout in dropout.cuh, tile movers in tile_io.cuh;
// this file is the per-key-block step, the epilogue and the kernel.
//
// Per CTA: kBlockM query rows of one (batch, head). Q is loaded once: with KT::kQInSmem (most tiles of the tables)
// into a shared-memory tile whose A fragments are read per use (fewer registers, more resident warps), otherwise
// straight from global memory into A-fragment registers held for the whole kernel. K and V blocks pass through
// registers into padded shared memory; S = Q K^T and P stay in registers; O accumulates in registers and leaves
// through shared memory in 16-byte rows. Two accumulation modes (SparkAttention's terms):
//   FP32-ACC: both GEMMs accumulate in fp32; P is rounded to fp16 for the second GEMM.
//   FP16-ACC: both GEMMs accumulate in fp16 (Q is pre-scaled by softmax_scale * log2(e) so the fp16
//             scores cannot overflow); each key block's P V partial is added into fp32 O, and the
//             softmax statistics stay fp32, so long sequences cannot overflow the output.
#pragma once
#include "block_info.cuh"
#include "dropout.cuh"
#include "kernel_traits.cuh"
#include "launch_geometry.cuh"
#include "masking.cuh"
#include "softcap.cuh"
#include "softmax.cuh"
#include "tile_io.cuh"
#include "warp_tile.cuh"

// Per-lane state of the forward pass: the output accumulators and the softmax statistics of the lane's rows.
template <class KT>
struct FwdAccumulators {
    float o[KT::kMTiles][KT::kOTilesPerQuadPair][8];
    OnlineSoftmax<KT> softmax;

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int a = 0; a < KT::kMTiles; ++a) {
#pragma unroll
            for (int ot = 0; ot < KT::kOTilesPerQuadPair; ++ot)
#pragma unroll
                for (int i = 0; i < 8; ++i) o[a][ot][i] = 0.f;
            softmax.init_rows(a);
        }
    }

    // O's rows of m-tile a times their factors (the online softmax's rescale of a raised max).
    __device__ __forceinline__ void rescale_rows(int a, const float (&rescale)[FwdFragmentLayout<KT>::kRowSlots]) {
#pragma unroll
        for (int ot = 0; ot < KT::kOTilesPerQuadPair; ++ot)
#pragma unroll
            for (int i = 0; i < 8; ++i) o[a][ot][i] *= rescale[FwdFragmentLayout<KT>::row_slot(i)];
    }
};

// One key block for one warp: S = Q K^T, mask, online softmax update (rescaling O), P in A layout,
// dropout. Returns P as f16x2 registers: p_own[a][nt] holds the keys of this lane's quad-pair column,
// p_partner[x - 1][a][nt] those received from the quad-pair in column qp_n ^ x (2x2 and 1x4).
template <class KT>
__device__ __forceinline__ void fwd_scores_to_probs(const QOperand<KT>& q, const half_bits* k_tile,
                                                    const FwdWarpGeometry<KT>& g, const VisibleKeys& vis,
                                                    int key0, bool needs_mask, float scale_log2, float softcap_log2,
                                                    float alibi_log2, const DropoutRng& rng, FwdAccumulators<KT>& acc,
                                                    u32 (&p_own)[KT::kMTiles][KT::kSTilesPerQuadPair][4],
                                                    u32 (&p_partner)[KT::kPartnerSlots][KT::kMTiles][KT::kSTilesPerQuadPair][4]) {
    using Layout = FwdFragmentLayout<KT>;
    constexpr int kRowSlots = Layout::kRowSlots;
    const LaneInQuadPair& lq = g.lq;
    // ---- S = Q K^T
    float s[KT::kMTiles][KT::kSTilesPerQuadPair][8];
    rows_times_tile_rows<KT>(q, k_tile, g, s);

    // ---- soft-capping (before bias and masks, as in flash-attn): tanh of the scaled score, new score scale
    float score_scale = KT::kAccumF16 ? 1.f : scale_log2;
    if (KT::kSoftcap) {
        const SoftCap cap(softcap_log2, score_scale);
        cap_scores(s, cap);
        score_scale = cap.score_scale;
    }

    // ---- mask and ALiBi bias: only key blocks that cross a boundary (or calls with ALiBi) pay for it.
    // FP32-ACC scores are not yet scaled: the bias is divided by the scale so that it comes out as
    // -slope * log2(e) * |i + shift - j| in the exponent (scale > 0, so max commutes with it).
    if (needs_mask || alibi_log2 != 0.f)
        mask_and_bias_scores<Layout>(s, g, vis, key0, needs_mask, alibi_log2 / score_scale);

    // ---- online softmax, P in the A-operand layout, dropout, P of the partner quad-pairs
#pragma unroll
    for (int a = 0; a < KT::kMTiles; ++a) {
        float exp_offset[kRowSlots], rescale[kRowSlots];
        if constexpr (KT::kLazyRescale) {
            float tile_max[kRowSlots];
            if (acc.softmax.lazy_block_max(a, s[a], score_scale, tile_max)) {
                acc.softmax.lazy_raise(a, tile_max, rescale);
                acc.rescale_rows(a, rescale);
            }
#pragma unroll
            for (int r = 0; r < kRowSlots; ++r) exp_offset[r] = safe_row_max(acc.softmax.row_max[a][r]);
        } else {
            acc.softmax.update_max(a, s[a], score_scale, exp_offset, rescale);
            acc.rescale_rows(a, rescale);
        }
#pragma unroll
        for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int r = Layout::row_slot(i);
                s[a][nt][i] = acc.softmax.exp2_and_sum(a, r, s[a][nt][i], score_scale, exp_offset[r]);
            }
            to_row_fragment<KT>(s[a][nt], lq, p_own[a][nt]);
            if (KT::kDropout) {
                const int row = g.mtile_row0(a) + lq.operand_row();
                rng.apply(p_own[a][nt], (u32)((key0 + g.stile_key0(nt)) >> 3), (u32)row);
            }
            share_with_partner_quad_pairs<KT>(p_own[a][nt], p_partner, a, nt);
        }
    }
}

// Final normalisation: O / l (times 1 / (1 - p) under dropout), lse = (m + log2 l) * ln 2; rows with
// no visible key get O = 0 and lse = +inf. O is staged in shared memory and written in 16-byte rows.
template <class KT>
__device__ __forceinline__ void fwd_epilogue(const AttentionParams& prm, FwdAccumulators<KT>& acc,
                                             const FwdWarpGeometry<KT>& g, int tid, int m0, int seqlen_q,
                                             half_bits* o_stage, half_bits* o_base, float* lse_base) {
    using Layout = FwdFragmentLayout<KT>;
    constexpr int kRowSlots = Layout::kRowSlots;
    const LaneInQuadPair& lq = g.lq;
    const float output_scale = KT::kDropout ? prm.dropout_rescale : 1.f;
#pragma unroll
    for (int a = 0; a < KT::kMTiles; ++a) {
        float inv_sum[kRowSlots];
#pragma unroll
        for (int r = 0; r < kRowSlots; ++r) {
            const float l = acc.softmax.row_total(a, r);
            inv_sum[r] = l > 0.f ? output_scale / l : 0.f;
            const float lse = acc.softmax.lse(a, r, l);
            // one writer per row: FP32-ACC lanes t = 0, 1 own rows t + 2r (+4 hi); FP16-ACC lanes own row t (+4 hi)
            const bool writer = g.qp_n == 0 && (KT::kAccumF16 || (lq.t & 2) == 0);
            const int row = g.mtile_row0(a) + Layout::slot_row(lq, r);
            if (writer && row < seqlen_q) lse_base[row] = lse;
        }
        const FwdWarpGeometry<KT> gs((tid & ~31) | staging_lane(g.lane), m0);  // whose fragments this lane stores
        const int row = gs.mtile_row0(a) - m0 + gs.lq.operand_row();
#pragma unroll
        for (int ot = 0; ot < KT::kOTilesPerQuadPair; ++ot) {
            float scaled[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) scaled[i] = acc.o[a][ot][i] * inv_sum[Layout::row_slot(i)];
            stage_acc_tile_row<!KT::kAccumF16>(scaled, g.lane, o_stage + KT::OStageRows::offset(row) + gs.o_col(ot, 0));
        }
    }
    __syncthreads();
    for (int chunk = tid; chunk < KT::kBlockM * KT::kChunksPerRow; chunk += KT::kThreads) {
        int row, col;
        tile_chunk_position<KT>(chunk, row, col);
        if (m0 + row < seqlen_q)
            store_global_16B(o_base + (long long)(m0 + row) * prm.o_row_stride + col,
                             load_shared_16B(o_stage + KT::OStageRows::offset(row) + col));
    }
}

// The split-KV kernel's epilogue with several splits: the split's normalised output O / l (fp32, 0 where l = 0) and
// log-sum-exp (natural log, -inf where the split saw no key) of every row < seqlen_q (the entry's), straight from the
// registers to o_part [row][head_dim] and lse_part [row] (SplitKvParams); split_kv_combine.cu combines the splits.
template <class KT>
__device__ __forceinline__ void fwd_split_epilogue(FwdAccumulators<KT>& acc, const FwdWarpGeometry<KT>& g, int seqlen_q,
                                                   float* o_part, float* lse_part) {
    using Layout = FwdFragmentLayout<KT>;
    constexpr int kRowSlots = Layout::kRowSlots;
    const LaneInQuadPair& lq = g.lq;
#pragma unroll
    for (int a = 0; a < KT::kMTiles; ++a) {
        float inv_sum[kRowSlots];
#pragma unroll
        for (int r = 0; r < kRowSlots; ++r) {
            const float l = acc.softmax.row_total(a, r);
            inv_sum[r] = l > 0.f ? 1.f / l : 0.f;
            const float lse = l > 0.f ? acc.softmax.lse(a, r, l) : neg_inf();
            const bool writer = g.qp_n == 0 && (KT::kAccumF16 || (lq.t & 2) == 0);  // as in fwd_epilogue
            const int row = g.mtile_row0(a) + Layout::slot_row(lq, r);
            if (writer && row < seqlen_q) lse_part[row] = lse;
        }
#pragma unroll
        for (int ot = 0; ot < KT::kOTilesPerQuadPair; ++ot)
#pragma unroll
            for (int i = 0; i < 8; i += 2) {  // elements i, i + 1: one row, two adjacent columns
                const int row = g.mtile_row0(a) + Layout::row(lq, i);
                const int col = g.o_col(ot, Layout::phys_col(lq, i));
                const float scale = inv_sum[Layout::row_slot(i)];
                if (row < seqlen_q)
                    store_global_f32x2(o_part + (long long)row * KT::kHeadDim + col, acc.o[a][ot][i] * scale,
                                       acc.o[a][ot][i + 1] * scale);
            }
    }
}

// Key blocks [n_begin, n_end) of a CTA: all of them in the forward kernel; in the split-KV kernel only those of its
// split (grid z), which may leave none.
__device__ __forceinline__ void split_key_blocks(const AttentionParams&, int&, int&) {}
__device__ __forceinline__ void split_key_blocks(const SplitKvParams& p, int& n_begin, int& n_end) {
    const int first = (int)blockIdx.z * p.blocks_per_split;
    n_begin = max(n_begin, first);
    n_end = min(n_end, first + p.blocks_per_split);
}

// What one key-block step of a CTA works on (references into the kernel's registers and shared memory).
template <class KT>
struct FwdBlockState {
    const QOperand<KT>& q;
    FwdAccumulators<KT>& acc;
    u32x4 (&stage)[KT::kChunksPerThread];
    half_bits* k_tile;
    half_bits* v_tile;
    const half_bits* k_base;
    const half_bits* v_base;
    const FwdWarpGeometry<KT>& g;
    const VisibleKeys& vis;
    const DropoutRng& rng;
    const typename KT::Params& prm;  // SplitKvParams in the decoding kernel: key_block_base reads its block table
    const SequenceExtent& seq;
    int tid;
    float alibi_log2;
};


// Processing order of a CTA's key blocks [begin, end): the unmasked blocks [full_begin, full_end) first,
// then the masked ones, [full_end, end) and [begin, full_begin).
struct KeyBlockOrder {
    int begin, full_begin, full_end, end;

    __device__ __forceinline__ int masked_count() const { return (end - full_end) + (full_begin - begin); }
    __device__ __forceinline__ int masked(int i) const {
        return i < end - full_end ? full_end + i : begin + (i - (end - full_end));
    }
    __device__ __forceinline__ int first() const { return full_begin < full_end ? full_begin : masked(0); }
    // The block processed after n_block, or -1.
    __device__ __forceinline__ int next(int n_block) const {
        if (n_block >= full_begin && n_block < full_end) {
            if (n_block + 1 < full_end) return n_block + 1;
            return masked_count() > 0 ? masked(0) : -1;
        }
        if (n_block >= full_end) {
            if (n_block + 1 < end) return n_block + 1;
            return begin < full_begin ? begin : -1;
        }
        return n_block + 1 < full_begin ? n_block + 1 : -1;
    }
};

// One key block: S, softmax and P while the block's V is in flight; V to shared memory with the next K in
// flight; then O += P V. Unmasked blocks (every row of the CTA sees every key) run branch-free; MASKED
// blocks cross the causal diagonal, a window edge or the end of the keys: warps whose rows see none of
// the block skip it, the others mask elements.
// MAY_MASK: the element mask is applied when needs_mask; SKIP_EMPTY_WARPS: warps whose rows see no key of
// the block skip its tensor-core work (only in the split masked loop: it makes the GEMMs conditional).
template <class KT, bool MAY_MASK, bool SKIP_EMPTY_WARPS>
__device__ __forceinline__ void fwd_key_block(FwdBlockState<KT>& st, int n_block, int next_block, bool needs_mask) {
    const int key0 = n_block * KT::kBlockN;
    load_v_block<KT>(key_block_base(st.prm, st.v_base, st.prm.v_batch_stride, st.prm.v_row_stride, st.seq.batch, key0),
                     st.prm.v_row_stride, key0, st.seq.seqlen_k, st.tid, st.stage);
    // sm_80+ also skips empty warp tiles in the single loop: each emulated m8n8k4 costs ~100 instructions
    // there. sm_70 keeps the single loop's tensor-core work branch-free (the diagonal waste is a few %).
    // The split-KV decoding kernel skips them everywhere: its CTAs often hold fewer rows than kBlockM.
    const bool may_skip = SKIP_EMPTY_WARPS || KT::kSplitKv || (kAccumulatorMajorMma && MAY_MASK && needs_mask);
    const int warp_row_end = min(st.g.warp_row0 + KT::kRowsPerWarp, st.seq.seqlen_q);
    const bool warp_active =
        !may_skip || (st.g.warp_row0 < warp_row_end &&
                      !st.vis.tile_is_empty(st.g.warp_row0, warp_row_end, key0, key0 + KT::kBlockN));
    u32 p_own[KT::kMTiles][KT::kSTilesPerQuadPair][4];
    u32 p_partner[KT::kPartnerSlots][KT::kMTiles][KT::kSTilesPerQuadPair][4];
    if (warp_active)
        fwd_scores_to_probs<KT>(st.q, st.k_tile, st.g, st.vis, key0, MAY_MASK && needs_mask, st.prm.scale_log2,
                                st.prm.softcap_log2, st.alibi_log2, st.rng, st.acc, p_own, p_partner);
    __syncthreads();  // every warp is done with this K block and the previous V block
    store_vt_block<KT>(st.v_tile, st.tid, st.stage);
    if (next_block >= 0) {
        const int next_key0 = next_block * KT::kBlockN;
        load_kv_block<KT>(key_block_base(st.prm, st.k_base, st.prm.k_batch_stride, st.prm.k_row_stride, st.seq.batch,
                                         next_key0),
                          st.prm.k_row_stride, next_key0, st.seq.seqlen_k, st.tid, st.stage);
    }
    __syncthreads();  // V visible
    if (warp_active) accumulate_rows_times_transposed_tile<KT>(p_own, p_partner, st.v_tile, st.g, st.acc.o);
    if (next_block >= 0) store_kv_block<KT>(st.k_tile, st.tid, st.stage);
    __syncthreads();  // next K visible; every warp is done with this V block
}

// The kernel. KT::Params is AttentionParams, or with SPLIT_KV the decoding kernel's SplitKvParams (volta_train/kernels/
// decode.py; grid (query blocks, batch * heads, splits) or (batch * heads, query blocks, splits)), whose overloads of
// SequenceExtent, kv_batch_of, key_block_base (paged caches) and split_key_blocks read its extra fields.
template <class KT>
__global__ void __launch_bounds__(KT::kThreads, KT::kMinBlocksPerSM) flash_fwd_kernel(const typename KT::Params prm) {
    extern __shared__ __align__(16) unsigned char smem[];
    half_bits* k_tile = reinterpret_cast<half_bits*>(smem);
    half_bits* v_tile = reinterpret_cast<half_bits*>(smem + KT::kTileBytes);

    const QueryBlockInfo<KT> blk(prm);
    if (blk.empty()) return;
    const int bh = blk.bh, head = blk.head, batch = blk.batch, m0 = blk.m0;
    const SequenceExtent& seq = blk.seq;
    const int kv_head = head / prm.heads_per_kv;
    const VisibleKeys vis(prm, seq);

    const half_bits* q_base = blk.query_rows(prm.q, prm.q_batch_stride, prm.q_row_stride, prm.q_head_stride);
    const int kv_batch = kv_batch_of(prm, batch);
    const half_bits* k_base = blk.key_rows(prm.k, prm.k_batch_stride, prm.k_row_stride, prm.k_head_stride, kv_batch, kv_head);
    const half_bits* v_base = blk.key_rows(prm.v, prm.v_batch_stride, prm.v_row_stride, prm.v_head_stride, kv_batch, kv_head);
    half_bits* o_base = blk.query_rows(prm.o, prm.o_batch_stride, prm.o_row_stride, prm.o_head_stride);
    float* lse_base = blk.row_vector(prm.lse, prm.lse_batch_stride, prm.lse_head_stride);

    const int tid = threadIdx.x;
    const FwdWarpGeometry<KT> g(tid, m0);
    const DropoutRng rng(prm.seed, prm.offset, prm.dropout_threshold, (u32)(batch * prm.nheads + head));

    FwdAccumulators<KT> acc;
    acc.init();

    const KeyBlockRange keys = visible_key_blocks<KT>(vis, m0, seq.seqlen_q);
    const int cta_row_end = keys.row_end;
    int n_begin = keys.begin, n_end = keys.end;
    split_key_blocks(prm, n_begin, n_end);

    // A CTA whose rows see no key (seqlen_q > seqlen_k under causal or a window) writes zeros and lse = +inf
    // and touches no shared memory before the epilogue: Q is loaded only where a key block follows. (Loading
    // it anyway would race: the Q tile in shared memory (kQInSmem) overlaps the epilogue's O staging area, and with
    // no key-block barrier in between, a late warp's Q store could overwrite another warp's staged O row.)
    if (n_begin < n_end) {
        QOperand<KT> q;
        load_q<KT>(q_base, prm.q_row_stride, m0, seq.seqlen_q, prm.scale_log2, g, tid,
                   reinterpret_cast<half_bits*>(smem + KT::kTileBytes + KT::kVtTileBytes), q);
        // Split loop (KT::kSplitMaskedLoop): key blocks every row of the CTA sees entirely run first, without
        // masks or per-warp checks, then the blocks crossing a mask boundary, skipped by warps that see none
        // of them. Single loop: every warp computes every block and only the mask is conditional (fewer
        // registers: one inlined copy of the block step).
        const int full_begin = KT::kSplitMaskedLoop ? min(n_end, max(n_begin, vis.first_full_block(cta_row_end, KT::kBlockN))) : n_begin;
        const int full_end = KT::kSplitMaskedLoop ? max(full_begin, min(n_end, vis.end_full_block(m0, KT::kBlockN))) : n_begin;
        const KeyBlockOrder order{n_begin, full_begin, full_end, n_end};
        u32x4 stage[KT::kChunksPerThread];
        const int first_key0 = order.first() * KT::kBlockN;
        load_kv_block<KT>(key_block_base(prm, k_base, prm.k_batch_stride, prm.k_row_stride, batch, first_key0),
                          prm.k_row_stride, first_key0, seq.seqlen_k, tid, stage);
        store_kv_block<KT>(k_tile, tid, stage);
        __syncthreads();
        FwdBlockState<KT> st{q, acc, stage, k_tile, v_tile, k_base, v_base, g, vis, rng, prm, seq, tid,
                             alibi_slope_log2(prm, batch, head)};
        if (KT::kSplitMaskedLoop) {
            for (int n_block = full_begin; n_block < full_end; ++n_block)
                fwd_key_block<KT, false, false>(st, n_block, order.next(n_block), false);
            for (int i = 0; i < order.masked_count(); ++i) {
                const int n_block = order.masked(i);
                fwd_key_block<KT, true, true>(st, n_block, order.next(n_block), true);
            }
        } else {
            for (int n_block = n_begin; n_block < n_end; ++n_block) {
                const int key0 = n_block * KT::kBlockN;
                const bool needs_mask = !vis.tile_is_full(m0, cta_row_end, key0, key0 + KT::kBlockN);
                fwd_key_block<KT, true, false>(st, n_block, n_block + 1 < n_end ? n_block + 1 : -1, needs_mask);
            }
        }
    }
    if constexpr (KT::kSplitKv) {
        if (prm.num_splits > 1) {
            const int num_bh = prm.m_blocks_fastest ? (int)gridDim.y : (int)gridDim.x;
            // seqlen_q rows per (split, batch, head): the entry's own count when dense, the longest with varlen queries
            const long long part = ((long long)blockIdx.z * num_bh + bh) * prm.seqlen_q;
            fwd_split_epilogue<KT>(acc, g, seq.seqlen_q, prm.o_partial + part * KT::kHeadDim, prm.lse_partial + part);
            return;
        }
    }
    fwd_epilogue<KT>(prm, acc, g, tid, m0, seq.seqlen_q, reinterpret_cast<half_bits*>(smem), o_base, lse_base);
}

// What the host launches flash_fwd_kernel<KT> with (launch_geometry.cuh).
template <class KT>
__device__ LaunchGeometry flash_fwd_kernel_geometry = {KT::kSmemBytes, KT::kThreads, KT::kBlockM, KT::kBlockN};
