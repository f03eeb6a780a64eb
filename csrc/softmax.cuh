// The online softmax of FlashAttention-2 on tensor-core fragments, in both accumulation modes: per key block,
// raise the running row max, rescale what was summed so far, exponentiate, add to the row sums; at the end,
// 1 / l and the log-sum-exp.
//
// Everything runs in the log2 domain: p = 2^(s * scale * log2(e) - m). Row maxima m and partial
// row sums l stay fp32 in both modes. A row with no visible key keeps m = -inf; the "safe" max
// used in the exponent is then 0, so exp2(-inf - 0) = 0 and nothing becomes NaN.
#pragma once
#include "warp_tile.cuh"

// Row statistics of one lane's rows (kMTiles m-tiles x kRowSlots row slots, FwdFragmentLayout). Each lane
// keeps the max over the whole row but only its own part of the sum (reduced across lanes at the end).
template <class KT>
struct OnlineSoftmax {
    using Layout = FwdFragmentLayout<KT>;
    static constexpr int kRowSlots = Layout::kRowSlots;
    float row_max[KT::kMTiles][kRowSlots];  // running max, log2 domain
    float row_sum[KT::kMTiles][kRowSlots];  // this lane's partial sum of p

    __device__ __forceinline__ void init_rows(int a) {
#pragma unroll
        for (int r = 0; r < kRowSlots; ++r) {
            row_max[a][r] = neg_inf();
            row_sum[a][r] = 0.f;
        }
    }

    // A row is spread over lanes t and t ^ 2 (FP32-ACC) and over the quad-pairs of its key columns (2x2, 1x4).
    __device__ __forceinline__ static float max_over_row_lanes(float x) {
        if (!KT::kAccumF16) x = max_over_lanes(x, 2);
#pragma unroll
        for (int bit = 1; bit < KT::kQuadPairCols; bit <<= 1) x = max_over_lanes(x, FwdWarpGeometry<KT>::partner_lane_xor(bit));
        return x;
    }
    __device__ __forceinline__ static float sum_over_row_lanes(float x) {
        if (!KT::kAccumF16) x = sum_over_lanes(x, 2);
#pragma unroll
        for (int bit = 1; bit < KT::kQuadPairCols; bit <<= 1) x = sum_over_lanes(x, FwdWarpGeometry<KT>::partner_lane_xor(bit));
        return x;
    }

    // A new key block's scores s[nt][i] of m-tile a (FP32-ACC: not yet multiplied by score_scale): raises the
    // running max and rescales the row sums; returns the exponent offset of each row slot and the factor by
    // which the rows' output accumulators must be rescaled.
    __device__ __forceinline__ void update_max(int a, const float (&s)[KT::kSTilesPerQuadPair][8], float score_scale,
                                               float (&exp_offset)[kRowSlots], float (&rescale)[kRowSlots]) {
        float tile_max[kRowSlots];
#pragma unroll
        for (int r = 0; r < kRowSlots; ++r) tile_max[r] = neg_inf();
#pragma unroll
        for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int r = Layout::row_slot(i);
                tile_max[r] = fmaxf(tile_max[r], s[nt][i]);
            }
#pragma unroll
        for (int r = 0; r < kRowSlots; ++r) {
            tile_max[r] = max_over_row_lanes(tile_max[r]);
            const float new_max = fmaxf(row_max[a][r], tile_max[r] * score_scale);
            exp_offset[r] = safe_row_max(new_max);
            rescale[r] = fast_exp2(row_max[a][r] - exp_offset[r]);
            row_max[a][r] = new_max;
            row_sum[a][r] *= rescale[r];
        }
    }

    // Lazy rescaling (KT::kLazyRescale): a row keeps its running max unless a key block raises it by more than
    // kLazyRescaleLog2, so p <= 2^kLazyRescaleLog2 (exact in fp16, far from fp32's range) and m, l and O stay
    // consistent with each other; the warp rescales only where one of its rows must, which once the max has settled
    // (after the first key blocks on real and random scores alike) almost no key block does.
    static constexpr float kLazyRescaleLog2 = 8.f;

    // The block's row maxima of m-tile a (scaled, over the row's lanes) and whether any row of the warp raises its
    // max by more than kLazyRescaleLog2: a warp-uniform answer (the vote is opaque asm, so that the compiler cannot
    // turn the skipped rescale of O into an unconditional multiply).
    __device__ __forceinline__ bool lazy_block_max(int a, const float (&s)[KT::kSTilesPerQuadPair][8], float score_scale,
                                                   float (&tile_max)[kRowSlots]) const {
#pragma unroll
        for (int r = 0; r < kRowSlots; ++r) tile_max[r] = neg_inf();
#pragma unroll
        for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int r = Layout::row_slot(i);
                tile_max[r] = fmaxf(tile_max[r], s[nt][i]);
            }
        u32 raise = 0u;
#pragma unroll
        for (int r = 0; r < kRowSlots; ++r) {
            tile_max[r] = max_over_row_lanes(tile_max[r]) * score_scale;
            raise |= tile_max[r] > row_max[a][r] + kLazyRescaleLog2 ? 1u : 0u;
        }
        u32 warp_raises;
        asm volatile("{\n\t.reg .pred p, q;\n\tsetp.ne.u32 p, %1, 0;\n\tvote.sync.any.pred q, p, 0xffffffff;\n\t"
                     "selp.u32 %0, 1, 0, q;\n\t}" : "=r"(warp_raises) : "r"(raise));
        return warp_raises != 0u;
    }

    // Lazy rescaling, where lazy_block_max said so: every row of the warp takes its new max; returns the factors of O.
    __device__ __forceinline__ void lazy_raise(int a, const float (&tile_max)[kRowSlots], float (&rescale)[kRowSlots]) {
#pragma unroll
        for (int r = 0; r < kRowSlots; ++r) {
            const float new_max = fmaxf(row_max[a][r], tile_max[r]);
            rescale[r] = fast_exp2(row_max[a][r] - safe_row_max(new_max));
            row_max[a][r] = new_max;
            row_sum[a][r] *= rescale[r];
        }
    }

    // p = 2^(score * score_scale - exp_offset) of one element of row slot r, added to the row's sum.
    __device__ __forceinline__ float exp2_and_sum(int a, int r, float score, float score_scale, float exp_offset) {
        const float p = fast_exp2(fmaf(score, score_scale, -exp_offset));
        row_sum[a][r] += p;
        return p;
    }

    // The sum l of row slot r of m-tile a over the lanes that share the row (at the end).
    __device__ __forceinline__ float row_total(int a, int r) const { return sum_over_row_lanes(row_sum[a][r]); }
    // The row's log-sum-exp in natural log, (m + log2 l) * ln 2; +inf for a row with no visible key (l = 0).
    __device__ __forceinline__ float lse(int a, int r, float l) const {
        return l > 0.f ? (row_max[a][r] + fast_log2(l)) * kLn2 : pos_inf();
    }
};
