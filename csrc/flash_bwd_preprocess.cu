// The backward's preprocess, run before the dK/dV kernel: in one read of dO and O it writes
//   dsum = rowsum(dO * O)   (fp32 products and sums, laid out like lse: the lse strides of the params),
// and, where the dK/dV kernel adds dQ by atomics (dq_accum not null), zeroes that row of dq_accum (dq strides).
// volta_train/kernels/launch.py dot_do_o is its specification in PyTorch.
//
// Grid (row blocks, heads, batch), one warp per row: lane l reads the column pairs 2l + 64j of the row. Packed
// (varlen) tensors are launched as one batch of all their rows, so rows that belong to no sequence get a dq_accum
// row of zeros too. Named by NVRTC name expressions "flash_bwd_preprocess_kernel<HEAD_DIM>"
// (volta_train/kernels/tiles.py preprocess_variant).
#include "launch_geometry.cuh"
#include "params.cuh"

constexpr int kPreprocessRowsPerCta = 8;  // warps per CTA, one row each (exported as block_m below)

template <int HEAD_DIM>
__global__ void __launch_bounds__(32 * kPreprocessRowsPerCta)
    flash_bwd_preprocess_kernel(const BackwardParams bp, const int rows) {
    static_assert(HEAD_DIM % 2 == 0, "columns are read in pairs");
    constexpr int kPairsPerLane = (HEAD_DIM + 63) / 64;
    const int lane = threadIdx.x & 31;
    const int row = blockIdx.x * kPreprocessRowsPerCta + (threadIdx.x >> 5);
    if (row >= rows) return;  // the whole warp: no shuffle below is left half-done
    const int head = blockIdx.y, batch = blockIdx.z;
    const AttentionParams& p = bp.fwd;
    const half_bits* o_row = p.o + batch * p.o_batch_stride + head * p.o_head_stride + row * p.o_row_stride;
    const half_bits* do_row = bp.dout + batch * bp.do_batch_stride + head * bp.do_head_stride + row * bp.do_row_stride;

    float dot = 0.f;
#pragma unroll
    for (int j = 0; j < kPairsPerLane; ++j) {
        const int col = 2 * lane + 64 * j;
        if (col < HEAD_DIM) {
            const half2_bits o = *reinterpret_cast<const half2_bits*>(o_row + col);
            const half2_bits d = *reinterpret_cast<const half2_bits*>(do_row + col);
            dot += low_half_to_float(d) * low_half_to_float(o) + high_half_to_float(d) * high_half_to_float(o);
        }
    }
    dot = sum_over_warp(dot);
    if (lane == 0)  // the one kernel that writes dsum: the dK/dV and dQ kernels read it through const
        const_cast<float*>(bp.dsum)[batch * p.lse_batch_stride + head * p.lse_head_stride + row] = dot;

    if (bp.dq_accum != nullptr) {  // a uniform branch: the pointer is the same for the whole grid
        float* dq_row = bp.dq_accum + batch * bp.dq_batch_stride + head * bp.dq_head_stride + row * bp.dq_row_stride;
#pragma unroll
        for (int j = 0; j < kPairsPerLane; ++j) {
            const int col = 2 * lane + 64 * j;
            if (col < HEAD_DIM) store_global_f32x2(dq_row + col, 0.f, 0.f);
        }
    }
}

// What the host launches flash_bwd_preprocess_kernel<HEAD_DIM> with (launch_geometry.cuh): no tile, a warp per row.
template <int HEAD_DIM>
__device__ LaunchGeometry flash_bwd_preprocess_kernel_geometry = {0, 32 * kPreprocessRowsPerCta,
                                                                  kPreprocessRowsPerCta, 0};
