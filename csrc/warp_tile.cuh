// The warp tile shared by the forward kernel and the backward's dQ kernel: a CTA of kBlockM query rows walking
// key blocks, each warp kRowsPerWarp rows, the quad-pairs of every m8n8k4 arranged kQuadPairRows x
// kQuadPairCols (kernel_traits.cuh). Here: the warp geometry, where accumulator elements sit, the A operand
// (Q, or dO in the dQ kernel) and the two products both kernels build on, S-shaped A B^T and O-shaped P B.
#pragma once
#include "kernel_traits.cuh"
#include "mma_sm70.cuh"
#include "tile_io.cuh"

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

// Where the elements of an S-shaped accumulator tile (8x8, S = Q K^T, or O) of this kernel family sit. Row
// slots: FP32-ACC lanes hold two rows per m-tile (element i in row slot (i >> 1) & 1, see mma_sm70.cuh),
// FP16-ACC lanes one.
template <class KT>
struct FwdFragmentLayout {
    static constexpr int kRowSlots = KT::kAccumF16 ? 1 : 2;

    // Row slot of output element i of an 8x8 tile.
    __device__ __forceinline__ static int row_slot(int i) { return KT::kAccumF16 ? 0 : f32_acc_row_slot(i); }
    // Row (within the m-tile) and physical column of output element i.
    __device__ __forceinline__ static int row(const LaneInQuadPair& lq, int i) {
        return KT::kAccumF16 ? lq.operand_row() : lq.acc_row(i);
    }
    __device__ __forceinline__ static int phys_col(const LaneInQuadPair& lq, int i) {
        return KT::kAccumF16 ? i : lq.acc_col(i);
    }
    // Row (within the m-tile) of row slot r: FP32-ACC lanes t hold rows (t & 1) + 2r (+4 in the high group).
    __device__ __forceinline__ static int slot_row(const LaneInQuadPair& lq, int r) {
        return KT::kAccumF16 ? lq.operand_row() : (lq.t & 1) + 2 * r + 4 * lq.hi;
    }
};

// Q as the A operand of S = Q K^T (row-major: the lane's row of each m-tile), 16 bytes = two k-steps at a
// time, from registers or from the CTA's Q tile in shared memory (KT::kQInSmem; layout KT::QRows).
template <class KT>
struct QOperand {
    using Rows = typename KT::QRows;
    static constexpr int kRegs = KT::kQInSmem ? 1 : KT::kQRegs;
    u32 regs[KT::kMTiles][kRegs];
    const half_bits* tile_row;  // shared memory: this lane's row of m-tile 0

    // m-tile a's row is Rows::offset(a * 8 * kQuadPairRows) further (additive: the row within the warp's first
    // 8 * kQuadPairRows rows plus a multiple of 16 rows, every gap's period dividing 16, or no gaps).
    __device__ __forceinline__ u32x4 chunk(int a, int kk) const {
        if (KT::kQInSmem)
            return load_shared_16B(tile_row + Rows::offset(a * 8 * KT::kQuadPairRows) + 8 * kk);
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
    using Rows = typename KT::QRows;
    if (KT::kQInSmem) {
        for (int chunk = tid; chunk < KT::kBlockM * KT::kChunksPerRow; chunk += KT::kThreads) {
            int row, col;
            tile_chunk_position<KT>(chunk, row, col);
            const u32x4 v = m0 + row < seqlen_q ? load_global_16B(q_base + (long long)(m0 + row) * row_stride + col)
                                                : zero_u32x4();
            store_shared_16B(q_tile + Rows::offset(row) + col, prescale_q_chunk<KT>(v, scale_log2));
        }
        q.tile_row = q_tile + Rows::offset(g.mtile_row0(0) - m0 + g.lq.operand_row());
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

// acc[a][nt] += A B^T over head_dim for every m-tile a and S tile nt (the loop of rows_times_tile_rows), in the
// accumulator type of the mode: u32[4] (f16x2, FP16-ACC) or float[8] (FP32-ACC), through the matching mma_rc.
template <class KT, class Acc>
__device__ __forceinline__ void accumulate_rows_times_tile_rows(const QOperand<KT>& q, const half_bits* b_tile,
                                                                const FwdWarpGeometry<KT>& g, Acc& acc) {
    for_each_qk_step<KT>([&](int nt, int kk) {
        const u32x4 b = load_shared_16B(b_tile + KT::KRows::offset(g.stile_key0(nt) + g.lq.operand_row()) + 8 * kk);
#pragma unroll
        for (int a = 0; a < KT::kMTiles; ++a) {
            const u32x4 qa = q.chunk(a, kk);
            mma_rc(acc[a][nt], qa.x, qa.y, b.x, b.y);
            mma_rc(acc[a][nt], qa.z, qa.w, b.z, b.w);
        }
    });
}

// S-shaped products of one warp: s = A B^T with A = the warp's rows (Q, or dO in the dQ kernel) and B = the
// rows of a [key][head_dim] tile in shared memory (col-major B: the lane feeds key column operand_row(), 8
// head_dim values per 16-byte load). FP16-ACC accumulates in fp16 and widens the result.
template <class KT>
__device__ __forceinline__ void rows_times_tile_rows(const QOperand<KT>& q, const half_bits* b_tile,
                                                     const FwdWarpGeometry<KT>& g,
                                                     float (&s)[KT::kMTiles][KT::kSTilesPerQuadPair][8]) {
    if (KT::kAccumF16) {
        u32 s16[KT::kMTiles][KT::kSTilesPerQuadPair][4];
#pragma unroll
        for (int a = 0; a < KT::kMTiles; ++a)
#pragma unroll
            for (int nt = 0; nt < KT::kSTilesPerQuadPair; ++nt)
#pragma unroll
                for (int r = 0; r < 4; ++r) s16[a][nt][r] = 0u;
        accumulate_rows_times_tile_rows<KT>(q, b_tile, g, s16);
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
        accumulate_rows_times_tile_rows<KT>(q, b_tile, g, s);
    }
}

// This lane's eight values of an S-shaped tile as the A-operand row fragment of the next product (P of O = P V,
// dS of dQ = dS K): FP16-ACC lanes hold one row already and pack it; FP32-ACC lanes hold halves of two rows and
// trade them with lane t ^ 2 (f32_acc_to_row_fragment, mma_sm70.cuh).
template <class KT>
__device__ __forceinline__ void to_row_fragment(const float (&x)[8], const LaneInQuadPair& lq, u32 (&frag)[4]) {
    if (KT::kAccumF16) {
#pragma unroll
        for (int r = 0; r < 4; ++r) frag[r] = pack_half2(x[2 * r], x[2 * r + 1]);
    } else {
        f32_acc_to_row_fragment(x, lq.t, frag);
    }
}

// O += P B for one key block, B given transposed in shared memory ([output column][key], e.g. V^T): the
// forward's O += P V and the dQ kernel's dQ += dS K. A = P as row fragments (row-major, 4 keys per k-step:
// p_own the keys of this lane's quad-pair column, p_partner[x - 1] those of quad-pair column qp_n ^ x), B = rows
// of the transposed tile (col-major B: the lane feeds output column operand_row() of the tile, 8 keys per 16-byte
// load = two k-steps). FP16-ACC accumulates chunks of kOChunk output tiles in fp16 over the whole key block, then
// adds each chunk into the fp32 O: few fp16 registers live at a time.
template <class KT>
__device__ __forceinline__ void accumulate_rows_times_transposed_tile(const u32 (&p_own)[KT::kMTiles][KT::kSTilesPerQuadPair][4],
                                                  const u32 (&p_partner)[KT::kPartnerSlots][KT::kMTiles][KT::kSTilesPerQuadPair][4],
                                                  const half_bits* vt_tile, const FwdWarpGeometry<KT>& g,
                                                  float (&o)[KT::kMTiles][KT::kOTilesPerQuadPair][8]) {
    constexpr int kTiles = KT::kOTilesPerQuadPair;
    constexpr int kOChunk = KT::kAccumF16 ? 4 : kTiles;  // output tiles per fp16 chunk
    const LaneInQuadPair& lq = g.lq;
    // tile ot's row is offset(8 * ot) further (additive: VtRows' gaps come every 4 rows)
    const half_bits* vt_rows = vt_tile + KT::VtRows::offset(g.qp_n * KT::kOColsPerQuadPair + lq.operand_row());
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
            const u32x4 b = load_shared_16B(vt_rows + KT::VtRows::offset(8 * ot) + group_key0);
#pragma unroll
            for (int a = 0; a < KT::kMTiles; ++a) {
                const u32(&pf)[4] = x ? p_partner[x - 1][a][nt] : p_own[a][nt];
                if (KT::kAccumF16) {
                    mma_rc_f16(o16[a][ot], pf[0], pf[1], b.x, b.y);
                    mma_rc_f16(o16[a][ot], pf[2], pf[3], b.z, b.w);
                } else {
                    mma_rc_f32(o[a][ot], pf[0], pf[1], b.x, b.y);
                    mma_rc_f32(o[a][ot], pf[2], pf[3], b.z, b.w);
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
                        o[a][ot][2 * r] += low_half_to_float(o16[a][ot][r]);
                        o[a][ot][2 * r + 1] += high_half_to_float(o16[a][ot][r]);
                    }
        }
    }
}

// Sends this lane's row fragment `own` (S tile nt of m-tile a, four f16x2 registers) to the quad-pairs that share
// its rows (2x2 and 1x4) and receives theirs: partner[x - 1][a][nt] gets the fragment of quad-pair column qp_n ^ x.
template <class KT>
__device__ __forceinline__ void share_with_partner_quad_pairs(
    const u32 (&own)[4], u32 (&partner)[KT::kPartnerSlots][KT::kMTiles][KT::kSTilesPerQuadPair][4], int a, int nt) {
#pragma unroll
    for (int x = 1; x < KT::kQuadPairCols; ++x)
#pragma unroll
        for (int r = 0; r < 4; ++r)
            partner[x - 1][a][nt][r] = __shfl_xor_sync(0xffffffffu, own[r], FwdWarpGeometry<KT>::partner_lane_xor(x));
}
