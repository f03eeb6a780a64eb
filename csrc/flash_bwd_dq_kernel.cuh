// The backward's dQ kernel (query blocks in parallel, no atomics: bitwise deterministic). It serves
// deterministic=True, next to the dK/dV kernel run without its dQ atomics.
//
// Per CTA: kBlockM query rows of one (batch, head), walking the key blocks like the forward:
//   S = Q K^T, dP = dO V^T   (A = the warp's Q / dO rows, B = K / V rows from shared memory)
//   P = exp2(S * scale * log2 e - lse * log2 e),  dS = P * (dP * Z / (1 - p) - D)
//   dQ += dS K               (A = dS row fragments, B = K^T from shared memory)
// and writes dQ * softmax_scale. It shares the forward's warp tile (warp_tile.cuh): geometry, operands and
// both products.
#pragma once
#include "block_info.cuh"
#include "dropout.cuh"
#include "kernel_traits.cuh"
#include "launch_geometry.cuh"
#include "masking.cuh"
#include "softcap.cuh"
#include "tile_io.cuh"
#include "warp_tile.cuh"

// Shared memory of the dQ kernel: K [key][head_dim], V [key][head_dim], K^T [head_dim][key] (the forward's
// V^T slot) and the Q / dO tiles when they live in shared memory.
template <class KT>
struct DqLayout {
    static constexpr int kOffK = 0;
    static constexpr int kOffKt = KT::kTileBytes;
    static constexpr int kOffV = kOffKt + KT::kVtTileBytes;
    static constexpr int kOffQ = kOffV + KT::kTileBytes;
    static constexpr int kQTileBytes = KT::kQInSmem ? KT::QRows::bytes(KT::kBlockM) : 0;
    static constexpr int kOffDo = kOffQ + kQTileBytes;
    static constexpr int kBytes = const_max(kOffDo + kQTileBytes, KT::kOStageBytes);
    static_assert(kBytes <= 96 * 1024, "a V100 block has at most 96 KB of shared memory");
};

// dS of one key block for one warp, as f16x2 row fragments (own quad-pair column and partners').
template <class KT>
__device__ __forceinline__ void dq_block_ds(const QOperand<KT>& q,
                                            const QOperand<KT>& dout, const half_bits* k_tile,
                                            const half_bits* v_tile, const FwdWarpGeometry<KT>& g, const VisibleKeys& vis,
                                            int key0, bool needs_mask, float score_scale, float softcap_log2,
                                            float alibi_log2,
                                            const float (&lse2)[KT::kMTiles][FwdFragmentLayout<KT>::kRowSlots],
                                            const float (&dsum)[KT::kMTiles][FwdFragmentLayout<KT>::kRowSlots],
                                            const DropoutRng& rng, float dropout_rescale,
                                            u32 (&ds_own)[KT::kMTiles][KT::kSTilesPerQuadPair][4],
                                            u32 (&ds_partner)[KT::kPartnerSlots][KT::kMTiles][KT::kSTilesPerQuadPair][4]) {
    using Layout = FwdFragmentLayout<KT>;
    const LaneInQuadPair& lq = g.lq;
    float s[KT::kMTiles][KT::kSTilesPerQuadPair][8], dp[KT::kMTiles][KT::kSTilesPerQuadPair][8];
    rows_times_tile_rows<KT>(q, k_tile, g, s);
    rows_times_tile_rows<KT>(dout, v_tile, g, dp);
    float to_tanh = 0.f;  // soft-capping: S -> argument of tanh (softcap.cuh)
    if (KT::kSoftcap) {
        const SoftCap cap(softcap_log2, score_scale);
        to_tanh = cap.to_tanh;
        score_scale = cap.score_scale;
    }
#pragma unroll
    for (int a = 0; a < KT::kMTiles; ++a)
#pragma unroll
        for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt) {
            u32 keep_lo = 0xffffffffu, keep_hi = 0xffffffffu;
            if (KT::kDropout) {
                const u32 mine = rng.keep_bits((u32)((key0 + g.stile_key0(nt)) >> 3),
                                               (u32)(g.mtile_row0(a) + lq.operand_row()));
                keep_bits_of_tile(mine, g.lane, keep_lo, keep_hi);
            }
            float ds[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int row_in_tile = Layout::row(lq, i);
                const int col = Layout::phys_col(lq, i);
                const int slot = Layout::row_slot(i);
                float score = s[a][nt][i];
                float capped_slope = 1.f;  // d(capped score)/d(score), up to the scale change
                if (KT::kSoftcap) {
                    score = tanh_by_exp2(score * to_tanh);
                    capped_slope = SoftCap::derivative(score);
                }
                float bias = 0.f;  // ALiBi, log2 domain
                const int row = g.mtile_row0(a) + row_in_tile, key = key0 + g.stile_key0(nt) + col;
                if (needs_mask && !vis.visible(row, key)) score = neg_inf();
                else if (alibi_log2 != 0.f) bias = alibi_log2 * vis.diagonal_distance(row, key);
                const float p = fast_exp2(fmaf(score, score_scale, -lse2[a][slot] - bias));
                float dpz = dp[a][nt][i];
                if (KT::kDropout) dpz = tile_keep_bit(keep_lo, keep_hi, row_in_tile, col) ? dpz * dropout_rescale : 0.f;
                ds[i] = p * (dpz - dsum[a][slot]);
                if (KT::kSoftcap) ds[i] *= capped_slope;
            }
            to_row_fragment<KT>(ds, lq, ds_own[a][nt]);
            share_with_partner_quad_pairs<KT>(ds_own[a][nt], ds_partner, a, nt);
        }
}

template <class KT>
__global__ void __launch_bounds__(KT::kThreads, KT::kMinBlocksPerSM) flash_bwd_dq_kernel(const BackwardParams bp) {
    extern __shared__ __align__(16) unsigned char smem[];
    using L = DqLayout<KT>;
    using Layout = FwdFragmentLayout<KT>;
    const AttentionParams& prm = bp.fwd;
    const QueryBlockInfo<KT> blk(prm);
    if (blk.empty()) return;
    const int head = blk.head, batch = blk.batch, m0 = blk.m0;
    const SequenceExtent& seq = blk.seq;
    const int kv_head = head / prm.heads_per_kv;
    const VisibleKeys vis(prm, seq);
    const int tid = threadIdx.x;
    const FwdWarpGeometry<KT> g(tid, m0);
    half_bits* k_tile = reinterpret_cast<half_bits*>(smem + L::kOffK);
    half_bits* kt_tile = reinterpret_cast<half_bits*>(smem + L::kOffKt);
    half_bits* v_tile = reinterpret_cast<half_bits*>(smem + L::kOffV);

    const half_bits* q_base = blk.query_rows(prm.q, prm.q_batch_stride, prm.q_row_stride, prm.q_head_stride);
    const half_bits* do_base = blk.query_rows(bp.dout, bp.do_batch_stride, bp.do_row_stride, bp.do_head_stride);
    const half_bits* k_base = blk.key_rows(prm.k, prm.k_batch_stride, prm.k_row_stride, prm.k_head_stride, batch, kv_head);
    const half_bits* v_base = blk.key_rows(prm.v, prm.v_batch_stride, prm.v_row_stride, prm.v_head_stride, batch, kv_head);
    const float* lse_base = blk.row_vector(prm.lse, prm.lse_batch_stride, prm.lse_head_stride);
    const float* dsum_base = blk.row_vector(bp.dsum, prm.lse_batch_stride, prm.lse_head_stride);

    // Q pre-scaled by scale * log2 e under FP16-ACC (as in the forward); dO with scale 1 (exact).
    QOperand<KT> q, dout;
    load_q<KT>(q_base, prm.q_row_stride, m0, seq.seqlen_q, prm.scale_log2, g, tid,
                      reinterpret_cast<half_bits*>(smem + L::kOffQ), q);
    load_q<KT>(do_base, bp.do_row_stride, m0, seq.seqlen_q, 1.f, g, tid,
                      reinterpret_cast<half_bits*>(smem + L::kOffDo), dout);
    // this lane's rows: log2-domain lse and dsum
    constexpr int kSlots = Layout::kRowSlots;
    float lse2[KT::kMTiles][kSlots], dsum[KT::kMTiles][kSlots];
#pragma unroll
    for (int a = 0; a < KT::kMTiles; ++a)
#pragma unroll
        for (int r = 0; r < kSlots; ++r) {
            const int row = g.mtile_row0(a) + Layout::slot_row(g.lq, r);
            const bool valid = row < seq.seqlen_q;
            lse2[a][r] = valid ? lse_base[row] * kLog2e : pos_inf();
            dsum[a][r] = valid ? dsum_base[row] : 0.f;
        }
    float dq[KT::kMTiles][KT::kOTilesPerQuadPair][8];
#pragma unroll
    for (int a = 0; a < KT::kMTiles; ++a)
#pragma unroll
        for (int ot = 0; ot < KT::kOTilesPerQuadPair; ++ot)
#pragma unroll
            for (int i = 0; i < 8; ++i) dq[a][ot][i] = 0.f;
    const DropoutRng rng(prm.seed, prm.offset, prm.dropout_threshold, (u32)(batch * prm.nheads + head));
    const float score_scale = KT::kAccumF16 ? 1.f : prm.scale_log2;

    const KeyBlockRange keys = visible_key_blocks<KT>(vis, m0, seq.seqlen_q);
    const int cta_row_end = keys.row_end, n_begin = keys.begin, n_end = keys.end;
    for (int n_block = n_begin; n_block < n_end; ++n_block) {
        const int key0 = n_block * KT::kBlockN;
        __syncthreads();  // the previous block's tiles are no longer read (and Q / dO tiles are written)
        load_rows_and_transpose<KT, KT::kBlockN, typename KT::KRows, typename KT::VtRows>(
            k_base, prm.k_row_stride, key0, seq.seqlen_k, tid, k_tile, kt_tile);
        load_rows_and_transpose<KT, KT::kBlockN, typename KT::KRows, typename KT::VtRows>(
            v_base, prm.v_row_stride, key0, seq.seqlen_k, tid, v_tile, nullptr);
        __syncthreads();
        const bool needs_mask = !vis.tile_is_full(m0, cta_row_end, key0, key0 + KT::kBlockN);
        u32 ds_own[KT::kMTiles][KT::kSTilesPerQuadPair][4];
        u32 ds_partner[KT::kPartnerSlots][KT::kMTiles][KT::kSTilesPerQuadPair][4];
        dq_block_ds<KT>(q, dout, k_tile, v_tile, g, vis, key0, needs_mask, score_scale, prm.softcap_log2,
                        alibi_slope_log2(prm, batch, head),
                        lse2, dsum, rng,
                        prm.dropout_rescale, ds_own, ds_partner);
        accumulate_rows_times_transposed_tile<KT>(ds_own, ds_partner, kt_tile, g, dq);  // dQ += dS K
    }

    // dQ * softmax_scale through shared memory, 16-byte rows
    __syncthreads();
    half_bits* stage = reinterpret_cast<half_bits*>(smem);
    // (written out: through QueryBlockInfo::query_rows here, ptxas schedules the kernel differently)
    half_bits* dq_base = bp.dq + batch * bp.dq_batch_stride + seq.q_start * bp.dq_row_stride + head * bp.dq_head_stride;
    const FwdWarpGeometry<KT> gs((tid & ~31) | staging_lane(g.lane), m0);  // whose fragments this lane stores
#pragma unroll
    for (int a = 0; a < KT::kMTiles; ++a)
#pragma unroll
        for (int ot = 0; ot < KT::kOTilesPerQuadPair; ++ot) {
            float scaled[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) scaled[i] = dq[a][ot][i] * bp.softmax_scale;
            const int row = gs.mtile_row0(a) - m0 + gs.lq.operand_row();
            stage_acc_tile_row<!KT::kAccumF16>(scaled, g.lane, stage + KT::OStageRows::offset(row) + gs.o_col(ot, 0));
        }
    __syncthreads();
    for (int chunk = tid; chunk < KT::kBlockM * KT::kChunksPerRow; chunk += KT::kThreads) {
        int row, col;
        tile_chunk_position<KT>(chunk, row, col);
        if (m0 + row < seq.seqlen_q)
            store_global_16B(dq_base + (long long)(m0 + row) * bp.dq_row_stride + col, load_shared_16B(stage + KT::OStageRows::offset(row) + col));
    }
}

// What the host launches flash_bwd_dq_kernel<KT> with (launch_geometry.cuh).
template <class KT>
__device__ LaunchGeometry flash_bwd_dq_kernel_geometry = {DqLayout<KT>::kBytes, KT::kThreads, KT::kBlockM, KT::kBlockN};
