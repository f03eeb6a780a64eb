// One CUTLASS Sm70 attention kernel per translation unit: compiled once per instance with -DSM70_INSTANCE=<i>
// (lab/bench_cutlass_sm70.py builds them in parallel), each registering itself with the harness (api.h).
//
// The kernels are CUTLASS example 41's AttentionKernel (kernel_forward.h) and AttentionBackwardKernel
// (kernel_backward.h), included from a CUTLASS source tree at build time, with ArchTag cutlass::arch::Sm70 and the
// template arguments of PyTorch's own sm_70 instantiations (aten/src/ATen/native/transformers/cuda/mem_eff_attention/
// kernels/cutlassF.h and cutlassB.h, functions dispatch_cutlassF_f16_sm70 / dispatch_cutlassB_f16_sm70): what
// F.scaled_dot_product_attention's memory-efficient backend runs on a V100 in fp16. Which of them PyTorch picks for a
// head_dim is decided in harness.cu (select_kernel) from PyTorch's dispatch order; the instances built here are the
// ones that order reaches for head_dim 33-256 with 8-aligned strides on a GPU with the V100's 96 KB of opt-in shared
// memory:
//
//   forward (PyTorch checks kMaxK >= head_dim, alignment, shared memory, in this order; all three fit a V100):
//     0  fmha_cutlassF_f16_aligned_64x64_rf_sm70    <half, Sm70, aligned, 64, 64, kMaxK 64>    head_dim <= 64
//     1  fmha_cutlassF_f16_aligned_32x128_rf_sm70   <half, Sm70, aligned, 32, 128, kMaxK 128>  head_dim 65-128
//     2  fmha_cutlassF_f16_aligned_32x128_gmem_sm70 <half, Sm70, aligned, 32, 128, kMaxK 65536> head_dim > 128: the
//        output accumulates in a float global buffer across value-column iterations ("gmem")
//   backward (PyTorch additionally takes the "seqaligned" kernel first when Nq % kBlockSizeI == 0 and
//   Nk % kBlockSizeJ == 0; the 64x64_k32 pair serves head_dim <= 32, not built here):
//     3  fmha_cutlassB_f16_aligned_64x64_k64_seqaligned_sm70   <Sm70, half, aligned, no dropout, no preload,
//                                                              64, 64, 64, seqaligned>
//     4  fmha_cutlassB_f16_aligned_64x64_k64_sm70              <..., 64, 64, 64>
//     5  fmha_cutlassB_f16_aligned_128x64_k128_seqaligned_sm70 <..., 128, 64, 128, seqaligned>
//     6  fmha_cutlassB_f16_aligned_128x64_k128_sm70            <..., 128, 64, 128>
//     7  fmha_cutlassB_f16_aligned_128x64_k65536_sm70          <..., 128, 64, 65536>: dK/dV accumulate in a float
//        global workspace (kOutputInRF false), delta = rowsum(dO * O) comes from outside the kernel
//   The 128x64 kernels need 50,176 B of shared memory, within the V100's 96 KB, so PyTorch never reaches the
//   64x64_k128 / 64x64_k65536 fallbacks behind them on a V100 (static_assert below).
//
// Differences from PyTorch's build, none of which changes a kernel that runs without dropout: HAS_PYTORCH is not
// defined, so the Philox dropout branches PyTorch compiles into the forward (kSupportsDropout = true, never taken at
// dropout_p = 0) are absent here, and cuRAND is replaced by compat/curand_kernel.h (never called).
//
// -DSM70_FWD_EXAMPLE_FLAGS (never set by the harness) builds the forward instances with CUTLASS example 41's own
// kSupportsDropout = kSupportsBias = false (fused_multihead_attention_fixed_seqlen.cu) instead of PyTorch's true, true:
// the build behind shared/tools/v100model/README.md's CUTLASS figures, which lab/cutlass_sm70_sass.py reproduces.

#include "api.h"

#include "cutlass/version.h"
#include "kernel_backward.h"
#include "kernel_forward.h"

#include <string>

#ifndef SM70_INSTANCE
#error "compile with -DSM70_INSTANCE=<0..7> (lab/bench_cutlass_sm70.py does)"
#endif

namespace {

using half_t = cutlass::half_t;
using Sm70 = cutlass::arch::Sm70;

#define SM70_STR2(x) #x
#define SM70_STR(x) SM70_STR2(x)
const char* const kCutlassVersion = SM70_STR(CUTLASS_MAJOR) "." SM70_STR(CUTLASS_MINOR) "." SM70_STR(CUTLASS_PATCH);

std::string launch_error(const char* what) {
  cudaError_t err = cudaGetLastError();
  if (err == cudaSuccess) return "";
  return std::string(what) + ": " + cudaGetErrorString(err);
}

template <typename AK>
std::string ensure_smem(const void* fn) {
  // Above 48 KB a kernel must opt in (PyTorch does the same when smem_bytes > 0xc000).
  static bool done = false;
  constexpr size_t smem = sizeof(typename AK::SharedStorage);
  if (!done && smem > 0xc000) {
    cudaError_t err = cudaFuncSetAttribute(fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem));
    if (err != cudaSuccess) {
      cudaGetLastError();
      return std::string("cudaFuncSetAttribute(MaxDynamicSharedMemorySize, ") + std::to_string(smem) +
             "): " + cudaGetErrorString(err);
    }
  }
  done = true;
  return "";
}

// ------------------------------------------------------------------------------------------------ forward

template <typename AK>
std::string launch_forward(const sm70h::FwdProblem& pr, cudaStream_t stream) {
  using scalar_t = typename AK::scalar_t;
  typename AK::Params p;
  const int64_t H = pr.heads, D = pr.head_dim;
  p.query_ptr = const_cast<scalar_t*>(static_cast<const scalar_t*>(pr.q));
  p.key_ptr = const_cast<scalar_t*>(static_cast<const scalar_t*>(pr.k));
  p.value_ptr = const_cast<scalar_t*>(static_cast<const scalar_t*>(pr.v));
  p.output_ptr = static_cast<typename AK::output_t*>(pr.out);
  p.output_accum_ptr = AK::kNeedsOutputAccumulatorBuffer ? pr.out_accum : nullptr;
  p.logsumexp_ptr = pr.lse;
  p.scale = pr.scale;
  p.head_dim = pr.head_dim;
  p.head_dim_value = pr.head_dim;
  p.num_queries = pr.seqlen_q;
  p.num_keys = pr.seqlen_k;
  p.num_batches = pr.batch;
  p.num_heads = pr.heads;
  p.custom_mask_type = pr.causal ? AK::CausalFromTopLeft : AK::NoCustomMask;
  p.q_strideM = int32_t(H * D);
  p.k_strideM = int32_t(H * D);
  p.v_strideM = int32_t(H * D);
  p.o_strideM = int32_t(H * D);
  p.q_strideH = int32_t(D);
  p.k_strideH = int32_t(D);
  p.v_strideH = int32_t(D);
  p.q_strideB = int64_t(pr.seqlen_q) * H * D;
  p.k_strideB = int64_t(pr.seqlen_k) * H * D;
  p.v_strideB = int64_t(pr.seqlen_k) * H * D;
  p.use_dropout = false;
  if (AK::kNeedsOutputAccumulatorBuffer && pr.out_accum == nullptr) return "this kernel needs out_accum";
  if (pr.lse != nullptr && pr.lse_len % AK::kAlignLSE != 0) return "lse_len is not a multiple of kAlignLSE";
  if (!AK::check_supported(p)) return "AttentionKernel::check_supported refused the problem (see stderr)";
  constexpr auto kernel_fn = attention_kernel_batched_impl<AK>;
  std::string err = ensure_smem<AK>((const void*)kernel_fn);
  if (!err.empty()) return err;
  constexpr int smem = int(sizeof(typename AK::SharedStorage));
  kernel_fn<<<p.getBlocksGrid(), p.getThreadsGrid(), smem, stream>>>(p);
  return launch_error("forward launch");
}

template <typename AK>
sm70h::KernelInfo forward_info(const char* name, const char* args, int order) {
  static_assert(cutlass::platform::is_same<typename AK::scalar_t, half_t>::value, "fp16 kernels only");
  static_assert(sizeof(typename AK::SharedStorage) <= sm70h::kV100SmemOptinBytes,
                "PyTorch would skip this kernel on a V100 (shared memory); the harness's dispatch would be wrong");
  sm70h::KernelInfo info;
  info.name = name;
  info.template_args = args;
  info.cutlass_version = kCutlassVersion;
  info.pass = sm70h::Pass::Forward;
  info.order = order;
  info.block_q = AK::kQueriesPerBlock;
  info.block_k = AK::kKeysPerBlock;
  info.max_k = AK::kMaxK;
  info.threads = int(AK::kNumThreads);
  info.min_blocks_per_sm = int(AK::kMinBlocksPerSm);
  info.smem_bytes = sizeof(typename AK::SharedStorage);
  info.needs_out_accum = AK::kNeedsOutputAccumulatorBuffer;
  info.lse_align = AK::kAlignLSE;
  info.kernel_fn = (const void*)attention_kernel_batched_impl<AK>;
  info.launch_fwd = &launch_forward<AK>;
  return info;
}

// ------------------------------------------------------------------------------------------------ backward

template <typename AK>
void fill_backward_params(const sm70h::BwdProblem& pr, typename AK::Params& p) {
  using scalar_t = typename AK::scalar_t;
  const int64_t H = pr.heads, D = pr.head_dim;
  p.query_ptr = const_cast<scalar_t*>(static_cast<const scalar_t*>(pr.q));
  p.key_ptr = const_cast<scalar_t*>(static_cast<const scalar_t*>(pr.k));
  p.value_ptr = const_cast<scalar_t*>(static_cast<const scalar_t*>(pr.v));
  p.logsumexp_ptr = const_cast<float*>(pr.lse);
  p.output_ptr = const_cast<scalar_t*>(static_cast<const scalar_t*>(pr.out));
  p.grad_output_ptr = const_cast<scalar_t*>(static_cast<const scalar_t*>(pr.dout));
  p.delta_ptr = pr.delta;
  p.grad_query_ptr = static_cast<scalar_t*>(pr.dq);
  p.grad_key_ptr = static_cast<scalar_t*>(pr.dk);
  p.grad_value_ptr = static_cast<scalar_t*>(pr.dv);
  p.workspace = pr.workspace;
  p.scale = pr.scale;
  p.head_dim = pr.head_dim;
  p.head_dim_value = pr.head_dim;
  p.num_queries = pr.seqlen_q;
  p.num_keys = pr.seqlen_k;
  p.num_heads = pr.heads;
  p.num_batches = pr.batch;
  p.custom_mask_type = pr.causal ? AK::CausalFromTopLeft : AK::NoCustomMask;
  p.num_splits_key = int16_t(pr.num_splits);
  p.gQKV_strideM_multiplier = 1;
  // strides in elements, [B, N, H, D]
  p.q_strideM = int32_t(H * D);
  p.k_strideM = int32_t(H * D);
  p.v_strideM = int32_t(H * D);
  p.gO_strideM = int32_t(H * D);
  p.q_strideH = int32_t(D);
  p.k_strideH = int32_t(D);
  p.v_strideH = int32_t(D);
  p.o_strideH = D;
  p.gO_strideH = D;
  p.gQ_strideH = D;
  p.gK_strideH = D;
  p.gV_strideH = D;
  p.q_strideB = int64_t(pr.seqlen_q) * H * D;
  p.o_strideB = int64_t(pr.seqlen_q) * H * D;
  p.gO_strideB = int64_t(pr.seqlen_q) * H * D;
  p.gQ_strideB = int64_t(pr.seqlen_q) * H * D;
  p.k_strideB = int64_t(pr.seqlen_k) * H * D;
  p.v_strideB = int64_t(pr.seqlen_k) * H * D;
  p.gK_strideB = int64_t(pr.seqlen_k) * H * D;
  p.gV_strideB = int64_t(pr.seqlen_k) * H * D;
  p.lse_strideH = pr.lse_len;
  p.lse_strideB = int64_t(pr.lse_len) * H;
  p.delta_strideH = pr.seqlen_q;
  p.delta_strideB = int64_t(pr.seqlen_q) * H;
  p.dropout_prob = 0.f;
}

template <typename AK>
size_t backward_workspace_bytes(const sm70h::BwdProblem& pr) {
  typename AK::Params p;
  fill_backward_params<AK>(pr, p);
  return size_t(p.workspace_size());
}

template <typename AK>
bool backward_zero_workspace(const sm70h::BwdProblem& pr) {
  typename AK::Params p;
  fill_backward_params<AK>(pr, p);
  return p.workspace_size() > 0 && p.should_zero_workspace();
}

template <typename AK>
std::string launch_backward(const sm70h::BwdProblem& pr, cudaStream_t stream) {
  typename AK::Params p;
  fill_backward_params<AK>(pr, p);
  if (p.workspace_size() > 0 && pr.workspace == nullptr) return "this problem needs a workspace";
  if (!AK::check_supported(p)) return "AttentionBackwardKernel::check_supported refused the problem (see stderr)";
  constexpr auto kernel_fn = attention_kernel_backward_batched_impl<AK>;
  std::string err = ensure_smem<AK>((const void*)kernel_fn);
  if (!err.empty()) return err;
  constexpr int smem = int(sizeof(typename AK::SharedStorage));
  kernel_fn<<<p.getBlocksGrid(), p.getThreadsGrid(), smem, stream>>>(p);
  return launch_error("backward launch");
}

template <typename AK>
sm70h::KernelInfo backward_info(const char* name, const char* args, int order) {
  static_assert(cutlass::platform::is_same<typename AK::scalar_t, half_t>::value, "fp16 kernels only");
  static_assert(!AK::kApplyDropout, "compat/curand_kernel.h stands in for cuRAND only while no kernel uses dropout");
  static_assert(AK::kEnableSplitKeys, "PyTorch's instances all allow key splits");
  static_assert(sizeof(typename AK::SharedStorage) <= sm70h::kV100SmemOptinBytes,
                "PyTorch would skip this kernel on a V100 (shared memory); the harness's dispatch would be wrong");
  sm70h::KernelInfo info;
  info.name = name;
  info.template_args = args;
  info.cutlass_version = kCutlassVersion;
  info.pass = sm70h::Pass::Backward;
  info.order = order;
  info.block_q = AK::kBlockSizeI;
  info.block_k = AK::kBlockSizeJ;
  info.max_k = AK::kMaxK;
  info.seq_aligned = AK::kKeysQueriesAlignedToBlockSize;
  info.threads = int(AK::kNumThreads);
  info.min_blocks_per_sm = int(AK::kMinBlocksPerSm);
  info.smem_bytes = sizeof(typename AK::SharedStorage);
  info.kernel_computes_delta = AK::kKernelComputesDelta;
  info.needs_accum_grad_kv = AK::kNeedsAccumGradK || AK::kNeedsAccumGradV;
  info.kernel_fn = (const void*)attention_kernel_backward_batched_impl<AK>;
  info.launch_bwd = &launch_backward<AK>;
  info.bwd_workspace_bytes = &backward_workspace_bytes<AK>;
  info.bwd_zero_workspace = &backward_zero_workspace<AK>;
  return info;
}

#ifdef SM70_FWD_EXAMPLE_FLAGS
#define SM70_FWD_DROPOUT false
#define SM70_FWD_BIAS false
#else
#define SM70_FWD_DROPOUT true
#define SM70_FWD_BIAS true
#endif

#define SM70_FORWARD(NAME, ORDER, Q, K, MAXK)                                                      \
  using Kernel = AttentionKernel<half_t, Sm70, true, Q, K, MAXK, SM70_FWD_DROPOUT, SM70_FWD_BIAS>; \
  const sm70h::Registrar registrar(forward_info<Kernel>(                                           \
      NAME, "AttentionKernel<half_t, Sm70, isAligned=true, " #Q ", " #K ", kMaxK=" #MAXK           \
            ", kSupportsDropout=" SM70_STR(SM70_FWD_DROPOUT) ", kSupportsBias=" SM70_STR(SM70_FWD_BIAS) ">",  \
      ORDER));

#define SM70_BACKWARD(NAME, ORDER, I, J, MAXK, SEQALIGNED)                                        \
  using Kernel = AttentionBackwardKernel<Sm70, half_t, true, false, false, I, J, MAXK, SEQALIGNED>; \
  const sm70h::Registrar registrar(backward_info<Kernel>(                                          \
      NAME, "AttentionBackwardKernel<Sm70, half_t, kIsAligned=true, kApplyDropout=false, kPreload=false, " #I \
            ", " #J ", kMaxK=" #MAXK ", kKeysQueriesAlignedToBlockSize=" #SEQALIGNED ">", ORDER));

#if SM70_INSTANCE == 0
SM70_FORWARD("fmha_cutlassF_f16_aligned_64x64_rf_sm70", 0, 64, 64, 64)
#elif SM70_INSTANCE == 1
SM70_FORWARD("fmha_cutlassF_f16_aligned_32x128_rf_sm70", 1, 32, 128, 128)
#elif SM70_INSTANCE == 2
SM70_FORWARD("fmha_cutlassF_f16_aligned_32x128_gmem_sm70", 2, 32, 128, 65536)
#elif SM70_INSTANCE == 3
SM70_BACKWARD("fmha_cutlassB_f16_aligned_64x64_k64_seqaligned_sm70", 2, 64, 64, 64, true)
#elif SM70_INSTANCE == 4
SM70_BACKWARD("fmha_cutlassB_f16_aligned_64x64_k64_sm70", 3, 64, 64, 64, false)
#elif SM70_INSTANCE == 5
SM70_BACKWARD("fmha_cutlassB_f16_aligned_128x64_k128_seqaligned_sm70", 4, 128, 64, 128, true)
#elif SM70_INSTANCE == 6
SM70_BACKWARD("fmha_cutlassB_f16_aligned_128x64_k128_sm70", 5, 128, 64, 128, false)
#elif SM70_INSTANCE == 7
SM70_BACKWARD("fmha_cutlassB_f16_aligned_128x64_k65536_sm70", 8, 128, 64, 65536, false)
#else
#error "SM70_INSTANCE must be 0..7"
#endif

}  // namespace
