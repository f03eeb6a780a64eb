// The FlashAttention-2 backward's dK/dV kernel on Volta tensor cores (key blocks in parallel), with dQ added
// into an fp32 buffer by atomics.
//
// A CTA keeps kBlockN keys of one (batch, kv head) and walks the query blocks of every query head of its
// group (GQA: dK and dV sum over the group inside the CTA, no atomics). For each query block, with S
// computed transposed so that warps own keys:
//   S^T = K Q^T, dP^T = V dO^T            (A = the warp's K / V rows, B = Q / dO rows from shared memory)
//   P^T = exp2(S^T * scale * log2 e - lse * log2 e)   (recomputed from the forward's fp32 log-sum-exp)
//   dS^T = P^T * (dP^T * Z / (1 - p) - D)   (Z: the dropout keep mask, D = rowsum(dO * O))
//   dV += (P^T * Z) dO,  dK += dS^T Q     (A = P^T / dS^T from registers, B = dO^T / Q^T from shared memory)
//   dQ += dS K                             (dS through shared memory, B = K^T; fp32 atomics)
// dV is scaled by 1 / (1 - p) and dK by softmax_scale at the end; dQ's scale is applied by the caller.
// Split tiles (KT::kOutSplit > 1, no dQ atomics): the CTA of slice blockIdx.z computes S^T and dP^T in full and
// dV, dK for head_dim columns [slice * kOutDim, (slice + 1) * kOutDim) only, from the slice's rows of dO^T / Q^T.
// FP16-ACC: dV, dK and dQ accumulate in fp16 within a query block (then into fp32 accumulators / fp32
// atomics). S^T and dP^T always accumulate in fp32: P = exp(S - lse) amplifies S's rounding and dP - D
// cancels, and fp16 there doubles dQ's error (docs/accuracy.md); the softmax statistics and dS stay fp32.
#pragma once
#include "dropout.cuh"
#include "kernel_traits.cuh"
#include "launch_geometry.cuh"
#include "masking.cuh"
#include "mma_sm70.cuh"
#include "softcap.cuh"
#include "tile_io.cuh"

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
constexpr bool kBwdAccumulatorMajorMma = true;  // see kAccumulatorMajorMma in warp_tile.cuh
#else
constexpr bool kBwdAccumulatorMajorMma = false;
#endif

template <class KT>
struct BwdWarpGeometry {
    int lane, warp;
    LaneInQuadPair lq;
    int qp_m, qp_n;
    int mtile_key0;  // first key (within the sequence) of this lane's quad-pair's 8-key tile

    __device__ __forceinline__ BwdWarpGeometry(int tid, int n0)
        : lane(tid & 31), warp(tid >> 5), lq(tid & 31),
          qp_m(((tid & 31) >> 2 & 3) % KT::kQuadPairRows), qp_n(((tid & 31) >> 2 & 3) / KT::kQuadPairRows),
          mtile_key0(n0 + (tid >> 5) * KT::kRowsPerWarp + 8 * (((tid & 31) >> 2 & 3) % KT::kQuadPairRows)) {}

    // First query (within the query block) of S^T tile nt of quad-pair column qp_n ^ x.
    __device__ __forceinline__ int stile_q0(int x, int nt) const { return ((qp_n ^ x) * KT::kSTilesPerQuadPair + nt) * 8; }
    __device__ __forceinline__ static constexpr int partner_lane_xor(int x) { return 4 * KT::kQuadPairRows * x; }
    // head_dim column (within the CTA's slice) of dK / dV for logical column c of output tile ot: B = Q^T / dO^T rows
    // (col-major), 8 consecutive columns per tile; kDkDvRowB: B = Q / dO rows, tile pairs with interleaved columns
    // in the quad-pair's column slot (kernel_traits.cuh).
    __device__ __forceinline__ int o_col(int ot, int c) const {
        if (KT::kDkDvRowB)
            return ((qp_n & 1) * 2 + (qp_n >> 1)) * KT::kOColsPerQuadPair + 16 * (ot >> 1) + 8 * (c >> 2) + 4 * (ot & 1) + (c & 3);
        return qp_n * KT::kOColsPerQuadPair + 8 * ot + c;
    }
};

// K or V rows of the warp as the A operand (row-major: the lane's key, head_dim as k), from registers or
// from the CTA's tile in shared memory; 16 bytes (two k-steps) at a time.
template <class KT>
struct KvOperand {
    static constexpr int kRegs = KT::kKvInSmem ? 1 : KT::kQRegs;
    u32 regs[kRegs];
    const half_bits* tile_row;

    __device__ __forceinline__ u32x4 chunk(int kk) const {
        if (KT::kKvInSmem) return load_shared_16B(tile_row + 8 * kk);
        return u32x4{regs[4 * kk], regs[4 * kk + 1], regs[4 * kk + 2], regs[4 * kk + 3]};
    }
};

// The lane's K or V row into registers or the CTA's block into shared memory (rows past seqlen_k: zeros).
template <class KT>
__device__ __forceinline__ void load_kv_operand(const half_bits* base, long long row_stride, int n0, int seqlen_k,
                                                float scale, const BwdWarpGeometry<KT>& g, int tid, half_bits* tile,
                                                KvOperand<KT>& op) {
    if (KT::kKvInSmem) {
        for (int chunk = tid; chunk < KT::kBlockN * KT::kChunksPerRow; chunk += KT::kThreads) {
            int row, col;
            chunk_position<KT::kChunksPerRow>(chunk, row, col);  // 8 rows of one column where rows are short
            u32x4 v = n0 + row < seqlen_k ? load_global_16B(base + (long long)(n0 + row) * row_stride + col) : zero_u32x4();
            store_shared_16B(tile + KT::KvRows::offset(row) + col, scale != 1.f ? scale_halves(v, scale) : v);
        }
        op.tile_row = tile + KT::KvRows::offset(g.mtile_key0 - n0 + g.lq.operand_row());
        return;
    }
    const int row = g.mtile_key0 + g.lq.operand_row();
#pragma unroll
    for (int c = 0; c < KT::kChunksPerRow; ++c) {
        u32x4 v = row < seqlen_k ? load_global_16B(base + (long long)row * row_stride + 8 * c) : zero_u32x4();
        if (scale != 1.f) v = scale_halves(v, scale);
        op.regs[(4 * c + 0) % KvOperand<KT>::kRegs] = v.x;
        op.regs[(4 * c + 1) % KvOperand<KT>::kRegs] = v.y;
        op.regs[(4 * c + 2) % KvOperand<KT>::kRegs] = v.z;
        op.regs[(4 * c + 3) % KvOperand<KT>::kRegs] = v.w;
    }
}

// Per-lane accumulators of the dK/dV kernel (fp32; f32 accumulator layout, or the row layout of fp16 products).
template <class KT>
struct BwdAccumulators {
    float dk[KT::kOTilesPerQuadPair][8];
    float dv[KT::kOTilesPerQuadPair][8];

    __device__ __forceinline__ void init() {
#pragma unroll
        for (int ot = 0; ot < KT::kOTilesPerQuadPair; ++ot)
#pragma unroll
            for (int i = 0; i < 8; ++i) dk[ot][i] = dv[ot][i] = 0.f;
    }
    __device__ __forceinline__ static int row(const LaneInQuadPair& lq, int i) {
        return KT::kDkDvF16Products ? lq.operand_row() : lq.acc_row(i);
    }
    __device__ __forceinline__ static int col(const LaneInQuadPair& lq, int i) {
        return KT::kDkDvF16Products ? i : lq.acc_col(i);
    }
};

// S^T (or dP^T) tiles of one warp, fp32: A = the warp's K (or V) rows, B = Q (or dO) rows of the query block
// (col-major B: the lane feeds query column operand_row(), 8 head_dim values per 16-byte load).
template <class KT>
__device__ __forceinline__ void bwd_rows_times_tile(const KvOperand<KT>& a, const half_bits* b_tile,
                                                    const BwdWarpGeometry<KT>& g, float (&s)[KT::kSTilesPerQuadPair][8]) {
#pragma unroll
    for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt)
#pragma unroll
        for (int i = 0; i < 8; ++i) s[nt][i] = 0.f;
#pragma unroll
    for (int o = 0; o < KT::kSTilesPerQuadPair * (KT::kHeadDim / 8); ++o) {
        const int nt = kBwdAccumulatorMajorMma ? o / (KT::kHeadDim / 8) : o % KT::kSTilesPerQuadPair;
        const int kk = kBwdAccumulatorMajorMma ? o % (KT::kHeadDim / 8) : o / KT::kSTilesPerQuadPair;
        const u32x4 b = load_shared_16B(b_tile + KT::QRows::offset(g.stile_q0(0, nt) + g.lq.operand_row()) + 8 * kk);
        const u32x4 av = a.chunk(kk);
        mma_rc_f32(s[nt], av.x, av.y, b.x, b.y);
        mma_rc_f32(s[nt], av.z, av.w, b.z, b.w);
    }
}

// Key and query (within the block) of element i of S^T tile nt (fp32 accumulator layout).
template <class KT>
__device__ __forceinline__ int bwd_elem_key(const BwdWarpGeometry<KT>& g, int i) { return g.mtile_key0 + g.lq.acc_row(i); }
template <class KT>
__device__ __forceinline__ int bwd_elem_query(const BwdWarpGeometry<KT>& g, int nt, int i) {
    return g.stile_q0(0, nt) + g.lq.acc_col(i);
}

// kDkDvRowB: C += A B over one query block with B = the [query][head_dim] rows of Q / dO (row-major B): lane t of a
// quad-pair loads 16 bytes of query rows q0 + t and q0 + 4 + t (the two k-steps of an 8-query fragment), which feed
// output tiles 2j and 2j + 1 (columns interleaved: BwdWarpGeometry::o_col). FP16-ACC non-lean tiles accumulate the
// block in fp16 (the f16 C layout, logical columns), then into fp32, as the col-major path does.
template <class KT>
__device__ __forceinline__ void bwd_frags_times_rows(const u32 (&own)[KT::kSTilesPerQuadPair][4],
                                                     const u32 (&partner)[KT::kPartnerSlots][KT::kSTilesPerQuadPair][4],
                                                     const half_bits* rows_tile, const BwdWarpGeometry<KT>& g,
                                                     float (&acc)[KT::kOTilesPerQuadPair][8]) {
    constexpr int kPairs = KT::kOTilesPerQuadPair / 2;
    constexpr bool kF16Products = KT::kDkDvF16Products;
    constexpr int kChunkPairs = kF16Products ? 2 : kPairs;  // fp16 partial sums of 4 tiles at a time (registers)
    constexpr int kSteps = KT::kQuadPairCols * KT::kSTilesPerQuadPair;
    const half_bits* cols = rows_tile + g.o_col(0, 0) + 8 * g.lq.hi;  // + QRows::offset(query) + 16 j
#pragma unroll
    for (int j0 = 0; j0 < kPairs; j0 += kChunkPairs) {
        u32 c16[2 * kChunkPairs][4];
#pragma unroll
        for (int k = 0; k < 2 * kChunkPairs; ++k)
#pragma unroll
            for (int r = 0; r < 4; ++r) c16[k][r] = 0u;
#pragma unroll
        for (int o = 0; o < kChunkPairs * kSteps; ++o) {
            const int jj = kBwdAccumulatorMajorMma ? o / kSteps : o % kChunkPairs;
            const int step = kBwdAccumulatorMajorMma ? o % kSteps : o / kChunkPairs;
            const int j = j0 + jj;
            if (j >= kPairs) continue;
            const int x = step / KT::kSTilesPerQuadPair, nt = step % KT::kSTilesPerQuadPair;
            const u32(&a)[4] = x ? partner[x - 1][nt] : own[nt];
            const int q0 = g.stile_q0(x, nt);  // a multiple of 8: rows q0 + t and q0 + 4 + t share QRows' gap
            const u32x4 b0 = load_shared_16B(cols + KT::QRows::offset(q0 + g.lq.t) + 16 * j);
            const u32x4 b1 = load_shared_16B(cols + KT::QRows::offset(q0 + 4 + g.lq.t) + 16 * j);
            if (kF16Products) {
                mma_rr_f16(c16[2 * jj], a[0], a[1], b0.x, b0.y);
                mma_rr_f16(c16[2 * jj], a[2], a[3], b1.x, b1.y);
                mma_rr_f16(c16[2 * jj + 1], a[0], a[1], b0.z, b0.w);
                mma_rr_f16(c16[2 * jj + 1], a[2], a[3], b1.z, b1.w);
            } else {
                mma_rr_f32(acc[2 * j], a[0], a[1], b0.x, b0.y);
                mma_rr_f32(acc[2 * j], a[2], a[3], b1.x, b1.y);
                mma_rr_f32(acc[2 * j + 1], a[0], a[1], b0.z, b0.w);
                mma_rr_f32(acc[2 * j + 1], a[2], a[3], b1.z, b1.w);
            }
        }
        if (kF16Products) {
#pragma unroll
            for (int k = 0; k < 2 * kChunkPairs; ++k)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    if (2 * j0 + k < KT::kOTilesPerQuadPair) {
                        acc[2 * j0 + k][2 * r] += low_half_to_float(c16[k][r]);
                        acc[2 * j0 + k][2 * r + 1] += high_half_to_float(c16[k][r]);
                    }
        }
    }
}

// C += A B over one query block, A = f16x2 row fragments of the warp (own and partners' query columns), B =
// a [head_dim][query] tile (col-major B). FP16-ACC accumulates the block in fp16 chunks, then into fp32.
template <class KT>
__device__ __forceinline__ void bwd_frags_times_tile(const u32 (&own)[KT::kSTilesPerQuadPair][4],
                                                     const u32 (&partner)[KT::kPartnerSlots][KT::kSTilesPerQuadPair][4],
                                                     const half_bits* bt_tile, const BwdWarpGeometry<KT>& g,
                                                     float (&acc)[KT::kOTilesPerQuadPair][8]) {
    constexpr int kTiles = KT::kOTilesPerQuadPair;
    // Lean tiles (sm_70 only) take fp32 products in both modes: on a V100 the f16-accumulating HMMA runs at the
    // f32 rate (2 steps of 4 cycles = 4 of 2), and fp16 partial sums would cost registers and conversions.
    constexpr bool kF16Products = KT::kDkDvF16Products;
    if constexpr (KT::kDkDvRowB) {
        bwd_frags_times_rows<KT>(own, partner, bt_tile, g, acc);
        return;
    }
    constexpr int kChunk = kF16Products ? 4 : kTiles;
    // This lane's row of output tile 0; tile ot's row is offset(8 * ot) further (additive: the row within the
    // quad-pair's kOColsPerQuadPair rows stays below it, and 8 * ot is a multiple of 4).
    const half_bits* bt_rows = bt_tile + KT::QtRows::offset(g.qp_n * KT::kOColsPerQuadPair + g.lq.operand_row());
#pragma unroll
    for (int ot0 = 0; ot0 < kTiles; ot0 += kChunk) {
        constexpr int kCount = kChunk;
        u32 c16[kCount][4];
#pragma unroll
        for (int j = 0; j < kCount; ++j)
#pragma unroll
            for (int r = 0; r < 4; ++r) c16[j][r] = 0u;
        constexpr int kSteps = KT::kQuadPairCols * KT::kSTilesPerQuadPair;
#pragma unroll
        for (int o = 0; o < kCount * kSteps; ++o) {
            const int j = kBwdAccumulatorMajorMma ? o / kSteps : o % kCount;
            const int step = kBwdAccumulatorMajorMma ? o % kSteps : o / kCount;
            const int x = step / KT::kSTilesPerQuadPair, nt = step % KT::kSTilesPerQuadPair;
            const int ot = ot0 + j;
            if (ot >= kTiles) continue;
            const u32(&a)[4] = x ? partner[x - 1][nt] : own[nt];
            const u32x4 b = load_shared_16B(bt_rows + KT::QtRows::offset(8 * ot) + g.stile_q0(x, nt));
            if (kF16Products) {
                mma_rc_f16(c16[j], a[0], a[1], b.x, b.y);
                mma_rc_f16(c16[j], a[2], a[3], b.z, b.w);
            } else {
                mma_rc_f32(acc[ot], a[0], a[1], b.x, b.y);
                mma_rc_f32(acc[ot], a[2], a[3], b.z, b.w);
            }
        }
        if (kF16Products) {
#pragma unroll
            for (int j = 0; j < kCount; ++j)
#pragma unroll
                for (int r = 0; r < 4; ++r)
                    if (ot0 + j < kTiles) {
                        acc[ot0 + j][2 * r] += low_half_to_float(c16[j][r]);
                        acc[ot0 + j][2 * r + 1] += high_half_to_float(c16[j][r]);
                    }
        }
    }
}

// Element i of dQ's output tile ot in fp32, from the fp32 or the packed fp16 accumulators.
template <class KT>
__device__ __forceinline__ float dq_value(const float (&acc)[KT::kDqTilesPerQuadPair][8],
                                          const u32 (&acc16)[KT::kDqTilesPerQuadPair][4], int ot, int i) {
    if (KT::kAccumF16) return (i & 1) ? high_half_to_float(acc16[ot][i / 2]) : low_half_to_float(acc16[ot][i / 2]);
    return acc[ot][i];
}

// The column of logical column c of dQ's output tile ot, from the quad-pair's first column `base`: base + 8 ot + c,
// or with kDqFromK the interleaved columns of a tile pair (bwd_dq_atomic).
template <class KT>
__device__ __forceinline__ int dq_column(int base, int ot, int c) {
    return KT::kDqFromK ? base + 16 * (ot >> 1) + 8 * (c >> 2) + 4 * (ot & 1) + (c & 3) : base + 8 * ot + c;
}

// dQ (query block) += dS K, each warp its kDqRowsPerWarp queries and kDqColsPerWarp columns, then added into
// dq_accum by fp32 atomics. A = dS [query][key] rows (row-major A); B = K^T [head_dim][key] rows (col-major B) or,
// kDqFromK, the K tile's [key][head_dim] rows (row-major B): there one 16-byte load of a K row feeds a pair of 8-column
// output tiles, whose logical column c of tile 2j + e is the quad-pair's column 16 j + 8 (c >> 2) + 4 e + (c & 3).
template <class KT>
__device__ __forceinline__ void bwd_dq_atomic(const half_bits* ds_tile, const unsigned char* smem, int tid, int m0,
                                              int seqlen_q, float* dq_base, long long dq_row_stride) {
    constexpr int kQpRows = KT::kDqQuadPairRows;
    const int lane = tid & 31, warp = tid >> 5;
    const LaneInQuadPair lq(lane);
    const int qp = (lane >> 2) & 3, qp_m = qp % kQpRows, qp_n = qp / kQpRows;
    // (warp < kDqWarps: without a column split no modulo, and no column offset below)
    const int row_warp = KT::kDqColWarps == 1 ? warp : warp % KT::kDqRowWarps;
    const int row0 = row_warp * KT::kDqRowsPerWarp + 8 * qp_m;  // first query of the quad-pair's tile
    const int col_slot = KT::kDqFromK && KT::kDqQuadPairCols == 4 ? (qp_n & 1) * 2 + (qp_n >> 1) : qp_n;
    const int col0 = (KT::kDqColWarps == 1 ? 0 : (warp / KT::kDqRowWarps) * KT::kDqColsPerWarp) +
                     col_slot * KT::kDqColsPerQuadPair;
    const half_bits* a_row = ds_tile + KT::DsRows::offset(row0 + lq.operand_row());
    // K^T: tile ot's row is offset(8 * ot) further (additive: K^T's gaps come every 8 rows). K rows: lane t's k-row.
    const half_bits* b_rows =
        KT::kDqFromK ? reinterpret_cast<const half_bits*>(smem + KT::kOffK) + KT::KvRows::offset(lq.t) + col0 + 8 * lq.hi
                     : reinterpret_cast<const half_bits*>(smem + KT::kOffKt) + KT::KtRows::offset(col0 + lq.operand_row());
    float acc[KT::kDqTilesPerQuadPair][8];
    u32 acc16[KT::kDqTilesPerQuadPair][4];
#pragma unroll
    for (int ot = 0; ot < KT::kDqTilesPerQuadPair; ++ot)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            acc[ot][i] = 0.f;
            if (i < 4) acc16[ot][i] = 0u;
        }
    constexpr int kKeyChunks = KT::kBlockN / 8;
    if (KT::kDqFromK) {
        constexpr int kPairs = KT::kDqTilesPerQuadPair / 2;
#pragma unroll
        for (int o = 0; o < kPairs * kKeyChunks; ++o) {
            const int j = kBwdAccumulatorMajorMma ? o / kKeyChunks : o % kPairs;
            const int kc = kBwdAccumulatorMajorMma ? o % kKeyChunks : o / kPairs;
            const u32x4 a = load_shared_16B(a_row + 8 * kc);
            // k-rows 8 kc + t (first k-step) and 8 kc + 4 + t (second); KvRows has no gaps in 1x4 tiles
            const u32x4 b0 = load_shared_16B(b_rows + KT::KvRows::offset(8 * kc) + 16 * j);
            const u32x4 b1 = load_shared_16B(b_rows + KT::KvRows::offset(8 * kc + 4) + 16 * j);
            if (KT::kAccumF16) {
                mma_rr_f16(acc16[2 * j], a.x, a.y, b0.x, b0.y);
                mma_rr_f16(acc16[2 * j], a.z, a.w, b1.x, b1.y);
                mma_rr_f16(acc16[2 * j + 1], a.x, a.y, b0.z, b0.w);
                mma_rr_f16(acc16[2 * j + 1], a.z, a.w, b1.z, b1.w);
            } else {
                mma_rr_f32(acc[2 * j], a.x, a.y, b0.x, b0.y);
                mma_rr_f32(acc[2 * j], a.z, a.w, b1.x, b1.y);
                mma_rr_f32(acc[2 * j + 1], a.x, a.y, b0.z, b0.w);
                mma_rr_f32(acc[2 * j + 1], a.z, a.w, b1.z, b1.w);
            }
        }
    } else {
#pragma unroll
        for (int o = 0; o < KT::kDqTilesPerQuadPair * kKeyChunks; ++o) {
            const int ot = kBwdAccumulatorMajorMma ? o / kKeyChunks : o % KT::kDqTilesPerQuadPair;
            const int kc = kBwdAccumulatorMajorMma ? o % kKeyChunks : o / KT::kDqTilesPerQuadPair;
            const u32x4 a = load_shared_16B(a_row + 8 * kc);
            const u32x4 b = load_shared_16B(b_rows + KT::KtRows::offset(8 * ot) + 8 * kc);
            if (KT::kAccumF16) {
                mma_rc_f16(acc16[ot], a.x, a.y, b.x, b.y);
                mma_rc_f16(acc16[ot], a.z, a.w, b.z, b.w);
            } else {
                mma_rc_f32(acc[ot], a.x, a.y, b.x, b.y);
                mma_rc_f32(acc[ot], a.z, a.w, b.z, b.w);
            }
        }
    }
    if constexpr (!KT::kDqRowPointers) {
#pragma unroll
        for (int ot = 0; ot < KT::kDqTilesPerQuadPair; ++ot)
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float value = dq_value<KT>(acc, acc16, ot, i);
                const int row = m0 + row0 + (KT::kAccumF16 ? lq.operand_row() : lq.acc_row(i));
                const int c = KT::kAccumF16 ? i : lq.acc_col(i);  // logical column within tile ot
                const int col = dq_column<KT>(col0, ot, c);
                if (row < seqlen_q) atomicAdd(dq_base + (long long)row * dq_row_stride + col, value);
            }
        return;
    }
    // The lane's elements lie on two rows (f32 layout: acc_row(0) and 2 below; f16: one) at columns that differ from
    // the lane's first by constants: two row pointers, then immediate offsets. Rows past seqlen_q add +0.0 to the last
    // row instead of branching around each atomic (a no-op bit for bit: an fp32 sum that starts at +0 never holds -0).
    const int row = m0 + row0 + (KT::kAccumF16 ? lq.operand_row() : lq.acc_row(0));
    const int lane_col = KT::kAccumF16 ? 0 : lq.acc_col(0);  // (t & 2): below 4, so it never carries into c >> 2
    const bool row_ok = row < seqlen_q, row2_ok = row + 2 < seqlen_q;
    float* const dq_cols = dq_base + col0 + lane_col;
    float* const row_ptr = dq_cols + (long long)min(row, seqlen_q - 1) * dq_row_stride;
    float* const row2_ptr = dq_cols + (long long)min(row + 2, seqlen_q - 1) * dq_row_stride;
#pragma unroll
    for (int ot = 0; ot < KT::kDqTilesPerQuadPair; ++ot)
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float value = dq_value<KT>(acc, acc16, ot, i);
            const bool second = !KT::kAccumF16 && (i & 2);  // acc_row(i) = acc_row(0) + (i & 2)
            const int c = KT::kAccumF16 ? i : (i & 4) + (i & 1);  // logical column within tile ot, less lane_col
            atomicAdd((second ? row2_ptr : row_ptr) + dq_column<KT>(0, ot, c), (second ? row2_ok : row_ok) ? value : 0.f);
        }
}

// The row fragments of the quad-pairs that share this lane's keys (the other query columns of the warp).
template <class KT>
__device__ __forceinline__ void bwd_exchange_partners(const u32 (&own)[KT::kSTilesPerQuadPair][4],
                                                      u32 (&partner)[KT::kPartnerSlots][KT::kSTilesPerQuadPair][4]) {
#pragma unroll
    for (int x = 1; x < KT::kQuadPairCols; ++x)
#pragma unroll
        for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt)
#pragma unroll
            for (int r = 0; r < 4; ++r)
                partner[x - 1][nt][r] = __shfl_xor_sync(0xffffffffu, own[nt][r], BwdWarpGeometry<KT>::partner_lane_xor(x));
}

// What a query-block step works on.
template <class KT>
struct BwdBlockState {
    const KvOperand<KT>& k_op;
    const KvOperand<KT>& v_op;
    BwdAccumulators<KT>& acc;
    const BwdWarpGeometry<KT>& g;
    const VisibleKeys& vis;
    const DropoutRng& rng;
    unsigned char* smem;
    float score_scale;  // scale * log2 e applied to S^T (softcap * log2 e under soft-capping)
    float to_tanh;      // soft-capping: S^T -> argument of tanh (softcap.cuh)
    float dropout_rescale;
    float alibi_log2;   // ALiBi slope of this head times log2 e (0: none)
};

// One query block (queries [m0, m0 + kBlockM) of one query head): dV, dK and (DQ_ATOMIC) dQ.
template <class KT>
__device__ __forceinline__ void bwd_query_block(BwdBlockState<KT>& st, int m0, bool needs_mask, int tid,
                                                float* dq_base, long long dq_row_stride, int seqlen_q) {
    const BwdWarpGeometry<KT>& g = st.g;
    const LaneInQuadPair& lq = g.lq;
    const half_bits* q_tile = reinterpret_cast<const half_bits*>(st.smem + KT::kOffQ);
    const half_bits* do_tile = reinterpret_cast<const half_bits*>(st.smem + KT::kOffDo);
    const half_bits* qt_tile = reinterpret_cast<const half_bits*>(st.smem + KT::kOffQt);
    const half_bits* dot_tile = reinterpret_cast<const half_bits*>(st.smem + KT::kOffDot);
    const float* lse2 = reinterpret_cast<const float*>(st.smem + KT::kOffLse);
    const float* dsum = reinterpret_cast<const float*>(st.smem + KT::kOffDsum);

    float s[KT::kSTilesPerQuadPair][8], dp[KT::kSTilesPerQuadPair][8];
    bwd_rows_times_tile<KT>(st.k_op, q_tile, g, s);
    bwd_rows_times_tile<KT>(st.v_op, do_tile, g, dp);

    u32 p_own[KT::kSTilesPerQuadPair][4], ds_own[KT::kSTilesPerQuadPair][4];
#pragma unroll
    for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt) {
        // Lean: the Philox key through an empty asm at each use, so that its 20 round keys are derived where they
        // are needed (20 integer adds per tile) instead of being hoisted and held in registers across the GEMMs.
        DropoutRng rng_lean = st.rng;
        if (KT::kLean && KT::kDropout) asm volatile("" : "+r"(rng_lean.key0), "+r"(rng_lean.key1));
        const DropoutRng& rng = KT::kLean ? rng_lean : st.rng;
        // dropout: the 64 keep bits of this 8x8 tile (query column c, key j: bit 8c + j) in every lane
        u32 keep_lo = 0xffffffffu, keep_hi = 0xffffffffu;
        if (KT::kDropout) {
            const int query = m0 + g.stile_q0(0, nt) + lq.operand_row();
            const u32 mine = rng.keep_bits((u32)(g.mtile_key0 >> 3), (u32)query);
            const int r = lq.operand_row();
            keep_lo = r < 4 ? mine << (8 * r) : 0u;
            keep_hi = r < 4 ? 0u : mine << (8 * (r - 4));
#pragma unroll
            for (int distance = 1; distance <= 16; distance <<= 1) {
                if (distance == 4 || distance == 8) continue;
                keep_lo |= __shfl_xor_sync(0xffffffffu, keep_lo, distance);
                keep_hi |= __shfl_xor_sync(0xffffffffu, keep_hi, distance);
            }
        }
        float p_kept[8], ds[8];
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const int key = bwd_elem_key<KT>(g, i), query_in_block = bwd_elem_query<KT>(g, nt, i);
            // lse2 / dsum element of the query: padded vectors indexed through the even query of the pair (i, i ^ 1)
            // (acc_col's only odd part is i & 1), so that the compiler still loads each pair with one 64-bit load
            const int vi = KT::Vector::kPad ? KT::Vector::index(bwd_elem_query<KT>(g, nt, i & ~1)) + (i & 1)
                                            : query_in_block;
            float score = s[nt][i];
            float capped_slope = 1.f;  // d(capped score)/d(score), up to the scale change
            if (KT::kSoftcap) {
                score = tanh_by_exp2(score * st.to_tanh);
                capped_slope = SoftCap::derivative(score);
            }
            float bias = 0.f;  // ALiBi, log2 domain
            if (needs_mask && !st.vis.visible(m0 + query_in_block, key)) score = neg_inf();
            else if (st.alibi_log2 != 0.f) bias = st.alibi_log2 * st.vis.diagonal_distance(m0 + query_in_block, key);
            const float p = fast_exp2(fmaf(score, st.score_scale, -lse2[vi] - bias));
            float dpz = dp[nt][i];
            bool kept = true;
            if (KT::kDropout) {
                const int bit = 8 * (query_in_block & 7) + (key & 7);
                kept = ((bit < 32 ? keep_lo >> bit : keep_hi >> (bit - 32)) & 1u) != 0;
                dpz = kept ? dpz * st.dropout_rescale : 0.f;
            }
            p_kept[i] = kept ? p : 0.f;
            ds[i] = p * (dpz - dsum[vi]);
            if (KT::kSoftcap) ds[i] *= capped_slope;
        }
        f32_acc_to_row_fragment(p_kept, lq.t, p_own[nt]);
        f32_acc_to_row_fragment(ds, lq.t, ds_own[nt]);
    }
    u32 p_partner[KT::kPartnerSlots][KT::kSTilesPerQuadPair][4], ds_partner[KT::kPartnerSlots][KT::kSTilesPerQuadPair][4];
    bwd_exchange_partners<KT>(p_own, p_partner);
    if (!KT::kLean) bwd_exchange_partners<KT>(ds_own, ds_partner);
    bwd_frags_times_tile<KT>(p_own, p_partner, KT::kDkDvRowB ? do_tile : dot_tile, g, st.acc.dv);
    // Lean: the partners' dS^T fragments only after dV, 8 registers fewer during dV's product.
    if (KT::kLean) bwd_exchange_partners<KT>(ds_own, ds_partner);
    bwd_frags_times_tile<KT>(ds_own, ds_partner, KT::kDkDvRowB ? q_tile : qt_tile, g, st.acc.dk);

    if (KT::kDqAtomic) {
        // dS^T rows (this lane's key, 8 queries) -> dS [query][key]: transpose each 8x8 tile in the quad-pair
        half_bits* ds_tile = reinterpret_cast<half_bits*>(st.smem + KT::kOffDs);
        const int key_in_block = g.mtile_key0 % KT::kBlockN;  // n0 is a multiple of kBlockN
#pragma unroll
        for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt) {
            u32x4 w{ds_own[nt][0], ds_own[nt][1], ds_own[nt][2], ds_own[nt][3]};
            transpose_8x8_halves_in_quad_pair(w, g.lane);
            store_shared_16B(ds_tile + KT::DsRows::offset(g.stile_q0(0, nt) + lq.operand_row()) + key_in_block, w);
        }
        __syncthreads();  // dS complete
        if (KT::kDqWarps == KT::kWarps || tid < 32 * KT::kDqWarps)
            bwd_dq_atomic<KT>(ds_tile, st.smem, tid, m0, seqlen_q, dq_base, dq_row_stride);
    }
}

// Q, dO (+ transposes of the slice's columns, from out_col0), log2-domain lse and dsum of one query block into
// shared memory.
template <class KT>
__device__ __forceinline__ void bwd_load_query_block(const half_bits* q_base, long long q_row_stride,
                                                     const half_bits* do_base, long long do_row_stride,
                                                     const float* lse_base, const float* dsum_base, int m0,
                                                     int seqlen_q, int tid, unsigned char* smem, int out_col0) {
    using QRows = typename KT::QRows;
    using QtRows = typename KT::QtRows;
    // (kDkDvRowB: rows only, dK / dV read them as row-major B)
    load_rows_and_transpose<KT, KT::kBlockM, QRows, QtRows, KT::kOutDim>(
        q_base, q_row_stride, m0, seqlen_q, tid, reinterpret_cast<half_bits*>(smem + KT::kOffQ),
        KT::kDkDvRowB ? nullptr : reinterpret_cast<half_bits*>(smem + KT::kOffQt), out_col0);
    load_rows_and_transpose<KT, KT::kBlockM, QRows, QtRows, KT::kOutDim>(
        do_base, do_row_stride, m0, seqlen_q, tid, reinterpret_cast<half_bits*>(smem + KT::kOffDo),
        KT::kDkDvRowB ? nullptr : reinterpret_cast<half_bits*>(smem + KT::kOffDot), out_col0);
    float* lse2 = reinterpret_cast<float*>(smem + KT::kOffLse);
    float* dsum = reinterpret_cast<float*>(smem + KT::kOffDsum);
    for (int i = tid; i < KT::kBlockM; i += KT::kThreads) {
        const bool valid = m0 + i < seqlen_q;
        lse2[KT::Vector::index(i)] = valid ? lse_base[m0 + i] * kLog2e : pos_inf();  // lse = +inf (no visible key): P = 0
        dsum[KT::Vector::index(i)] = valid ? dsum_base[m0 + i] : 0.f;
    }
}

// One of dK / dV (times `scale`) to global memory: staged in shared memory, written in 16-byte rows (the slice's
// columns, from `out` + out_col0).
template <class KT>
__device__ __forceinline__ void bwd_write_key_rows(const float (&src)[KT::kOTilesPerQuadPair][8], float scale,
                                                   const BwdWarpGeometry<KT>& g, int n0, int seqlen_k, int tid,
                                                   unsigned char* smem, half_bits* out, long long out_stride,
                                                   int out_col0) {
    half_bits* stage = reinterpret_cast<half_bits*>(smem);
    __syncthreads();  // shared memory is free (the last query block, or the previous output)
    const BwdWarpGeometry<KT> gs((tid & ~31) | staging_lane(g.lane), n0);  // whose fragments this lane stores
    const int row = gs.mtile_key0 - n0 + gs.lq.operand_row();
    if constexpr (KT::kDkDvRowB) {
        // tile pairs 2j, 2j + 1: logical columns 0-3 / 4-7 of each lie 8 columns apart, interleaved (o_col): two
        // 16-byte stores of 8 consecutive columns each
#pragma unroll
        for (int j = 0; j < KT::kOTilesPerQuadPair / 2; ++j) {
            u32 frag[2][4];
#pragma unroll
            for (int e = 0; e < 2; ++e) {
                float scaled[8];
#pragma unroll
                for (int i = 0; i < 8; ++i) scaled[i] = src[2 * j + e][i] * scale;
                staged_row_fragment<!KT::kDkDvF16Products>(scaled, g.lane, frag[e]);
            }
            half_bits* at = stage + row * KT::kRowStride + gs.o_col(2 * j, 0);
            store_shared_16B(at, u32x4{frag[0][0], frag[0][1], frag[1][0], frag[1][1]});
            store_shared_16B(at + 8, u32x4{frag[0][2], frag[0][3], frag[1][2], frag[1][3]});
        }
    } else {
#pragma unroll
        for (int ot = 0; ot < KT::kOTilesPerQuadPair; ++ot) {
            float scaled[8];
#pragma unroll
            for (int i = 0; i < 8; ++i) scaled[i] = src[ot][i] * scale;
            stage_acc_tile_row<!KT::kDkDvF16Products>(scaled, g.lane, stage + row * KT::kRowStride + gs.o_col(ot, 0));
        }
    }
    __syncthreads();
    if (KT::kOutSplit > 1) out += out_col0;
    for (int chunk = tid; chunk < KT::kBlockN * KT::kOutChunksPerRow; chunk += KT::kThreads) {
        int row, col;
        chunk_position<KT::kOutChunksPerRow>(chunk, row, col);  // 8 rows of one column where rows are short
        if (n0 + row < seqlen_k)
            store_global_16B(out + (long long)(n0 + row) * out_stride + col, load_shared_16B(stage + row * KT::kRowStride + col));
    }
}

// Where the query-side tensors of one (batch, query head) start.
struct BwdHeadPointers {
    const half_bits* q;
    const half_bits* dout;
    const float* lse;
    const float* dsum;
    float* dq;

    __device__ __forceinline__ BwdHeadPointers(const AttentionParams& prm, const BackwardParams& bp, int batch, int head,
                                               long long q_start)
        : q(prm.q + batch * prm.q_batch_stride + q_start * prm.q_row_stride + head * prm.q_head_stride),
          dout(bp.dout + batch * bp.do_batch_stride + q_start * bp.do_row_stride + head * bp.do_head_stride),
          lse(prm.lse + batch * prm.lse_batch_stride + head * prm.lse_head_stride + q_start),
          dsum(bp.dsum + batch * prm.lse_batch_stride + head * prm.lse_head_stride + q_start),
          dq(bp.dq_accum + batch * bp.dq_batch_stride + q_start * bp.dq_row_stride + head * bp.dq_head_stride) {}
};

template <class KT>
__global__ void __launch_bounds__(KT::kThreads, KT::kMinBlocksPerSM) flash_bwd_dkdv_kernel(const BackwardParams bp) {
    extern __shared__ __align__(16) unsigned char smem[];
    const AttentionParams& prm = bp.fwd;
    // Grid order (launch.py): x the key block and y the (batch, kv head), or, with m_blocks_fastest 0, the other way
    // round, so that every head's longest (causal) key blocks are dispatched first.
    const bool keys_fastest = prm.m_blocks_fastest != 0;
    const int n_block = (int)(keys_fastest ? blockIdx.x : blockIdx.y);
    const int bh = (int)(keys_fastest ? blockIdx.y : blockIdx.x);
    const int kv_head = bh % (prm.nheads / prm.heads_per_kv);
    const int batch = bh / (prm.nheads / prm.heads_per_kv);
    const SequenceExtent seq(prm, batch);
    const int n0 = n_block * KT::kBlockN;
    if (n0 >= seq.seqlen_k) return;
    const int out_col0 = KT::kOutSplit > 1 ? (int)blockIdx.z * KT::kOutDim : 0;  // the slice's first dK / dV column
    const int tid = threadIdx.x;
    const VisibleKeys vis(prm, seq);
    const BwdWarpGeometry<KT> g(tid, n0);

    const half_bits* k_base = prm.k + batch * prm.k_batch_stride + seq.k_start * prm.k_row_stride + kv_head * prm.k_head_stride;
    const half_bits* v_base = prm.v + batch * prm.v_batch_stride + seq.k_start * prm.v_row_stride + kv_head * prm.v_head_stride;
    float score_scale = prm.scale_log2, to_tanh = 0.f;
    if (KT::kSoftcap) {
        const SoftCap cap(prm.softcap_log2, prm.scale_log2);
        score_scale = cap.score_scale;
        to_tanh = cap.to_tanh;
    }
    KvOperand<KT> k_op, v_op;
    load_kv_operand<KT>(k_base, prm.k_row_stride, n0, seq.seqlen_k, 1.f, g, tid,
                        reinterpret_cast<half_bits*>(smem + KT::kOffK), k_op);
    load_kv_operand<KT>(v_base, prm.v_row_stride, n0, seq.seqlen_k, 1.f, g, tid,
                        reinterpret_cast<half_bits*>(smem + KT::kOffV), v_op);
    if (KT::kDqAtomic && !KT::kDqFromK) {  // K^T for dQ = dS K (unscaled)
        load_rows_and_transpose<KT, KT::kBlockN, typename KT::KtRows, typename KT::KtRows>(
            k_base, prm.k_row_stride, n0, seq.seqlen_k, tid, nullptr, reinterpret_cast<half_bits*>(smem + KT::kOffKt));
    }
    BwdAccumulators<KT> acc;
    acc.init();

    // Query rows that see any key of [n0, n1): i >= j - shift - right and i <= j - shift + left.
    const int n1 = min(n0 + KT::kBlockN, seq.seqlen_k);
    const int q_begin = vis.right < 0 ? 0 : max(0, n0 - vis.shift - vis.right);
    const int q_end = vis.left < 0 ? seq.seqlen_q : min(seq.seqlen_q, n1 - 1 - vis.shift + vis.left + 1);
    for (int h = 0; h < prm.heads_per_kv; ++h) {
        const int head = kv_head * prm.heads_per_kv + h;
        const half_bits* q_base = prm.q + batch * prm.q_batch_stride + seq.q_start * prm.q_row_stride + head * prm.q_head_stride;
        const half_bits* do_base = bp.dout + batch * bp.do_batch_stride + seq.q_start * bp.do_row_stride + head * bp.do_head_stride;
        const float* lse_base = prm.lse + batch * prm.lse_batch_stride + head * prm.lse_head_stride + seq.q_start;
        const float* dsum_base = bp.dsum + batch * prm.lse_batch_stride + head * prm.lse_head_stride + seq.q_start;
        float* dq_base = bp.dq_accum + batch * bp.dq_batch_stride + seq.q_start * bp.dq_row_stride + head * bp.dq_head_stride;
        const DropoutRng rng(prm.seed, prm.offset, prm.dropout_threshold, (u32)(batch * prm.nheads + head));
        BwdBlockState<KT> st{k_op, v_op, acc, g, vis, rng, smem, score_scale, to_tanh, prm.dropout_rescale,
                             alibi_slope_log2(prm, batch, head)};
        for (int m_block = q_begin / KT::kBlockM; m_block * KT::kBlockM < q_end; ++m_block) {
            const int m0 = m_block * KT::kBlockM;
            if (KT::kLean) {
                // The thread index and the head through an empty asm, so that the tile loaders' and dQ's per-thread
                // addresses, the head's base pointers and its dropout state are recomputed in each iteration (a few
                // dozen integer instructions) instead of being hoisted out of the loops and held in ~40 registers
                // for the whole kernel (which made the 2x2 head_dim 128 tile spill).
                int tid_it = tid, head_it = head;
                asm volatile("" : "+r"(tid_it), "+r"(head_it));
                const BwdHeadPointers hp(prm, bp, batch, head_it, seq.q_start);
                const DropoutRng rng_it(prm.seed, prm.offset, prm.dropout_threshold, (u32)(batch * prm.nheads + head_it));
                BwdBlockState<KT> st_it{k_op, v_op, acc, g, vis, rng_it, smem, score_scale, to_tanh, prm.dropout_rescale,
                                        alibi_slope_log2(prm, batch, head_it)};
                __syncthreads();  // the previous block's tiles (and dS) are no longer read
                bwd_load_query_block<KT>(hp.q, prm.q_row_stride, hp.dout, bp.do_row_stride, hp.lse, hp.dsum, m0,
                                         seq.seqlen_q, tid_it, smem, out_col0);
                __syncthreads();
                const bool needs_mask = !vis.tile_is_full(m0, min(m0 + KT::kBlockM, seq.seqlen_q), n0, n0 + KT::kBlockN);
                bwd_query_block<KT>(st_it, m0, needs_mask, tid_it, hp.dq, bp.dq_row_stride, seq.seqlen_q);
                continue;
            }
            __syncthreads();  // the previous block's tiles (and dS) are no longer read
            bwd_load_query_block<KT>(q_base, prm.q_row_stride, do_base, bp.do_row_stride, lse_base, dsum_base, m0,
                                     seq.seqlen_q, tid, smem, out_col0);
            __syncthreads();
            const bool needs_mask = !vis.tile_is_full(m0, min(m0 + KT::kBlockM, seq.seqlen_q), n0, n0 + KT::kBlockN);
            bwd_query_block<KT>(st, m0, needs_mask, tid, dq_base, bp.dq_row_stride, seq.seqlen_q);
        }
    }

    // dK * softmax_scale and dV * 1 / (1 - p), staged in shared memory, written in 16-byte rows
    half_bits* dk_base = bp.dk + batch * bp.dk_batch_stride + seq.k_start * bp.dk_row_stride + kv_head * bp.dk_head_stride;
    half_bits* dv_base = bp.dv + batch * bp.dv_batch_stride + seq.k_start * bp.dv_row_stride + kv_head * bp.dv_head_stride;
    bwd_write_key_rows<KT>(acc.dk, bp.softmax_scale, g, n0, seq.seqlen_k, tid, smem, dk_base, bp.dk_row_stride,
                           out_col0);
    bwd_write_key_rows<KT>(acc.dv, KT::kDropout ? prm.dropout_rescale : 1.f, g, n0, seq.seqlen_k, tid, smem, dv_base,
                           bp.dv_row_stride, out_col0);
}

// What the host launches flash_bwd_dkdv_kernel<KT> with (launch_geometry.cuh).
template <class KT>
__device__ LaunchGeometry flash_bwd_dkdv_kernel_geometry = {KT::kSmemBytes, KT::kThreads, KT::kBlockM, KT::kBlockN};
