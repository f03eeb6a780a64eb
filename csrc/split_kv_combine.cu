// The combine kernel of the split-KV decoding kernel's partial results (flash_fwd_kernel with SplitKvParams and
// num_splits > 1, volta_train/kernels/decode.py): for every (batch, head, row) of that launch,
//   lse = log sum_s exp(lse_s),   O = sum_s exp(lse_s - lse) * O_s,
// written where the unsplit kernel writes (o as fp16 and lse through the params' strides, from the entry's first
// packed row with varlen queries); a row that no split saw a key of (every lse_s = -inf) gets O = 0 and lse = +inf,
// the key-less convention of every backend.
//
// Partials (params.cuh): o_partial [num_splits, B * nheads, seqlen_q, HEAD_DIM] and lse_partial [num_splits,
// B * nheads, seqlen_q], fp32, natural log, -inf where a split saw no key; only an entry's own rows are read
// (SequenceExtent: seqlen_q when dense, cu_seqlens_q's count with varlen queries). Grid (B * nheads, row blocks),
// one warp per row: each lane holds the log-sum-exp of splits lane and lane + 32, then accumulates two adjacent
// columns per 64 of the row over all splits. Named by NVRTC name expressions "flash_split_kv_combine_kernel<HEAD_DIM>"
// (volta_train/kernels/tiles.py combine_variant).
#include "launch_geometry.cuh"
#include "params.cuh"

constexpr int kCombineRowsPerCta = 4;  // warps per CTA, one row each (decode.py COMBINE_ROWS_PER_CTA)
// At most 64 splits (two per lane; decode.py COMBINE_MAX_SPLITS, split_plan's limit).

struct __align__(8) f32x2 { float x, y; };

template <int HEAD_DIM>
__global__ void __launch_bounds__(32 * kCombineRowsPerCta) flash_split_kv_combine_kernel(const SplitKvParams p) {
    static_assert(HEAD_DIM % 2 == 0, "columns are combined in pairs");
    constexpr int kPairsPerLane = (HEAD_DIM + 63) / 64;
    const int lane = threadIdx.x & 31;
    const int bh = blockIdx.x;
    const int batch = bh / p.nheads, head = bh % p.nheads;
    const SequenceExtent seq(p, batch);
    const int row = blockIdx.y * kCombineRowsPerCta + (threadIdx.x >> 5);
    if (row >= seq.seqlen_q) return;  // the whole warp: no shuffle below is left half-done
    const long long split_rows = (long long)gridDim.x * p.seqlen_q;  // rows from one split's block to the next
    const long long first = (long long)bh * p.seqlen_q + row;      // this row in split 0

    // The splits' weights exp(lse_s - max), in the log2 domain like the kernels' softmax: exp2(-inf) = 0.
    const float lse_lo = lane < p.num_splits ? p.lse_partial[lane * split_rows + first] * kLog2e : neg_inf();
    const float lse_hi = lane + 32 < p.num_splits ? p.lse_partial[(lane + 32) * split_rows + first] * kLog2e : neg_inf();
    const float max2 = max_over_warp(fmaxf(lse_lo, lse_hi));
    const bool seen = max2 != neg_inf();
    const float offset = safe_row_max(max2);
    const float w_lo = fast_exp2(lse_lo - offset), w_hi = fast_exp2(lse_hi - offset);
    const float total = sum_over_warp(w_lo + w_hi);
    const float inv_total = seen ? 1.f / total : 0.f;

    f32x2 acc[kPairsPerLane];
#pragma unroll
    for (int j = 0; j < kPairsPerLane; ++j) acc[j] = f32x2{0.f, 0.f};
    for (int s = 0; s < p.num_splits; ++s) {
        // every lane takes part in the shuffle; split s's weight sits in lane s & 31
        const float w = __shfl_sync(0xffffffffu, s < 32 ? w_lo : w_hi, s & 31) * inv_total;
        const float* o_s = p.o_partial + (s * split_rows + first) * HEAD_DIM;
#pragma unroll
        for (int j = 0; j < kPairsPerLane; ++j) {
            const int col = 2 * lane + 64 * j;
            if (col < HEAD_DIM) {
                const f32x2 o = *reinterpret_cast<const f32x2*>(o_s + col);
                acc[j].x += w * o.x;
                acc[j].y += w * o.y;
            }
        }
    }

    half_bits* o_row = p.o + batch * p.o_batch_stride + head * p.o_head_stride + (seq.q_start + row) * p.o_row_stride;
#pragma unroll
    for (int j = 0; j < kPairsPerLane; ++j) {
        const int col = 2 * lane + 64 * j;
        if (col < HEAD_DIM) *reinterpret_cast<half2_bits*>(o_row + col) = pack_half2(acc[j].x, acc[j].y);
    }
    if (lane == 0)
        p.lse[batch * p.lse_batch_stride + head * p.lse_head_stride + seq.q_start + row] =
            seen ? (max2 + fast_log2(total)) * kLn2 : pos_inf();
}

// What the host launches flash_split_kv_combine_kernel<HEAD_DIM> with (launch_geometry.cuh): no tile, a warp per row.
template <int HEAD_DIM>
__device__ LaunchGeometry flash_split_kv_combine_kernel_geometry = {0, 32 * kCombineRowsPerCta, kCombineRowsPerCta, 0};
