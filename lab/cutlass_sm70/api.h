// Interface between the harness (harness.cu: command line, data, timing, reference, JSON) and the CUTLASS kernel
// instances (instance.cu, one kernel per translation unit so that a build runs them in parallel). Plain C++ and the
// CUDA runtime only: harness.cu does not include CUTLASS.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace sm70h {

// What PyTorch compares a kernel's shared memory with before it picks it (attention.cu / attention_backward.cu:
// `sizeof(Kernel::SharedStorage) > p->sharedMemPerBlockOptin` skips the kernel). A V100 reports 98,304 bytes (96 KB).
constexpr size_t kV100SmemOptinBytes = 98304;

// All tensors are dense in the flash-attn layout [batch, seqlen, heads, head_dim], fp16 (Q, K, V, O, dO, dQ, dK, dV);
// logsumexp is float [batch, heads, lse_len] (lse_len = seqlen_q rounded up to the forward's kAlignLSE), delta is
// float [batch, heads, seqlen_q]. Causal means PyTorch's is_causal: key j is masked for query i when j > i
// (CutlassKernel CausalFromTopLeft).
struct FwdProblem {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;        // nullptr: no logsumexp (inference, as SDPA without grad)
  float* out_accum = nullptr;  // float [B, Nq, H, D]; needed where KernelInfo::needs_out_accum
  int batch = 0, heads = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0, lse_len = 0;
  bool causal = false;
  float scale = 0.f;
};

struct BwdProblem {
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  const void* out = nullptr;
  const void* dout = nullptr;
  const float* lse = nullptr;
  float* delta = nullptr;      // written by the kernel where kernel_computes_delta, else an input
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* workspace = nullptr;  // bwd_workspace_bytes() bytes, zeroed when bwd_zero_workspace()
  int batch = 0, heads = 0, seqlen_q = 0, seqlen_k = 0, head_dim = 0, lse_len = 0;
  int num_splits = 1;          // num_splits_key
  bool causal = false;
  float scale = 0.f;
};

enum class Pass { Forward, Backward };

struct KernelInfo {
  std::string name;               // PyTorch's name of the same instantiation (kernels/cutlassF.h, cutlassB.h)
  std::string template_args;      // the CUTLASS template arguments, for the report
  std::string cutlass_version;    // CUTLASS_MAJOR.MINOR.PATCH of the headers it was built from
  Pass pass = Pass::Forward;
  int order = 0;                  // position in PyTorch's sm_70 dispatch list (dispatch_cutlass{F,B}_f16_sm70)
  int block_q = 0, block_k = 0;   // fwd kQueriesPerBlock x kKeysPerBlock, bwd kBlockSizeI x kBlockSizeJ
  int max_k = 0;                  // kMaxK (65536 for the unbounded "gmem" / k65536 variants)
  bool seq_aligned = false;       // bwd kKeysQueriesAlignedToBlockSize: Nq % block_q == 0 and Nk % block_k == 0
  int threads = 0, min_blocks_per_sm = 0;
  size_t smem_bytes = 0;          // sizeof(Kernel::SharedStorage): dynamic shared memory per block
  bool needs_out_accum = false;   // fwd kNeedsOutputAccumulatorBuffer
  int lse_align = 1;              // fwd kAlignLSE
  bool kernel_computes_delta = false;  // bwd kKernelComputesDelta
  bool needs_accum_grad_kv = false;    // bwd kNeedsAccumGradK || kNeedsAccumGradV (PyTorch's split heuristic uses it)
  const void* kernel_fn = nullptr;     // for cudaFuncGetAttributes / occupancy
  // Returns "" on success, else what failed (check_supported, launch error).
  std::string (*launch_fwd)(const FwdProblem&, cudaStream_t) = nullptr;
  std::string (*launch_bwd)(const BwdProblem&, cudaStream_t) = nullptr;
  size_t (*bwd_workspace_bytes)(const BwdProblem&) = nullptr;
  bool (*bwd_zero_workspace)(const BwdProblem&) = nullptr;
};

std::vector<KernelInfo>& registry();

struct Registrar {
  explicit Registrar(KernelInfo info) { registry().push_back(std::move(info)); }
};

}  // namespace sm70h
