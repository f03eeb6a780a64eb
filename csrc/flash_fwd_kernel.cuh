// FlashAttention-2 forward on Volta (sm_70) tensor cores: mma.sync.m8n8k4 only, no ldmatrix, no cp.async.
//
// Per CTA: kBlockM query rows of one (batch, head). Q stays in registers for the whole kernel
// (loaded straight from global memory into A fragments); K and V blocks pass through registers into
// padded shared memory; S = Q K^T and P stay in registers; O accumulates in registers and leaves
// through shared memory in 16-byte rows. Two accumulation modes (SparkAttention's terms):
//   FP32-ACC: both GEMMs accumulate in fp32; P is rounded to fp16 for the second GEMM.
//   FP16-ACC: both GEMMs accumulate in fp16 (Q is pre-scaled by softmax_scale * log2(e) so the fp16
//             scores cannot overflow); each key block's P V partial is added into fp32 O, and the
//             softmax statistics stay fp32, so long sequences cannot overflow the output.
#pragma once
#include "philox.cuh"
#include "kernel_traits.cuh"
#include "masking.cuh"
#include "softmax.cuh"
#include "transpose.cuh"

// On sm_70 every m8n8k4 is a hardware HMMA: interleave independent accumulators (k-major loops) for ILP.
// On sm_80+ the same instruction is an emulation subroutine whose operands sit in fixed registers: running
// one accumulator's whole k-chain back to back (accumulator-major loops) saves the register moves around
// every call. Both orders add the same products in the same order per accumulator: identical results.
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
constexpr bool kAccumulatorMajorMma = true;
#else
constexpr bool kAccumulatorMajorMma = false;
#endif

template <class KT>
struct FwdWarpGeometry {
    int lane, warp;
    LaneInQuadPair lq;
    int qp_m, qp_n;  // this lane's quad-pair position in the warp's 2-D arrangement
    int warp_row0;   // first query row of the warp (within the sequence)

    __device__ __forceinline__ FwdWarpGeometry(int tid, int m0)
        : lane(tid & 31), warp(tid >> 5), lq(tid & 31),
          qp_m(((tid & 31) >> 2 & 3) % KT::kQuadPairRows), qp_n(((tid & 31) >> 2 & 3) / KT::kQuadPairRows),
          warp_row0(m0 + (tid >> 5) * KT::kRowsPerWarp) {}

    // First row of 8-row tile `a` of this lane's quad-pair.
    __device__ __forceinline__ int mtile_row0(int a) const { return warp_row0 + 8 * (a * KT::kQuadPairRows + qp_m); }
    // First key (within the block) of S tile `nt` computed by this lane's quad-pair.
    __device__ __forceinline__ int stile_key0(int nt) const { return (qp_n * KT::kSTilesPerQuadPair + nt) * 8; }
    // Same, for the quad-pair column qp_n ^ x (x = 1 .. kQuadPairCols - 1): whose P this lane receives.
    __device__ __forceinline__ int partner_stile_key0(int x, int nt) const {
        return ((qp_n ^ x) * KT::kSTilesPerQuadPair + nt) * 8;
    }
    // Lane distance to the quad-pair in column qp_n ^ x of the same rows: flipping qp_n flips bits of the
    // quad-pair index qp = qp_n * kQuadPairRows + qp_m, i.e. lane bits 2-3.
    __device__ __forceinline__ static constexpr int partner_lane_xor(int x) { return 4 * KT::kQuadPairRows * x; }
    // head_dim column of O for physical column c of output tile `ot` of this quad-pair (B = V^T is
    // col-major: physical column c is the V^T row fed by the lane with operand_row() == c).
    __device__ __forceinline__ int o_col(int ot, int c) const { return qp_n * KT::kOColsPerQuadPair + 8 * ot + c; }
};

// Copies kBlockN rows x head_dim of K or V, starting at key row `key0`, from global memory into
// registers; rows at or past `seqlen_k` become zeros (never read garbage: 0 * inf would be NaN).
template <class KT>
__device__ __forceinline__ void load_kv_block(const half_bits* base, long long row_stride, int key0, int seqlen_k,
                                              int tid, u32x4 (&stage)[KT::kChunksPerThread]) {
#pragma unroll
    for (int c = 0; c < KT::kChunksPerThread; ++c) {
        const int chunk = tid + c * KT::kThreads;
        const int row = chunk / KT::kChunksPerRow, col = (chunk % KT::kChunksPerRow) * 8;
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
            const int row = chunk / KT::kChunksPerRow, col = (chunk % KT::kChunksPerRow) * 8;
            store_shared_16B(tile + row * KT::kSmemStride + col, stage[c]);
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
            store_shared_16B(vt_tile + d * KT::kVtStride + key, stage[c]);
        }
    }
}

// Q as the A operand of S = Q K^T (row-major: the lane's row of each m-tile), 16 bytes = two k-steps at a
// time, from registers or from the CTA's Q tile in shared memory (KT::kQInSmem).
template <class KT>
struct QOperand {
    static constexpr int kRegs = KT::kQInSmem ? 1 : KT::kQRegs;
    u32 regs[KT::kMTiles][kRegs];
    const half_bits* tile_row;  // shared memory: this lane's row of m-tile 0

    __device__ __forceinline__ u32x4 chunk(int a, int kk) const {
        if (KT::kQInSmem)
            return load_shared_16B(tile_row + a * 8 * KT::kQuadPairRows * KT::kSmemStride + 8 * kk);
        return u32x4{regs[a][4 * kk], regs[a][4 * kk + 1], regs[a][4 * kk + 2], regs[a][4 * kk + 3]};
    }
};

// FP16-ACC pre-scales Q by softmax_scale * log2(e) so S comes out of the tensor cores in the log2
// domain and within fp16 range.
template <class KT>
__device__ __forceinline__ u32x4 prescale_q_chunk(u32x4 v, float scale_log2) {
    return KT::kAccumF16 ? scale_halves(v, scale_log2) : v;
}

// Rows past seqlen_q become zeros (finite scores, never stored).
template <class KT>
__device__ __forceinline__ void load_q(const half_bits* q_base, long long row_stride, int m0, int seqlen_q,
                                       float scale_log2, const FwdWarpGeometry<KT>& g, int tid, half_bits* q_tile,
                                       QOperand<KT>& q) {
    if (KT::kQInSmem) {
        for (int chunk = tid; chunk < KT::kBlockM * KT::kChunksPerRow; chunk += KT::kThreads) {
            const int row = chunk / KT::kChunksPerRow, col = (chunk % KT::kChunksPerRow) * 8;
            const u32x4 v = m0 + row < seqlen_q ? load_global_16B(q_base + (long long)(m0 + row) * row_stride + col)
                                                : zero_u32x4();
            store_shared_16B(q_tile + row * KT::kSmemStride + col, prescale_q_chunk<KT>(v, scale_log2));
        }
        q.tile_row = q_tile + (g.mtile_row0(0) - m0 + g.lq.operand_row()) * KT::kSmemStride;
        return;
    }
#pragma unroll
    for (int a = 0; a < KT::kMTiles; ++a) {
        const int row = g.mtile_row0(a) + g.lq.operand_row();
#pragma unroll
        for (int c = 0; c < KT::kChunksPerRow; ++c) {
            const u32x4 v = prescale_q_chunk<KT>(
                row < seqlen_q ? load_global_16B(q_base + (long long)row * row_stride + 8 * c) : zero_u32x4(), scale_log2);
            q.regs[a][(4 * c + 0) % QOperand<KT>::kRegs] = v.x;
            q.regs[a][(4 * c + 1) % QOperand<KT>::kRegs] = v.y;
            q.regs[a][(4 * c + 2) % QOperand<KT>::kRegs] = v.z;
            q.regs[a][(4 * c + 3) % QOperand<KT>::kRegs] = v.w;
        }
    }
}

// Per-lane state of the forward pass that differs between the two accumulation modes.
// Row slots: FP32-ACC lanes hold two rows per m-tile (see softmax.cuh), FP16-ACC lanes one.
template <class KT>
struct FwdAccumulators {
    static constexpr int kRowSlots = KT::kAccumF16 ? 1 : 2;
    float o[KT::kMTiles][KT::kOTilesPerQuadPair][8];
    float row_max[KT::kMTiles][kRowSlots];  // running max, log2 domain
    float row_sum[KT::kMTiles][kRowSlots];  // this lane's partial sum of p

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int a = 0; a < KT::kMTiles; ++a) {
#pragma unroll
            for (int ot = 0; ot < KT::kOTilesPerQuadPair; ++ot)
#pragma unroll
                for (int i = 0; i < 8; ++i) o[a][ot][i] = 0.f;
#pragma unroll
            for (int r = 0; r < kRowSlots; ++r) {
                row_max[a][r] = neg_inf();
                row_sum[a][r] = 0.f;
            }
        }
    }

    // Row slot of output element i of an 8x8 tile.
    __device__ __forceinline__ static int o_row_slot(int i) { return KT::kAccumF16 ? 0 : f32_acc_row_slot(i); }
    // Row (within the m-tile) and physical column of output element i.
    __device__ __forceinline__ static int o_row(const LaneInQuadPair& lq, int i) {
        return KT::kAccumF16 ? lq.operand_row() : lq.acc_row(i);
    }
    __device__ __forceinline__ static int o_phys_col(const LaneInQuadPair& lq, int i) {
        return KT::kAccumF16 ? i : lq.acc_col(i);
    }
};

// Visits the (S tile, 8-wide head_dim step) pairs of S = Q K^T in the order that suits the target.
template <class KT, class Body>
__device__ __forceinline__ void for_each_qk_step(Body body) {
    if (kAccumulatorMajorMma) {
#pragma unroll
        for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt)
#pragma unroll
            for (int kk = 0; kk < KT::kHeadDim / 8; ++kk) body(nt, kk);
    } else {
#pragma unroll
        for (int kk = 0; kk < KT::kHeadDim / 8; ++kk)
#pragma unroll
            for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt) body(nt, kk);
    }
}

// Visits the (quad-pair column x, S tile, output tile) triples of O += P V in the order that suits the target:
// x = 0 is this lane's own keys, x > 0 the keys of quad-pair column qp_n ^ x.
template <class KT, class Body>
__device__ __forceinline__ void for_each_pv_step(int ot0, int ot_count, Body body) {
    if (kAccumulatorMajorMma) {
#pragma unroll
        for (int ot = ot0; ot < ot0 + ot_count; ++ot)
#pragma unroll
            for (int x = 0; x < KT::kQuadPairCols; ++x)
#pragma unroll
                for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt) body(x, nt, ot);
    } else {
#pragma unroll
        for (int x = 0; x < KT::kQuadPairCols; ++x)
#pragma unroll
            for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt)
#pragma unroll
                for (int ot = ot0; ot < ot0 + ot_count; ++ot) body(x, nt, ot);
    }
}

// S-shaped products of one warp: s = A B^T with A = the warp's rows (Q, or dO in the dQ kernel) and B = the
// rows of a [key][head_dim] tile in shared memory (col-major B: the lane feeds key column operand_row(), 8
// head_dim values per 16-byte load). FP16-ACC accumulates in fp16 and widens the result.
template <class KT>
__device__ __forceinline__ void rows_times_tile_rows(const QOperand<KT>& q, const half_bits* b_tile,
                                                     const FwdWarpGeometry<KT>& g,
                                                     float (&s)[KT::kMTiles][KT::kSTilesPerQuadPair][8]) {
    const LaneInQuadPair& lq = g.lq;
    if (KT::kAccumF16) {
        u32 s16[KT::kMTiles][KT::kSTilesPerQuadPair][4];
#pragma unroll
        for (int a = 0; a < KT::kMTiles; ++a)
#pragma unroll
            for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) s16[a][nt][r] = 0u;
        for_each_qk_step<KT>([&](int nt, int kk) {
            const u32x4 b = load_shared_16B(b_tile + (g.stile_key0(nt) + lq.operand_row()) * KT::kSmemStride + 8 * kk);
#pragma unroll
            for (int a = 0; a < KT::kMTiles; ++a) {
                const u32x4 qa = q.chunk(a, kk);
                mma_rc_f16(s16[a][nt], qa.x, qa.y, b.x, b.y);
                mma_rc_f16(s16[a][nt], qa.z, qa.w, b.z, b.w);
            }
        });
#pragma unroll
        for (int a = 0; a < KT::kMTiles; ++a)
#pragma unroll
            for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) {
                    s[a][nt][2 * r] = low_half_to_float(s16[a][nt][r]);
                    s[a][nt][2 * r + 1] = high_half_to_float(s16[a][nt][r]);
                }
    } else {
#pragma unroll
        for (int a = 0; a < KT::kMTiles; ++a)
#pragma unroll
            for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt)
#pragma unroll
                for (int i = 0; i < 8; ++i) s[a][nt][i] = 0.f;
        for_each_qk_step<KT>([&](int nt, int kk) {
            const u32x4 b = load_shared_16B(b_tile + (g.stile_key0(nt) + lq.operand_row()) * KT::kSmemStride + 8 * kk);
#pragma unroll
            for (int a = 0; a < KT::kMTiles; ++a) {
                const u32x4 qa = q.chunk(a, kk);
                mma_rc_f32(s[a][nt], qa.x, qa.y, b.x, b.y);
                mma_rc_f32(s[a][nt], qa.z, qa.w, b.z, b.w);
            }
        });
    }

}

// One key block for one warp: S = Q K^T, mask, online softmax update (rescaling O), P in A layout,
// dropout. Returns P as f16x2 registers: p_own[a][nt] holds the keys of this lane's quad-pair column,
// p_partner[x - 1][a][nt] those received from the quad-pair in column qp_n ^ x (2x2 and 1x4).
template <class KT>
__device__ __forceinline__ void fwd_scores_to_probs(const QOperand<KT>& q, const half_bits* k_tile,
                                                    const FwdWarpGeometry<KT>& g, const VisibleKeys& vis,
                                                    int key0, bool needs_mask, float scale_log2, float alibi_log2,
                                                    const DropoutRng& rng, FwdAccumulators<KT>& acc,
                                                    u32 (&p_own)[KT::kMTiles][KT::kSTilesPerQuadPair][4],
                                                    u32 (&p_partner)[KT::kPartnerSlots][KT::kMTiles][KT::kSTilesPerQuadPair][4]) {
    constexpr int kRowSlots = FwdAccumulators<KT>::kRowSlots;
    const LaneInQuadPair& lq = g.lq;
    // ---- S = Q K^T
    float s[KT::kMTiles][KT::kSTilesPerQuadPair][8];
    rows_times_tile_rows<KT>(q, k_tile, g, s);

    // ---- mask and ALiBi bias: only key blocks that cross a boundary (or calls with ALiBi) pay for it.
    // FP32-ACC scores are not yet scaled: the bias is divided by the scale so that it comes out as
    // -slope * log2(e) * |i + shift - j| in the exponent (scale > 0, so max commutes with it).
    const float score_scale = KT::kAccumF16 ? 1.f : scale_log2;
    if (needs_mask || alibi_log2 != 0.f) {
        const float bias_per_step = alibi_log2 / score_scale;
#pragma unroll
        for (int a = 0; a < KT::kMTiles; ++a)
#pragma unroll
            for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt)
#pragma unroll
                for (int i = 0; i < 8; ++i) {
                    const int row = g.mtile_row0(a) + FwdAccumulators<KT>::o_row(lq, i);
                    const int key = key0 + g.stile_key0(nt) + FwdAccumulators<KT>::o_phys_col(lq, i);
                    if (needs_mask && !vis.visible(row, key)) s[a][nt][i] = neg_inf();
                    else s[a][nt][i] -= bias_per_step * vis.diagonal_distance(row, key);
                }
    }

    // ---- online softmax
#pragma unroll
    for (int a = 0; a < KT::kMTiles; ++a) {
        float tile_max[kRowSlots];
#pragma unroll
        for (int r = 0; r < kRowSlots; ++r) tile_max[r] = neg_inf();
#pragma unroll
        for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int r = FwdAccumulators<KT>::o_row_slot(i);
                tile_max[r] = fmaxf(tile_max[r], s[a][nt][i]);
            }
        float exp_offset[kRowSlots], rescale[kRowSlots];
#pragma unroll
        for (int r = 0; r < kRowSlots; ++r) {
            if (!KT::kAccumF16) tile_max[r] = max_over_lanes(tile_max[r], 2);
#pragma unroll
            for (int bit = 1; bit < KT::kQuadPairCols; bit <<= 1)
                tile_max[r] = max_over_lanes(tile_max[r], FwdWarpGeometry<KT>::partner_lane_xor(bit));
            const float new_max = fmaxf(acc.row_max[a][r], tile_max[r] * score_scale);
            exp_offset[r] = safe_row_max(new_max);
            rescale[r] = fast_exp2(acc.row_max[a][r] - exp_offset[r]);
            acc.row_max[a][r] = new_max;
            acc.row_sum[a][r] *= rescale[r];
        }
#pragma unroll
        for (int ot = 0; ot < KT::kOTilesPerQuadPair; ++ot)
#pragma unroll
            for (int i = 0; i < 8; ++i) acc.o[a][ot][i] *= rescale[FwdAccumulators<KT>::o_row_slot(i)];
#pragma unroll
        for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt) {
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const int r = FwdAccumulators<KT>::o_row_slot(i);
                const float p = fast_exp2(fmaf(s[a][nt][i], score_scale, -exp_offset[r]));
                acc.row_sum[a][r] += p;
                s[a][nt][i] = p;
            }
            if (KT::kAccumF16) {
#pragma unroll
                for (int r = 0; r < 4; ++r) p_own[a][nt][r] = pack_half2(s[a][nt][2 * r], s[a][nt][2 * r + 1]);
            } else {
                f32_acc_to_row_fragment(s[a][nt], lq.t, p_own[a][nt]);
            }
            if (KT::kDropout) {
                const int row = g.mtile_row0(a) + lq.operand_row();
                rng.apply(p_own[a][nt], (u32)((key0 + g.stile_key0(nt)) >> 3), (u32)row);
            }
#pragma unroll
            for (int x = 1; x < KT::kQuadPairCols; ++x)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    p_partner[x - 1][a][nt][r] =
                        __shfl_xor_sync(0xffffffffu, p_own[a][nt][r], FwdWarpGeometry<KT>::partner_lane_xor(x));
        }
    }
}

// O += P V for one key block. A = P (row-major, 4 keys per k-step), B = V^T rows (col-major B: the lane
// feeds head_dim column operand_row() of the tile, 8 keys per 16-byte load = two k-steps). FP16-ACC
// accumulates chunks of kOChunk output tiles in fp16 over the whole key block, then adds each chunk
// into the fp32 O: few fp16 registers live at a time.
template <class KT>
__device__ __forceinline__ void fwd_accumulate_pv(const u32 (&p_own)[KT::kMTiles][KT::kSTilesPerQuadPair][4],
                                                  const u32 (&p_partner)[KT::kPartnerSlots][KT::kMTiles][KT::kSTilesPerQuadPair][4],
                                                  const half_bits* vt_tile, const FwdWarpGeometry<KT>& g,
                                                  FwdAccumulators<KT>& acc) {
    constexpr int kTiles = KT::kOTilesPerQuadPair;
    constexpr int kOChunk = KT::kAccumF16 ? 4 : kTiles;  // output tiles per fp16 chunk
    const LaneInQuadPair& lq = g.lq;
    const half_bits* vt_rows = vt_tile + (g.qp_n * KT::kOColsPerQuadPair + lq.operand_row()) * KT::kVtStride;
    u32 o16[KT::kMTiles][kTiles][4];
#pragma unroll
    for (int ot0 = 0; ot0 < kTiles; ot0 += kOChunk) {
        const int count = ot0 + kOChunk <= kTiles ? kOChunk : kTiles - ot0;
        if (KT::kAccumF16) {
#pragma unroll
            for (int a = 0; a < KT::kMTiles; ++a)
#pragma unroll
                for (int ot = ot0; ot < ot0 + count; ++ot)
#pragma unroll
                    for (int r = 0; r < 4; ++r) o16[a][ot][r] = 0u;
        }
        for_each_pv_step<KT>(ot0, count, [&](int x, int nt, int ot) {
            const int group_key0 = x ? g.partner_stile_key0(x, nt) : g.stile_key0(nt);
            const u32x4 b = load_shared_16B(vt_rows + 8 * ot * KT::kVtStride + group_key0);
#pragma unroll
            for (int a = 0; a < KT::kMTiles; ++a) {
                const u32(&pf)[4] = x ? p_partner[x - 1][a][nt] : p_own[a][nt];
                if (KT::kAccumF16) {
                    mma_rc_f16(o16[a][ot], pf[0], pf[1], b.x, b.y);
                    mma_rc_f16(o16[a][ot], pf[2], pf[3], b.z, b.w);
                } else {
                    mma_rc_f32(acc.o[a][ot], pf[0], pf[1], b.x, b.y);
                    mma_rc_f32(acc.o[a][ot], pf[2], pf[3], b.z, b.w);
                }
            }
        });
        if (KT::kAccumF16) {
#pragma unroll
            for (int a = 0; a < KT::kMTiles; ++a)
#pragma unroll
                for (int ot = ot0; ot < ot0 + count; ++ot)
#pragma unroll
                    for (int r = 0; r < 4; ++r) {
                        acc.o[a][ot][2 * r] += low_half_to_float(o16[a][ot][r]);
                        acc.o[a][ot][2 * r + 1] += high_half_to_float(o16[a][ot][r]);
                    }
        }
    }
}

// Final normalisation: O / l (times 1 / (1 - p) under dropout), lse = (m + log2 l) * ln 2; rows with
// no visible key get O = 0 and lse = +inf. O is staged in shared memory and written in 16-byte rows.
template <class KT>
__device__ __forceinline__ void fwd_epilogue(const AttentionParams& prm, FwdAccumulators<KT>& acc,
                                             const FwdWarpGeometry<KT>& g, int tid, int m0, int seqlen_q,
                                             half_bits* o_stage, half_bits* o_base, float* lse_base) {
    constexpr int kRowSlots = FwdAccumulators<KT>::kRowSlots;
    const LaneInQuadPair& lq = g.lq;
    const float output_scale = KT::kDropout ? prm.dropout_rescale : 1.f;
#pragma unroll
    for (int a = 0; a < KT::kMTiles; ++a) {
        float inv_sum[kRowSlots];
#pragma unroll
        for (int r = 0; r < kRowSlots; ++r) {
            float l = acc.row_sum[a][r];
            if (!KT::kAccumF16) l = sum_over_lanes(l, 2);
#pragma unroll
            for (int bit = 1; bit < KT::kQuadPairCols; bit <<= 1) l = sum_over_lanes(l, FwdWarpGeometry<KT>::partner_lane_xor(bit));
            inv_sum[r] = l > 0.f ? output_scale / l : 0.f;
            const float lse = l > 0.f ? (acc.row_max[a][r] + fast_log2(l)) * kLn2 : pos_inf();
            // one writer per row: FP32-ACC lanes t = 0, 1 own rows t + 2r (+4 hi); FP16-ACC lanes own row t (+4 hi)
            const bool writer = g.qp_n == 0 && (KT::kAccumF16 || (lq.t & 2) == 0);
            const int row = g.mtile_row0(a) + (KT::kAccumF16 ? lq.operand_row() : (lq.t & 1) + 2 * r + 4 * lq.hi);
            if (writer && row < seqlen_q) lse_base[row] = lse;
        }
#pragma unroll
        for (int ot = 0; ot < KT::kOTilesPerQuadPair; ++ot)
#pragma unroll
            for (int i = 0; i < 8; i += 2) {
                const int row = g.mtile_row0(a) - m0 + FwdAccumulators<KT>::o_row(lq, i);
                const int col = g.o_col(ot, FwdAccumulators<KT>::o_phys_col(lq, i));
                const float scale = inv_sum[FwdAccumulators<KT>::o_row_slot(i)];
                *reinterpret_cast<u32*>(o_stage + row * KT::kSmemStride + col) =
                    pack_half2(acc.o[a][ot][i] * scale, acc.o[a][ot][i + 1] * scale);
            }
    }
    __syncthreads();
    for (int chunk = tid; chunk < KT::kBlockM * KT::kChunksPerRow; chunk += KT::kThreads) {
        const int row = chunk / KT::kChunksPerRow, col = (chunk % KT::kChunksPerRow) * 8;
        if (m0 + row < seqlen_q)
            store_global_16B(o_base + (long long)(m0 + row) * prm.o_row_stride + col,
                             load_shared_16B(o_stage + row * KT::kSmemStride + col));
    }
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
    const AttentionParams& prm;
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
    load_v_block<KT>(st.v_base, st.prm.v_row_stride, key0, st.seq.seqlen_k, st.tid, st.stage);
    // sm_80+ also skips empty warp tiles in the single loop: each emulated m8n8k4 costs ~100 instructions
    // there. sm_70 keeps the single loop's tensor-core work branch-free (the diagonal waste is a few %).
    const bool may_skip = SKIP_EMPTY_WARPS || (kAccumulatorMajorMma && MAY_MASK && needs_mask);
    const int warp_row_end = min(st.g.warp_row0 + KT::kRowsPerWarp, st.seq.seqlen_q);
    const bool warp_active =
        !may_skip || (st.g.warp_row0 < warp_row_end &&
                      !st.vis.tile_is_empty(st.g.warp_row0, warp_row_end, key0, key0 + KT::kBlockN));
    u32 p_own[KT::kMTiles][KT::kSTilesPerQuadPair][4];
    u32 p_partner[KT::kPartnerSlots][KT::kMTiles][KT::kSTilesPerQuadPair][4];
    if (warp_active)
        fwd_scores_to_probs<KT>(st.q, st.k_tile, st.g, st.vis, key0, MAY_MASK && needs_mask, st.prm.scale_log2, st.alibi_log2,
                                st.rng, st.acc, p_own, p_partner);
    __syncthreads();  // every warp is done with this K block and the previous V block
    store_vt_block<KT>(st.v_tile, st.tid, st.stage);
    if (next_block >= 0)
        load_kv_block<KT>(st.k_base, st.prm.k_row_stride, next_block * KT::kBlockN, st.seq.seqlen_k, st.tid, st.stage);
    __syncthreads();  // V visible
    if (warp_active) fwd_accumulate_pv<KT>(p_own, p_partner, st.v_tile, st.g, st.acc);
    if (next_block >= 0) store_kv_block<KT>(st.k_tile, st.tid, st.stage);
    __syncthreads();  // next K visible; every warp is done with this V block
}

template <class KT>
__global__ void __launch_bounds__(KT::kThreads, KT::kMinBlocksPerSM) flash_fwd_kernel(const AttentionParams prm) {
    extern __shared__ __align__(16) unsigned char smem[];
    half_bits* k_tile = reinterpret_cast<half_bits*>(smem);
    half_bits* v_tile = reinterpret_cast<half_bits*>(smem + KT::kTileBytes);

    // Blocks are issued x fastest. Full attention: (query blocks, batch * heads), so the CTAs running together
    // share K and V in L2. Causal: (batch * heads, query blocks), so every (batch, head) gets its last query
    // block (the longest) in the first waves and the short ones fill the tail.
    const int bh = prm.m_blocks_fastest ? (int)blockIdx.y : (int)blockIdx.x;
    const int m_block = prm.num_m_blocks - 1 - (int)(prm.m_blocks_fastest ? blockIdx.x : blockIdx.y);
    const int head = bh % prm.nheads, batch = bh / prm.nheads;
    const SequenceExtent seq(prm, batch);
    const int m0 = m_block * KT::kBlockM;
    if (m0 >= seq.seqlen_q) return;
    const int kv_head = head / prm.heads_per_kv;
    const VisibleKeys vis(prm, seq);

    const half_bits* q_base = prm.q + batch * prm.q_batch_stride + seq.q_start * prm.q_row_stride + head * prm.q_head_stride;
    const half_bits* k_base = prm.k + batch * prm.k_batch_stride + seq.k_start * prm.k_row_stride + kv_head * prm.k_head_stride;
    const half_bits* v_base = prm.v + batch * prm.v_batch_stride + seq.k_start * prm.v_row_stride + kv_head * prm.v_head_stride;
    half_bits* o_base = prm.o + batch * prm.o_batch_stride + seq.q_start * prm.o_row_stride + head * prm.o_head_stride;
    float* lse_base = prm.lse + batch * prm.lse_batch_stride + head * prm.lse_head_stride + seq.q_start;

    const int tid = threadIdx.x;
    const FwdWarpGeometry<KT> g(tid, m0);
    const DropoutRng rng(prm.seed, prm.offset, prm.dropout_threshold, (u32)(batch * prm.nheads + head));

    FwdAccumulators<KT> acc;
    acc.init();

    const int cta_row_end = min(m0 + KT::kBlockM, seq.seqlen_q);
    const int n_begin = vis.first_key(m0) / KT::kBlockN;
    const int key_end = vis.end_key(cta_row_end);
    const int n_end = key_end > vis.first_key(m0) ? (key_end + KT::kBlockN - 1) / KT::kBlockN : n_begin;

    // A CTA whose rows see no key (seqlen_q > seqlen_k under causal or a window) writes zeros and lse = +inf
    // and touches no shared memory before the epilogue: Q is loaded only where a key block follows. (Loading
    // it anyway raced: the Q tile in shared memory (kQInSmem) overlaps the epilogue's O staging area, and with
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
        load_kv_block<KT>(k_base, prm.k_row_stride, order.first() * KT::kBlockN, seq.seqlen_k, tid, stage);
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
    fwd_epilogue<KT>(prm, acc, g, tid, m0, seq.seqlen_q, reinterpret_cast<half_bits*>(smem), o_base, lse_base);
}
