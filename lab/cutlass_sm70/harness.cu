// Timing and correctness harness for the CUTLASS "Sm70" memory-efficient attention kernels (CUTLASS example 41,
// ArchTag cutlass::arch::Sm70: what PyTorch's SDPA memory-efficient backend runs on a V100), built for sm_90 so that
// they run on an H100 (m8n8k4 emulated) next to volta_train's own Volta build. Built and driven by
// lab/bench_cutlass_sm70.py; the kernels themselves are instantiated in instance.cu (api.h is the interface).
//
//   harness [options] [--case SPEC]... [--spec FILE]     one JSON line per case on stdout, progress on stderr
//   harness --check                                       every built kernel on small odd shapes, verified
//   harness --list                                        the built kernels and their resources
//
// A case SPEC is comma-separated key=value pairs (a spec FILE holds one per line, '#' starts a comment):
//   pass=fwd|bwd b=BATCH h=HEADS nq=SEQLEN_Q nk=SEQLEN_K d=HEAD_DIM causal=0|1 tag=LABEL
//   kernel=NAME   force a built kernel instead of PyTorch's choice (the check suite does)
//   splits=LIST   backward key splits to time, '+'-separated integers, ranges a-b and 'pt' (PyTorch's heuristic);
//                 default 1-8+pt; values above ceil(nk / kBlockSizeJ) are dropped
//   time=0|1      0: run once and verify only
//
// Inputs are fp16 [B, N, H, D] (the flash-attn layout, contiguous), approximately N(0, 1); softmax scale 1/sqrt(D).
// Kernel choice (select_kernel): PyTorch's dispatch on sm_70 (dispatch_cutlassF/B_f16_sm70 walked in order, the first
// kernel with kMaxK >= head_dim, its alignment and, for "seqaligned" backward kernels, Nq % kBlockSizeI == 0 and
// Nk % kBlockSizeJ == 0, and sizeof(SharedStorage) <= the V100's 96 KB of opt-in shared memory). A kernel that a V100
// could not run is never chosen; one that PyTorch would choose but that is not built is an error for the case.
//
// Timing: median of --repeats CUDA-event timings of single calls (each synchronised) after --warmup calls, cycling
// through enough input sets to exceed twice the L2 cache (--input-sets). A forward call is the kernel alone, without
// logsumexp (SDPA without grad). A backward call is what PyTorch's _efficient_attention_backward launches: delta =
// rowsum(dO * O) where the kernel does not compute it (the k65536 kernel on sm_70; here one fused kernel, PyTorch uses
// several elementwise ops), the zeroing of the workspace when num_splits_key > 1, and the kernel.
// FLOPs: forward 4*B*H*Nq*Nk*D, half of it under causal when Nq == Nk; backward 2.5x that.
// Backward key splits: every requested num_splits_key is timed; "ms" is the best of the integer splits, "ms_split1"
// the unsplit kernel, "ms_pytorch_split" PyTorch's heuristic (attention_backward.cu: ceil(Nk / kBlockSizeJ), 1 when
// B*H >= 256 and Nk <= 2*kBlockSizeJ, at most 200 / (B*H) for kernels that stage dK/dV in a float workspace).
//
// Correctness (unless --no-verify): on batch 0 and the first --verify-heads heads of every case, the output (fwd) or
// dQ, dK, dV (bwd, every split timed) are compared with an fp32 reference computed on the GPU by naive kernels below.
// A case fails if max |x - ref| > --tol * max(1, max |ref|), ||x - ref|| / ||ref|| > --tol, or anything is not
// finite; the exit status is then 1.
//
// Exit status: 0 all cases ran and verified, 1 a case failed or could not run, 2 usage, 3 a CUDA error that leaves the
// context unusable (the remaining cases are not run).

#include "api.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#ifndef SM70_INSTANCE_COUNT
#error "compile with -DSM70_INSTANCE_COUNT=<number of instance.cu objects linked> (lab/bench_cutlass_sm70.py does)"
#endif

namespace sm70h {

std::vector<KernelInfo>& registry() {
  static std::vector<KernelInfo> kernels;
  return kernels;
}

}  // namespace sm70h

namespace {

using sm70h::BwdProblem;
using sm70h::FwdProblem;
using sm70h::KernelInfo;
using sm70h::Pass;

// ------------------------------------------------------------------------------------------------ errors, JSON

struct UsageError : std::runtime_error {
  using std::runtime_error::runtime_error;
};
struct CaseError : std::runtime_error {  // this case cannot run (no kernel, out of memory, launch refused)
  using std::runtime_error::runtime_error;
};
struct FatalCudaError : std::runtime_error {  // the context is unusable
  using std::runtime_error::runtime_error;
};

bool is_sticky(cudaError_t err) {
  switch (err) {
    case cudaErrorIllegalAddress:
    case cudaErrorLaunchFailure:
    case cudaErrorMisalignedAddress:
    case cudaErrorIllegalInstruction:
    case cudaErrorInvalidPc:
    case cudaErrorHardwareStackError:
    case cudaErrorAssert:
    case cudaErrorLaunchTimeout:
    case cudaErrorECCUncorrectable:
      return true;
    default:
      return false;
  }
}

void cuda_check(cudaError_t err, const char* what) {
  if (err == cudaSuccess) return;
  cudaGetLastError();  // clear a non-sticky error
  std::string msg = std::string(what) + ": " + cudaGetErrorName(err) + " (" + cudaGetErrorString(err) + ")";
  if (is_sticky(err)) throw FatalCudaError(msg);
  throw CaseError(msg);
}
#define CUDA_CHECK(call) cuda_check((call), #call)

std::string json_escape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\t': out += "\\t"; break;
      default:
        if (static_cast<unsigned char>(c) < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof(buf), "\\u%04x", c);
          out += buf;
        } else {
          out += c;
        }
    }
  }
  return out;
}

class Json {  // one flat-ish JSON object, keys in insertion order
 public:
  Json& str(const std::string& k, const std::string& v) { return raw(k, "\"" + json_escape(v) + "\""); }
  Json& num(const std::string& k, double v) {
    if (!std::isfinite(v)) return raw(k, "null");
    char buf[32];
    std::snprintf(buf, sizeof(buf), "%.6g", v);
    return raw(k, buf);
  }
  Json& integer(const std::string& k, long long v) { return raw(k, std::to_string(v)); }
  Json& boolean(const std::string& k, bool v) { return raw(k, v ? "true" : "false"); }
  Json& raw(const std::string& k, const std::string& v) {
    body_ += (body_.empty() ? "" : ", ") + ("\"" + json_escape(k) + "\": ") + v;
    return *this;
  }
  std::string text() const { return "{" + body_ + "}"; }

 private:
  std::string body_;
};

void emit(const Json& j) {
  std::printf("%s\n", j.text().c_str());
  std::fflush(stdout);
}

void progress(const char* fmt, ...) {
  va_list args;
  va_start(args, fmt);
  std::vfprintf(stderr, fmt, args);
  va_end(args);
  std::fputc('\n', stderr);
  std::fflush(stderr);
}

// ------------------------------------------------------------------------------------------------ device memory

class DevBuf {
 public:
  DevBuf() = default;
  explicit DevBuf(size_t bytes) { alloc(bytes); }
  DevBuf(const DevBuf&) = delete;
  DevBuf& operator=(const DevBuf&) = delete;
  DevBuf(DevBuf&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; o.bytes_ = 0; }
  DevBuf& operator=(DevBuf&& o) noexcept {
    if (this != &o) {
      release();
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
      o.bytes_ = 0;
    }
    return *this;
  }
  ~DevBuf() { release(); }
  void alloc(size_t bytes) {
    release();
    if (bytes == 0) return;
    cudaError_t err = cudaMalloc(&ptr_, bytes);
    if (err != cudaSuccess) {
      ptr_ = nullptr;
      cudaGetLastError();
      char buf[160];
      std::snprintf(buf, sizeof(buf), "cudaMalloc(%.3f GiB): %s", bytes / 1073741824.0, cudaGetErrorString(err));
      if (is_sticky(err)) throw FatalCudaError(buf);
      throw CaseError(buf);
    }
    bytes_ = bytes;
  }
  template <typename T = void>
  T* get() const { return static_cast<T*>(ptr_); }
  size_t bytes() const { return bytes_; }

 private:
  void release() {
    if (ptr_) cudaFree(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// ------------------------------------------------------------------------------------------------ kernels of our own

__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  return x ^ (x >> 31);
}

// Approximately N(0, 1): the sum of four 16-bit uniforms (Irwin-Hall), centred and scaled to unit variance.
__global__ void fill_normalish(__half* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    uint64_t h = splitmix64(seed * 0x100000001b3ull + i);
    float s = 0.f;
    for (int k = 0; k < 4; ++k) s += float((h >> (16 * k)) & 0xffff) * (1.f / 65536.f);
    p[i] = __float2half((s - 2.f) * 1.7320508f);
  }
}

// delta[b, h, i] = sum_d dO[b, i, h, d] * O[b, i, h, d] in fp32: one warp per row (what PyTorch computes with
// elementwise ops when the kernel does not, kKernelComputesDelta == false).
__global__ void row_dot_delta(const __half* dout, const __half* out, float* delta, int B, int N, int H, int D) {
  const size_t rows = size_t(B) * N * H;
  const size_t warps = size_t(gridDim.x) * blockDim.x / 32;
  const int lane = threadIdx.x % 32;
  for (size_t row = (blockIdx.x * size_t(blockDim.x) + threadIdx.x) / 32; row < rows; row += warps) {
    const __half* a = dout + row * D;
    const __half* o = out + row * D;
    float acc = 0.f;
    for (int d = lane; d < D; d += 32) acc += __half2float(a[d]) * __half2float(o[d]);
    for (int off = 16; off > 0; off /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (lane == 0) {
      const size_t h = row % H, i = (row / H) % N, b = row / (size_t(H) * N);
      delta[(b * H + h) * N + i] = acc;
    }
  }
}

// ---- fp32 reference on batch `b`, heads [h0, h0 + nh) of [B, N, H, D] fp16 tensors; results are [nh, N, D] or
// [nh, Nq, Nk]. Naive on purpose: one thread per output element.

__device__ __forceinline__ size_t at(int b, int n, int h, int d, int N, int H, int D) {
  return ((size_t(b) * N + n) * H + h) * D + d;
}

#define GRID_STRIDE(i, total) \
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < (total); i += size_t(gridDim.x) * blockDim.x)

__global__ void ref_scores(const __half* q, const __half* k, float* s, int Nq, int Nk, int H, int D, int b, int h0,
                           int nh, float scale, int causal) {
  GRID_STRIDE(idx, size_t(nh) * Nq * Nk) {
    const int j = int(idx % Nk), i = int((idx / Nk) % Nq), hh = int(idx / (size_t(Nk) * Nq));
    const __half* qi = q + at(b, i, h0 + hh, 0, Nq, H, D);
    const __half* kj = k + at(b, j, h0 + hh, 0, Nk, H, D);
    float acc = 0.f;
    for (int d = 0; d < D; ++d) acc += __half2float(qi[d]) * __half2float(kj[d]);
    s[idx] = (causal && j > i) ? -INFINITY : acc * scale;
  }
}

__global__ void ref_softmax(float* s, float* lse, int rows, int Nk) {  // in place: scores -> probabilities
  GRID_STRIDE(r, size_t(rows)) {
    float* row = s + r * Nk;
    float m = -INFINITY;
    for (int j = 0; j < Nk; ++j) m = fmaxf(m, row[j]);
    float l = 0.f;
    for (int j = 0; j < Nk; ++j) l += (row[j] == -INFINITY) ? 0.f : expf(row[j] - m);
    for (int j = 0; j < Nk; ++j) row[j] = (row[j] == -INFINITY) ? 0.f : expf(row[j] - m) / l;
    lse[r] = m + logf(l);
  }
}

__global__ void ref_pv(const float* p, const __half* v, float* o, int Nq, int Nk, int H, int D, int b, int h0, int nh) {
  GRID_STRIDE(idx, size_t(nh) * Nq * D) {
    const int d = int(idx % D), i = int((idx / D) % Nq), hh = int(idx / (size_t(D) * Nq));
    const float* pi = p + (size_t(hh) * Nq + i) * Nk;
    float acc = 0.f;
    for (int j = 0; j < Nk; ++j) acc += pi[j] * __half2float(v[at(b, j, h0 + hh, d, Nk, H, D)]);
    o[idx] = acc;
  }
}

__global__ void ref_delta(const __half* dout, const float* o_ref, float* delta, int Nq, int H, int D, int b, int h0,
                          int nh) {
  GRID_STRIDE(r, size_t(nh) * Nq) {
    const int i = int(r % Nq), hh = int(r / Nq);
    float acc = 0.f;
    for (int d = 0; d < D; ++d) acc += __half2float(dout[at(b, i, h0 + hh, d, Nq, H, D)]) * o_ref[r * D + d];
    delta[r] = acc;
  }
}

__global__ void ref_ds(const float* p, const __half* dout, const __half* v, const float* delta, float* ds, int Nq,
                       int Nk, int H, int D, int b, int h0, int nh) {
  GRID_STRIDE(idx, size_t(nh) * Nq * Nk) {
    const int j = int(idx % Nk), i = int((idx / Nk) % Nq), hh = int(idx / (size_t(Nk) * Nq));
    const __half* gi = dout + at(b, i, h0 + hh, 0, Nq, H, D);
    const __half* vj = v + at(b, j, h0 + hh, 0, Nk, H, D);
    float dp = 0.f;
    for (int d = 0; d < D; ++d) dp += __half2float(gi[d]) * __half2float(vj[d]);
    ds[idx] = p[idx] * (dp - delta[size_t(hh) * Nq + i]);
  }
}

// dQ = scale * dS K
__global__ void ref_dq(const float* ds, const __half* k, float* dq, int Nq, int Nk, int H, int D, int b, int h0, int nh,
                       float scale) {
  GRID_STRIDE(idx, size_t(nh) * Nq * D) {
    const int d = int(idx % D), i = int((idx / D) % Nq), hh = int(idx / (size_t(D) * Nq));
    const float* row = ds + (size_t(hh) * Nq + i) * Nk;
    float acc = 0.f;
    for (int j = 0; j < Nk; ++j) acc += row[j] * __half2float(k[at(b, j, h0 + hh, d, Nk, H, D)]);
    dq[idx] = acc * scale;
  }
}

// dK = scale * dS^T Q (mode 0), dV = P^T dO (mode 1): out[hh, j, d] = f * sum_i m[hh, i, j] * x[b, i, h, d]
__global__ void ref_t_mm(const float* m, const __half* x, float* out, int Nq, int Nk, int H, int D, int b, int h0,
                         int nh, float f) {
  GRID_STRIDE(idx, size_t(nh) * Nk * D) {
    const int d = int(idx % D), j = int((idx / D) % Nk), hh = int(idx / (size_t(D) * Nk));
    const float* col = m + size_t(hh) * Nq * Nk + j;
    float acc = 0.f;
    for (int i = 0; i < Nq; ++i) acc += col[size_t(i) * Nk] * __half2float(x[at(b, i, h0 + hh, d, Nq, H, D)]);
    out[idx] = acc * f;
  }
}

int grid_for(size_t total, int threads = 256) {
  size_t blocks = (total + threads - 1) / threads;
  return int(std::max<size_t>(1, std::min<size_t>(blocks, 65535u * 16)));
}

// ------------------------------------------------------------------------------------------------ options, cases

struct Options {
  int warmup = 3, repeats = 10, bwd_warmup = 2, bwd_repeats = 5;
  int input_sets = 0;  // 0: auto
  bool verify = true;
  int verify_heads = 2;
  double tol = 2e-2;
  int device = 0;
  uint64_t seed = 1234;
  bool check = false, list = false;
};

struct Case {
  std::string pass = "fwd", tag, kernel, splits = "1-8+pt";
  int b = 0, h = 0, nq = 0, nk = 0, d = 0;
  bool causal = false, time = true;
  std::string spec;  // as given
};

int parse_int(const std::string& key, const std::string& value, int lo, int hi) {
  char* end = nullptr;
  long v = std::strtol(value.c_str(), &end, 10);
  if (value.empty() || *end != '\0' || v < lo || v > hi)
    throw UsageError(key + "=" + value + ": expected an integer in [" + std::to_string(lo) + ", " +
                     std::to_string(hi) + "]");
  return int(v);
}

bool parse_bool(const std::string& key, const std::string& value) {
  if (value == "1" || value == "true") return true;
  if (value == "0" || value == "false") return false;
  throw UsageError(key + "=" + value + ": expected 0, 1, true or false");
}

Case parse_case(const std::string& spec) {
  Case c;
  c.spec = spec;
  std::stringstream ss(spec);
  std::string item;
  while (std::getline(ss, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t\r") + 1);
    if (item.empty()) continue;
    size_t eq = item.find('=');
    if (eq == std::string::npos) throw UsageError("case '" + spec + "': '" + item + "' is not key=value");
    std::string k = item.substr(0, eq), v = item.substr(eq + 1);
    if (k == "pass") {
      if (v != "fwd" && v != "bwd") throw UsageError("pass=" + v + ": expected fwd or bwd");
      c.pass = v;
    } else if (k == "b") {
      c.b = parse_int(k, v, 1, 1 << 20);
    } else if (k == "h") {
      c.h = parse_int(k, v, 1, 1 << 16);
    } else if (k == "nq") {
      c.nq = parse_int(k, v, 1, 1 << 24);
    } else if (k == "nk") {
      c.nk = parse_int(k, v, 1, 1 << 24);
    } else if (k == "n") {
      c.nq = c.nk = parse_int(k, v, 1, 1 << 24);
    } else if (k == "d") {
      c.d = parse_int(k, v, 1, 65536);
    } else if (k == "causal") {
      c.causal = parse_bool(k, v);
    } else if (k == "time") {
      c.time = parse_bool(k, v);
    } else if (k == "tag") {
      c.tag = v;
    } else if (k == "kernel") {
      c.kernel = v;
    } else if (k == "splits") {
      c.splits = v;
    } else {
      throw UsageError("case '" + spec + "': unknown key '" + k +
                       "' (accepted: pass, b, h, nq, nk, n, d, causal, tag, kernel, splits, time)");
    }
  }
  if (c.b == 0 || c.h == 0 || c.nq == 0 || c.nk == 0 || c.d == 0)
    throw UsageError("case '" + spec + "': b, h, nq (or n), nk (or n) and d are required");
  return c;
}

// splits=1-8+pt -> integers (sorted, unique) and whether PyTorch's heuristic is wanted
void parse_splits(const std::string& text, std::vector<int>& ints, bool& pytorch) {
  ints.clear();
  pytorch = false;
  std::stringstream ss(text);
  std::string tok;
  while (std::getline(ss, tok, '+')) {
    if (tok == "pt") {
      pytorch = true;
      continue;
    }
    size_t dash = tok.find('-');
    if (dash == std::string::npos) {
      ints.push_back(parse_int("splits", tok, 1, 32767));
    } else {
      int lo = parse_int("splits", tok.substr(0, dash), 1, 32767);
      int hi = parse_int("splits", tok.substr(dash + 1), lo, 32767);
      for (int s = lo; s <= hi; ++s) ints.push_back(s);
    }
  }
  std::sort(ints.begin(), ints.end());
  ints.erase(std::unique(ints.begin(), ints.end()), ints.end());
  if (ints.empty() && !pytorch) throw UsageError("splits=" + text + ": no split given");
}

// ------------------------------------------------------------------------------------------------ kernel choice

// PyTorch's dispatch order for fp16 on sm_70 (aligned kernels; dispatch_cutlassF_f16_sm70 and
// dispatch_cutlassB_f16_sm70 in mem_eff_attention/kernels/cutlassF.h, cutlassB.h).
struct Entry {
  const char* name;
  int max_k;
  bool seq_aligned;
  int block_q, block_k;
};
const Entry kForwardOrder[] = {
    {"fmha_cutlassF_f16_aligned_64x64_rf_sm70", 64, false, 64, 64},
    {"fmha_cutlassF_f16_aligned_32x128_rf_sm70", 128, false, 32, 128},
    {"fmha_cutlassF_f16_aligned_32x128_gmem_sm70", 65536, false, 32, 128},
};
const Entry kBackwardOrder[] = {
    {"fmha_cutlassB_f16_aligned_64x64_k32_seqaligned_sm70", 32, true, 64, 64},
    {"fmha_cutlassB_f16_aligned_64x64_k32_sm70", 32, false, 64, 64},
    {"fmha_cutlassB_f16_aligned_64x64_k64_seqaligned_sm70", 64, true, 64, 64},
    {"fmha_cutlassB_f16_aligned_64x64_k64_sm70", 64, false, 64, 64},
    {"fmha_cutlassB_f16_aligned_128x64_k128_seqaligned_sm70", 128, true, 128, 64},
    {"fmha_cutlassB_f16_aligned_128x64_k128_sm70", 128, false, 128, 64},
    {"fmha_cutlassB_f16_aligned_64x64_k128_seqaligned_sm70", 128, true, 64, 64},
    {"fmha_cutlassB_f16_aligned_64x64_k128_sm70", 128, false, 64, 64},
    {"fmha_cutlassB_f16_aligned_128x64_k65536_sm70", 65536, false, 128, 64},
    {"fmha_cutlassB_f16_aligned_64x64_k65536_sm70", 65536, false, 64, 64},
};

const KernelInfo* find_kernel(const std::string& name) {
  for (const KernelInfo& k : sm70h::registry())
    if (k.name == name) return &k;
  return nullptr;
}

std::string eligibility(const Case& c, int max_k, bool seq_aligned, int block_q, int block_k) {
  if (c.d > max_k) return "kMaxK " + std::to_string(max_k) + " < head_dim " + std::to_string(c.d);
  if (seq_aligned && (c.nq % block_q != 0 || c.nk % block_k != 0))
    return "seqaligned kernel needs Nq % " + std::to_string(block_q) + " == 0 and Nk % " + std::to_string(block_k) +
           " == 0";
  return "";
}

// The kernel PyTorch runs for this case on a V100; throws CaseError when none or an unbuilt one would be chosen.
const KernelInfo& select_kernel(const Case& c, bool& forced) {
  const Pass pass = c.pass == "fwd" ? Pass::Forward : Pass::Backward;
  forced = !c.kernel.empty();
  if (forced) {
    const KernelInfo* k = find_kernel(c.kernel);
    if (!k) throw CaseError("kernel=" + c.kernel + " is not built (--list shows the built ones)");
    if (k->pass != pass) throw CaseError("kernel=" + c.kernel + " is not a " + c.pass + " kernel");
    std::string why = eligibility(c, k->max_k, k->seq_aligned, k->block_q, k->block_k);
    if (!why.empty()) throw CaseError("kernel=" + c.kernel + " cannot run this case: " + why);
    return *k;
  }
  if (c.d % 8 != 0)
    throw CaseError("head_dim " + std::to_string(c.d) +
                    " is not a multiple of 8: PyTorch would run a 'notaligned' kernel, which this harness does not "
                    "build");
  const Entry* begin = pass == Pass::Forward ? std::begin(kForwardOrder) : std::begin(kBackwardOrder);
  const Entry* end = pass == Pass::Forward ? std::end(kForwardOrder) : std::end(kBackwardOrder);
  for (const Entry* e = begin; e != end; ++e) {
    if (!eligibility(c, e->max_k, e->seq_aligned, e->block_q, e->block_k).empty()) continue;
    const KernelInfo* k = find_kernel(e->name);
    if (!k)
      throw CaseError(std::string("PyTorch would consider ") + e->name + " for this case, which is not built");
    if (k->smem_bytes > sm70h::kV100SmemOptinBytes) continue;  // a V100 cannot run it: PyTorch moves on
    return *k;
  }
  throw CaseError("no kernel in PyTorch's sm_70 list fits this case on a V100 (head_dim " + std::to_string(c.d) + ")");
}

int pytorch_split_heuristic(const KernelInfo& k, const Case& c) {  // attention_backward.cu, num_splits_key unset
  const long long parallelism = 1LL * c.b * c.h;  // the grid before splitting: (1, heads, batches)
  long long splits = (c.nk + k.block_k - 1) / k.block_k;
  if (parallelism >= 256 && c.nk <= 2 * k.block_k) splits = 1;
  if (k.needs_accum_grad_kv) splits = std::min<long long>(splits, 200 / parallelism);
  if (splits < 1) splits = 1;
  return int(splits);
}

// ------------------------------------------------------------------------------------------------ timing

struct Timer {
  cudaStream_t stream = nullptr;
  cudaEvent_t start = nullptr, stop = nullptr;
  Timer() {
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreate(&start));
    CUDA_CHECK(cudaEventCreate(&stop));
  }
  ~Timer() {
    cudaEventDestroy(start);
    cudaEventDestroy(stop);
    cudaStreamDestroy(stream);
  }
};

template <typename Call>
double median_ms(Timer& t, int warmup, int repeats, int sets, Call call) {
  for (int i = 0; i < warmup; ++i) call(i % sets);
  CUDA_CHECK(cudaStreamSynchronize(t.stream));
  std::vector<float> times;
  for (int i = 0; i < repeats; ++i) {
    CUDA_CHECK(cudaEventRecord(t.start, t.stream));
    call(i % sets);
    CUDA_CHECK(cudaEventRecord(t.stop, t.stream));
    CUDA_CHECK(cudaEventSynchronize(t.stop));
    float ms = 0.f;
    CUDA_CHECK(cudaEventElapsedTime(&ms, t.start, t.stop));
    times.push_back(ms);
  }
  std::sort(times.begin(), times.end());
  const size_t n = times.size();
  return n % 2 ? times[n / 2] : 0.5 * (double(times[n / 2 - 1]) + times[n / 2]);
}

// ------------------------------------------------------------------------------------------------ verification

struct Errors {
  double max_abs = 0.0, max_ref = 0.0, err2 = 0.0, ref2 = 0.0;
  bool finite = true;
  void add(double got, double want) {
    if (!std::isfinite(got) || !std::isfinite(want)) {
      finite = false;
      return;
    }
    max_abs = std::max(max_abs, std::fabs(got - want));
    max_ref = std::max(max_ref, std::fabs(want));
    err2 += (got - want) * (got - want);
    ref2 += want * want;
  }
  void merge(const Errors& o) {
    max_abs = std::max(max_abs, o.max_abs);
    max_ref = std::max(max_ref, o.max_ref);
    err2 += o.err2;
    ref2 += o.ref2;
    finite = finite && o.finite;
  }
  double rel() const { return ref2 > 0 ? std::sqrt(err2 / ref2) : std::sqrt(err2); }
  double bound(double tol) const { return tol * std::max(1.0, max_ref); }
  // Both: the largest error within tol of the larger of 1 and the largest reference value, and the error's norm
  // within tol of the reference's (which catches a wrong result of small magnitude, e.g. decoding outputs ~0.01).
  bool ok(double tol) const { return finite && max_abs <= bound(tol) && rel() <= tol; }
};

// Compares the slice (batch b, heads [h0, h0 + nh)) of a [B, N, H, D] fp16 tensor with a [nh, N, D] fp32 reference.
Errors compare_slice(const void* got_dev, const DevBuf& ref_dev, int N, int H, int D, int b, int h0, int nh) {
  std::vector<__half> got(size_t(N) * nh * D);
  const size_t pitch = size_t(H) * D * sizeof(__half);
  const char* src = static_cast<const char*>(got_dev) + (size_t(b) * N * H + h0) * D * sizeof(__half);
  CUDA_CHECK(cudaMemcpy2D(got.data(), size_t(nh) * D * sizeof(__half), src, pitch, size_t(nh) * D * sizeof(__half),
                          N, cudaMemcpyDeviceToHost));
  std::vector<float> want(size_t(nh) * N * D);
  CUDA_CHECK(cudaMemcpy(want.data(), ref_dev.get(), want.size() * sizeof(float), cudaMemcpyDeviceToHost));
  Errors e;
  for (int i = 0; i < N; ++i)
    for (int hh = 0; hh < nh; ++hh)
      for (int d = 0; d < D; ++d)
        e.add(__half2float(got[(size_t(i) * nh + hh) * D + d]), want[(size_t(hh) * N + i) * D + d]);
  return e;
}

struct Reference {  // fp32 results on the verification slice of input set 0
  int nh = 0;
  DevBuf out, dq, dk, dv;
};

Reference reference(const Case& c, const __half* q, const __half* k, const __half* v, const __half* dout, int nh,
                    cudaStream_t s) {
  Reference r;
  r.nh = nh;
  const float scale = 1.f / std::sqrt(float(c.d));
  const size_t scores = size_t(nh) * c.nq * c.nk;
  DevBuf p(scores * sizeof(float)), lse(size_t(nh) * c.nq * sizeof(float));
  r.out.alloc(size_t(nh) * c.nq * c.d * sizeof(float));
  ref_scores<<<grid_for(scores), 256, 0, s>>>(q, k, p.get<float>(), c.nq, c.nk, c.h, c.d, 0, 0, nh, scale, c.causal);
  ref_softmax<<<grid_for(size_t(nh) * c.nq, 128), 128, 0, s>>>(p.get<float>(), lse.get<float>(), nh * c.nq, c.nk);
  ref_pv<<<grid_for(size_t(nh) * c.nq * c.d), 256, 0, s>>>(p.get<float>(), v, r.out.get<float>(), c.nq, c.nk, c.h,
                                                            c.d, 0, 0, nh);
  CUDA_CHECK(cudaGetLastError());
  if (c.pass == "bwd") {
    DevBuf delta(size_t(nh) * c.nq * sizeof(float)), ds(scores * sizeof(float));
    r.dq.alloc(size_t(nh) * c.nq * c.d * sizeof(float));
    r.dk.alloc(size_t(nh) * c.nk * c.d * sizeof(float));
    r.dv.alloc(size_t(nh) * c.nk * c.d * sizeof(float));
    ref_delta<<<grid_for(size_t(nh) * c.nq, 128), 128, 0, s>>>(dout, r.out.get<float>(), delta.get<float>(), c.nq,
                                                               c.h, c.d, 0, 0, nh);
    ref_ds<<<grid_for(scores), 256, 0, s>>>(p.get<float>(), dout, v, delta.get<float>(), ds.get<float>(), c.nq, c.nk,
                                            c.h, c.d, 0, 0, nh);
    ref_dq<<<grid_for(size_t(nh) * c.nq * c.d), 256, 0, s>>>(ds.get<float>(), k, r.dq.get<float>(), c.nq, c.nk, c.h,
                                                             c.d, 0, 0, nh, scale);
    ref_t_mm<<<grid_for(size_t(nh) * c.nk * c.d), 256, 0, s>>>(ds.get<float>(), q, r.dk.get<float>(), c.nq, c.nk,
                                                               c.h, c.d, 0, 0, nh, scale);
    ref_t_mm<<<grid_for(size_t(nh) * c.nk * c.d), 256, 0, s>>>(p.get<float>(), dout, r.dv.get<float>(), c.nq, c.nk,
                                                               c.h, c.d, 0, 0, nh, 1.f);
    CUDA_CHECK(cudaGetLastError());
  }
  CUDA_CHECK(cudaStreamSynchronize(s));  // before p, lse, delta, ds are freed
  return r;
}

void add_errors(Json& j, const Errors& e, double tol, const std::string& prefix = "") {
  j.num(prefix + "max_abs", e.finite ? e.max_abs : NAN);
  j.num(prefix + "rel", e.finite ? e.rel() : NAN);
  j.num(prefix + "max_ref", e.max_ref);
  j.num(prefix + "tol", e.bound(tol));
}

// ------------------------------------------------------------------------------------------------ cases

struct Stats {
  int cases = 0, failed = 0, errors = 0;
};

size_t elems(int b, int n, int h, int d) { return size_t(b) * n * h * d; }

double case_flops(const Case& c) {
  double f = 4.0 * c.b * c.h * double(c.nq) * c.nk * c.d;
  if (c.causal && c.nq == c.nk) f *= 0.5;
  return c.pass == "bwd" ? 2.5 * f : f;
}

int auto_input_sets(const Options& o, size_t bytes_per_set) {
  if (o.input_sets > 0) return o.input_sets;
  int device = 0, l2 = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device);
  if (bytes_per_set == 0) return 1;
  size_t sets = (2 * size_t(l2) + bytes_per_set - 1) / bytes_per_set;
  return int(std::max<size_t>(1, std::min<size_t>(sets, 8)));
}

void fill(DevBuf& buf, uint64_t seed, cudaStream_t s) {
  size_t n = buf.bytes() / sizeof(__half);
  fill_normalish<<<grid_for(n), 256, 0, s>>>(buf.get<__half>(), n, seed);
  CUDA_CHECK(cudaGetLastError());
}

void describe_kernel(Json& j, const KernelInfo& k, bool forced) {
  j.str("kernel", k.name).boolean("kernel_forced", forced);
  j.integer("smem_bytes", (long long)k.smem_bytes).boolean("fits_v100", k.smem_bytes <= sm70h::kV100SmemOptinBytes);
}

bool run_forward_case(const Case& c, const Options& o, Timer& t, Json& j) {
  bool forced = false;
  const KernelInfo& k = select_kernel(c, forced);
  describe_kernel(j, k, forced);
  const size_t nq_el = elems(c.b, c.nq, c.h, c.d), nk_el = elems(c.b, c.nk, c.h, c.d);
  const size_t set_bytes = (nq_el + 2 * nk_el) * sizeof(__half);
  const int sets = c.time ? auto_input_sets(o, set_bytes) : 1;
  std::vector<DevBuf> q(sets), kk(sets), v(sets);
  for (int s = 0; s < sets; ++s) {
    q[s].alloc(nq_el * sizeof(__half));
    kk[s].alloc(nk_el * sizeof(__half));
    v[s].alloc(nk_el * sizeof(__half));
    fill(q[s], o.seed + 10 * s + 1, t.stream);
    fill(kk[s], o.seed + 10 * s + 2, t.stream);
    fill(v[s], o.seed + 10 * s + 3, t.stream);
  }
  DevBuf out(nq_el * sizeof(__half)), out_accum;
  if (k.needs_out_accum) out_accum.alloc(nq_el * sizeof(float));
  auto problem = [&](int s) {
    FwdProblem p;
    p.q = q[s].get();
    p.k = kk[s].get();
    p.v = v[s].get();
    p.out = out.get();
    p.out_accum = out_accum.get<float>();
    p.batch = c.b;
    p.heads = c.h;
    p.seqlen_q = c.nq;
    p.seqlen_k = c.nk;
    p.head_dim = c.d;
    p.causal = c.causal;
    p.scale = 1.f / std::sqrt(float(c.d));
    return p;
  };
  auto call = [&](int s) {
    std::string err = k.launch_fwd(problem(s), t.stream);
    if (!err.empty()) throw CaseError(err);
  };
  const double flops = case_flops(c);
  j.num("flops", flops).integer("input_sets", sets);
  int last_set = 0;
  if (c.time) {
    j.integer("warmup", o.warmup).integer("repeats", o.repeats);
    const double ms = median_ms(t, o.warmup, o.repeats, sets, call);
    last_set = (o.repeats - 1) % sets;
    const double kv_bytes = 2.0 * c.b * c.h * double(c.nk) * c.d * sizeof(__half);
    j.num("ms", ms).num("tflops", flops / ms / 1e9).num("kv_bytes", kv_bytes).num("gbps", kv_bytes / ms / 1e6);
  } else {
    call(0);
  }
  if (!o.verify) {
    j.boolean("verified", false).boolean("ok", true);
    return true;
  }
  if (last_set != 0) call(0);
  CUDA_CHECK(cudaStreamSynchronize(t.stream));
  const int nh = std::min(c.h, o.verify_heads);
  Reference r = reference(c, q[0].get<__half>(), kk[0].get<__half>(), v[0].get<__half>(), nullptr, nh, t.stream);
  Errors e = compare_slice(out.get(), r.out, c.nq, c.h, c.d, 0, 0, nh);
  add_errors(j, e, o.tol);
  j.integer("verify_heads", nh).boolean("verified", true).boolean("ok", e.ok(o.tol));
  return e.ok(o.tol);
}

bool run_backward_case(const Case& c, const Options& o, Timer& t, Json& j) {
  bool forced = false;
  const KernelInfo& k = select_kernel(c, forced);
  describe_kernel(j, k, forced);
  Case fc = c;  // the forward that produces O and logsumexp: PyTorch's choice for the same shape
  fc.pass = "fwd";
  fc.kernel.clear();
  bool fwd_forced = false;
  const KernelInfo& fk = select_kernel(fc, fwd_forced);
  j.str("forward_kernel", fk.name);

  std::vector<int> splits;
  bool want_pt = false;
  parse_splits(c.splits, splits, want_pt);
  const int max_splits = (c.nk + k.block_k - 1) / k.block_k;
  std::vector<int> dropped;
  for (int s : splits)
    if (s > max_splits) dropped.push_back(s);
  splits.erase(std::remove_if(splits.begin(), splits.end(), [&](int s) { return s > max_splits; }), splits.end());
  const int pt_split = pytorch_split_heuristic(k, c);
  j.integer("pytorch_split", pt_split).integer("max_split", max_splits);
  std::vector<int> runs = splits;
  if (want_pt && std::find(runs.begin(), runs.end(), pt_split) == runs.end()) runs.push_back(pt_split);
  if (runs.empty()) throw CaseError("no requested split is <= ceil(nk / kBlockSizeJ) = " + std::to_string(max_splits));

  const size_t nq_el = elems(c.b, c.nq, c.h, c.d), nk_el = elems(c.b, c.nk, c.h, c.d);
  const int lse_len = (c.nq + fk.lse_align - 1) / fk.lse_align * fk.lse_align;
  const size_t lse_bytes = size_t(c.b) * c.h * lse_len * sizeof(float);
  const size_t set_bytes = (3 * nq_el + 2 * nk_el) * sizeof(__half) + lse_bytes;
  const int sets = c.time ? auto_input_sets(o, set_bytes) : 1;
  std::vector<DevBuf> q(sets), kk(sets), v(sets), out(sets), dout(sets), lse(sets);
  DevBuf out_accum;
  if (fk.needs_out_accum) out_accum.alloc(nq_el * sizeof(float));
  for (int s = 0; s < sets; ++s) {
    q[s].alloc(nq_el * sizeof(__half));
    kk[s].alloc(nk_el * sizeof(__half));
    v[s].alloc(nk_el * sizeof(__half));
    dout[s].alloc(nq_el * sizeof(__half));
    out[s].alloc(nq_el * sizeof(__half));
    lse[s].alloc(lse_bytes);
    fill(q[s], o.seed + 10 * s + 1, t.stream);
    fill(kk[s], o.seed + 10 * s + 2, t.stream);
    fill(v[s], o.seed + 10 * s + 3, t.stream);
    fill(dout[s], o.seed + 10 * s + 4, t.stream);
    FwdProblem fp;
    fp.q = q[s].get();
    fp.k = kk[s].get();
    fp.v = v[s].get();
    fp.out = out[s].get();
    fp.lse = lse[s].get<float>();
    fp.out_accum = out_accum.get<float>();
    fp.batch = c.b;
    fp.heads = c.h;
    fp.seqlen_q = c.nq;
    fp.seqlen_k = c.nk;
    fp.head_dim = c.d;
    fp.lse_len = lse_len;
    fp.causal = c.causal;
    fp.scale = 1.f / std::sqrt(float(c.d));
    std::string err = fk.launch_fwd(fp, t.stream);
    if (!err.empty()) throw CaseError("forward for the backward's inputs: " + err);
  }
  DevBuf dq(nq_el * sizeof(__half)), dk(nk_el * sizeof(__half)), dv(nk_el * sizeof(__half));
  DevBuf delta(size_t(c.b) * c.h * c.nq * sizeof(float));
  DevBuf workspace;
  CUDA_CHECK(cudaStreamSynchronize(t.stream));

  auto problem = [&](int s, int num_splits) {
    BwdProblem p;
    p.q = q[s].get();
    p.k = kk[s].get();
    p.v = v[s].get();
    p.out = out[s].get();
    p.dout = dout[s].get();
    p.lse = lse[s].get<float>();
    p.delta = delta.get<float>();
    p.dq = dq.get();
    p.dk = dk.get();
    p.dv = dv.get();
    p.workspace = workspace.get<float>();
    p.batch = c.b;
    p.heads = c.h;
    p.seqlen_q = c.nq;
    p.seqlen_k = c.nk;
    p.head_dim = c.d;
    p.lse_len = lse_len;
    p.num_splits = num_splits;
    p.causal = c.causal;
    p.scale = 1.f / std::sqrt(float(c.d));
    return p;
  };
  const int nh = std::min(c.h, o.verify_heads);
  Reference ref;
  if (o.verify) ref = reference(c, q[0].get<__half>(), kk[0].get<__half>(), v[0].get<__half>(),
                                dout[0].get<__half>(), nh, t.stream);

  const double flops = case_flops(c);
  j.num("flops", flops).integer("input_sets", sets).boolean("delta_outside_kernel", !k.kernel_computes_delta);
  if (c.time) j.integer("warmup", o.bwd_warmup).integer("repeats", o.bwd_repeats);
  std::string split_rows;
  bool all_ok = true;
  Errors worst;
  double best_ms = INFINITY, ms1 = NAN, ms_pt = NAN;
  int best_split = 0;
  for (int ns : runs) {
    BwdProblem probe = problem(0, ns);
    const size_t ws = k.bwd_workspace_bytes(probe);
    if (workspace.bytes() < ws) {
      workspace = DevBuf();
      workspace.alloc(ws);
    }
    const bool zero = k.bwd_zero_workspace(problem(0, ns));
    auto call = [&](int s) {
      BwdProblem p = problem(s, ns);
      if (!k.kernel_computes_delta) {
        const size_t rows = size_t(c.b) * c.nq * c.h;
        row_dot_delta<<<grid_for(rows * 32, 256), 256, 0, t.stream>>>(
            static_cast<const __half*>(p.dout), static_cast<const __half*>(p.out), p.delta, c.b, c.nq, c.h, c.d);
      }
      if (zero) CUDA_CHECK(cudaMemsetAsync(p.workspace, 0, ws, t.stream));
      std::string err = k.launch_bwd(p, t.stream);
      if (!err.empty()) throw CaseError(err);
    };
    Json row;
    row.integer("splits", ns).integer("workspace_bytes", (long long)ws);
    int last_set = 0;
    if (c.time) {
      const double ms = median_ms(t, o.bwd_warmup, o.bwd_repeats, sets, call);
      last_set = (o.bwd_repeats - 1) % sets;
      row.num("ms", ms).num("tflops", flops / ms / 1e9);
      const bool in_list = std::find(splits.begin(), splits.end(), ns) != splits.end();
      if (in_list && ms < best_ms) {
        best_ms = ms;
        best_split = ns;
      }
      if (ns == 1) ms1 = ms;
      if (ns == pt_split) ms_pt = ms;
    } else {
      call(0);
    }
    if (o.verify) {
      if (last_set != 0) call(0);
      CUDA_CHECK(cudaStreamSynchronize(t.stream));
      Errors e = compare_slice(dq.get(), ref.dq, c.nq, c.h, c.d, 0, 0, nh);
      e.merge(compare_slice(dk.get(), ref.dk, c.nk, c.h, c.d, 0, 0, nh));
      e.merge(compare_slice(dv.get(), ref.dv, c.nk, c.h, c.d, 0, 0, nh));
      add_errors(row, e, o.tol);
      row.boolean("ok", e.ok(o.tol));
      all_ok = all_ok && e.ok(o.tol);
      worst.merge(e);
    }
    split_rows += (split_rows.empty() ? "" : ", ") + row.text();
    progress("    splits %d%s: %s", ns, ns == pt_split ? " (PyTorch's)" : "", row.text().c_str());
  }
  j.raw("split_runs", "[" + split_rows + "]");
  if (!dropped.empty()) {
    std::string d;
    for (int s : dropped) d += (d.empty() ? "" : " ") + std::to_string(s);
    j.str("splits_dropped", d + " (> ceil(nk / kBlockSizeJ))");
  }
  if (c.time) {
    if (best_split > 0) {
      j.num("ms", best_ms).num("tflops", flops / best_ms / 1e9).integer("best_split", best_split);
    }
    j.num("ms_split1", ms1).num("tflops_split1", flops / ms1 / 1e9);
    j.num("ms_pytorch_split", ms_pt).num("tflops_pytorch_split", flops / ms_pt / 1e9);
  }
  if (o.verify) {
    add_errors(j, worst, o.tol);
    j.integer("verify_heads", nh).boolean("verified", true).boolean("ok", all_ok);
  } else {
    j.boolean("verified", false).boolean("ok", true);
  }
  return all_ok;
}

void run_case(const Case& c, const Options& o, Timer& t, Stats& st, int index, int total) {
  ++st.cases;
  Json j;
  j.str("type", "case").str("tag", c.tag).str("pass", c.pass).integer("batch", c.b).integer("heads", c.h);
  j.integer("seqlen_q", c.nq).integer("seqlen_k", c.nk).integer("head_dim", c.d).boolean("causal", c.causal);
  j.boolean("timed", c.time).str("spec", c.spec);
  progress("[%d/%d] %s", index, total, c.spec.c_str());
  bool ok = false;
  try {
    ok = c.pass == "fwd" ? run_forward_case(c, o, t, j) : run_backward_case(c, o, t, j);
  } catch (const CaseError& e) {
    j.str("error", e.what()).boolean("ok", false);
    ++st.errors;
    emit(j);
    progress("  error: %s", e.what());
    return;
  } catch (const UsageError& e) {
    j.str("error", e.what()).boolean("ok", false);
    ++st.errors;
    emit(j);
    progress("  error: %s", e.what());
    return;
  }
  if (!ok) ++st.failed;
  emit(j);
  progress("  -> %s", ok ? "ok" : "FAILED verification");
}

// ------------------------------------------------------------------------------------------------ reports

void emit_environment(const Options& o) {
  cudaDeviceProp prop{};
  CUDA_CHECK(cudaGetDeviceProperties(&prop, o.device));
  int driver = 0, runtime = 0, smem_optin = 0, clock_khz = 0, mem_clock_khz = 0;
  cudaDriverGetVersion(&driver);
  cudaRuntimeGetVersion(&runtime);
  cudaDeviceGetAttribute(&smem_optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, o.device);
  cudaDeviceGetAttribute(&clock_khz, cudaDevAttrClockRate, o.device);
  cudaDeviceGetAttribute(&mem_clock_khz, cudaDevAttrMemoryClockRate, o.device);
  Json j;
  j.str("type", "environment").str("gpu", prop.name).str("cc", std::to_string(prop.major) + std::to_string(prop.minor));
  j.integer("sms", prop.multiProcessorCount).integer("l2_bytes", prop.l2CacheSize);
  j.integer("smem_per_block_optin", smem_optin).integer("clock_khz", clock_khz).integer("mem_clock_khz", mem_clock_khz);
  j.num("global_mem_gib", prop.totalGlobalMem / 1073741824.0);
  j.integer("driver_version", driver).integer("runtime_version", runtime);
  j.str("cutlass_version", sm70h::registry().empty() ? "" : sm70h::registry()[0].cutlass_version);
  j.integer("v100_smem_optin", (long long)sm70h::kV100SmemOptinBytes);
  j.integer("warmup", o.warmup).integer("repeats", o.repeats).integer("bwd_warmup", o.bwd_warmup);
  j.integer("bwd_repeats", o.bwd_repeats).integer("input_sets", o.input_sets).boolean("verify", o.verify);
  j.integer("verify_heads", o.verify_heads).num("tol", o.tol).integer("seed", (long long)o.seed);
  emit(j);
}

void emit_kernels() {
  std::vector<const KernelInfo*> ks;
  for (const KernelInfo& k : sm70h::registry()) ks.push_back(&k);
  std::sort(ks.begin(), ks.end(), [](const KernelInfo* a, const KernelInfo* b) {
    return a->pass != b->pass ? a->pass == Pass::Forward : a->order < b->order;
  });
  for (const KernelInfo* k : ks) {
    cudaFuncAttributes attr{};
    CUDA_CHECK(cudaFuncGetAttributes(&attr, k->kernel_fn));
    if (k->smem_bytes > 0xc000)
      CUDA_CHECK(cudaFuncSetAttribute(k->kernel_fn, cudaFuncAttributeMaxDynamicSharedMemorySize, int(k->smem_bytes)));
    int blocks = 0;
    CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, k->kernel_fn, k->threads, k->smem_bytes));
    Json j;
    j.str("type", "kernel").str("name", k->name).str("pass", k->pass == Pass::Forward ? "fwd" : "bwd");
    j.str("template", k->template_args).integer("pytorch_order", k->order);
    j.str("block", std::to_string(k->block_q) + "x" + std::to_string(k->block_k)).integer("max_k", k->max_k);
    j.boolean("seq_aligned", k->seq_aligned).integer("threads", k->threads);
    j.integer("launch_bounds_min_blocks", k->min_blocks_per_sm).integer("smem_bytes", (long long)k->smem_bytes);
    j.boolean("fits_v100", k->smem_bytes <= sm70h::kV100SmemOptinBytes);
    j.integer("v100_blocks_by_smem", (long long)(k->smem_bytes ? (96 * 1024) / k->smem_bytes : 0));
    j.integer("regs_here", attr.numRegs).integer("local_bytes_here", (long long)attr.localSizeBytes);
    j.integer("static_smem_here", (long long)attr.sharedSizeBytes).integer("ptx_version", attr.ptxVersion);
    j.integer("binary_version", attr.binaryVersion).integer("blocks_per_sm_here", blocks);
    if (k->pass == Pass::Forward) {
      j.boolean("output_accum_in_gmem", k->needs_out_accum);
    } else {
      j.boolean("kernel_computes_delta", k->kernel_computes_delta).boolean("dkdv_in_gmem", k->needs_accum_grad_kv);
    }
    emit(j);
  }
}

// Small odd shapes for every built kernel, the kernel forced, results verified (splits > 1 included).
std::vector<Case> check_suite() {
  std::vector<Case> cases;
  auto add = [&](const std::string& spec) { cases.push_back(parse_case(spec)); };
  for (const KernelInfo& k : sm70h::registry()) {
    const int d = k.max_k >= 65536 ? 256 : k.max_k;  // the head_dim the benchmark runs it at
    const std::string base = "tag=check,kernel=" + k.name + ",time=0,d=" + std::to_string(d);
    if (k.pass == Pass::Forward) {
      add(base + ",pass=fwd,b=1,h=2,n=130,causal=0");
      add(base + ",pass=fwd,b=1,h=2,n=130,causal=1");
      add(base + ",pass=fwd,b=2,h=3,nq=77,nk=301,causal=0");
      add(base + ",pass=fwd,b=2,h=3,nq=1,nk=1000,causal=0");  // decoding shape
    } else if (k.seq_aligned) {
      add(base + ",pass=bwd,b=2,h=2,n=256,causal=0,splits=1+4");
      add(base + ",pass=bwd,b=2,h=2,n=256,causal=1,splits=1+4");
    } else {
      add(base + ",pass=bwd,b=1,h=2,n=130,causal=0,splits=1+3");
      add(base + ",pass=bwd,b=1,h=2,n=130,causal=1,splits=1+3");
      add(base + ",pass=bwd,b=2,h=3,nq=77,nk=200,causal=0,splits=1+2");
    }
  }
  return cases;
}

const char* kUsage =
    "usage: harness [--check] [--list] [--case SPEC]... [--spec FILE] [--warmup N] [--repeats N]\n"
    "               [--bwd-warmup N] [--bwd-repeats N] [--input-sets N] [--no-verify] [--verify-heads N]\n"
    "               [--tol X] [--device N] [--seed N]\n"
    "SPEC: pass=fwd|bwd,b=B,h=H,nq=NQ,nk=NK (or n=N),d=D[,causal=0|1][,tag=T][,kernel=NAME][,splits=1-8+pt]"
    "[,time=0|1]\n";

}  // namespace

int main(int argc, char** argv) {
  Options o;
  std::vector<Case> cases;
  try {
    for (int i = 1; i < argc; ++i) {
      std::string a = argv[i];
      auto value = [&]() -> std::string {
        if (i + 1 >= argc) throw UsageError(a + " needs a value");
        return argv[++i];
      };
      if (a == "--help" || a == "-h") {
        std::printf("%s", kUsage);
        return 0;
      } else if (a == "--check") {
        o.check = true;
      } else if (a == "--list") {
        o.list = true;
      } else if (a == "--case") {
        cases.push_back(parse_case(value()));
      } else if (a == "--spec") {
        std::string path = value();
        std::ifstream f(path);
        if (!f) throw UsageError("--spec " + path + ": cannot read it");
        std::string line;
        while (std::getline(f, line)) {
          size_t hash = line.find('#');
          if (hash != std::string::npos) line.erase(hash);
          if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
          cases.push_back(parse_case(line));
        }
      } else if (a == "--warmup") {
        o.warmup = parse_int(a, value(), 0, 1000);
      } else if (a == "--repeats") {
        o.repeats = parse_int(a, value(), 1, 10000);
      } else if (a == "--bwd-warmup") {
        o.bwd_warmup = parse_int(a, value(), 0, 1000);
      } else if (a == "--bwd-repeats") {
        o.bwd_repeats = parse_int(a, value(), 1, 10000);
      } else if (a == "--input-sets") {
        o.input_sets = parse_int(a, value(), 0, 64);
      } else if (a == "--no-verify") {
        o.verify = false;
      } else if (a == "--verify-heads") {
        o.verify_heads = parse_int(a, value(), 1, 64);
      } else if (a == "--tol") {
        std::string v = value();
        char* end = nullptr;
        o.tol = std::strtod(v.c_str(), &end);
        if (v.empty() || *end != '\0' || !(o.tol > 0)) throw UsageError("--tol " + v + ": expected a positive number");
      } else if (a == "--device") {
        o.device = parse_int(a, value(), 0, 64);
      } else if (a == "--seed") {
        o.seed = uint64_t(parse_int(a, value(), 0, 1 << 30));
      } else {
        throw UsageError("unknown argument '" + a + "'");
      }
    }
    if (!o.check && !o.list && cases.empty()) throw UsageError("nothing to do: give --check, --list or cases");
  } catch (const UsageError& e) {
    std::fprintf(stderr, "harness: error: %s\n%s", e.what(), kUsage);
    return 2;
  }
  if (int(sm70h::registry().size()) != SM70_INSTANCE_COUNT) {
    std::fprintf(stderr, "harness: error: %d kernel instances registered, built with %d (a link problem)\n",
                 int(sm70h::registry().size()), SM70_INSTANCE_COUNT);
    return 3;
  }
  Stats st;
  try {
    CUDA_CHECK(cudaSetDevice(o.device));
    emit_environment(o);
    emit_kernels();
    if (o.list) return 0;
    std::vector<Case> all;
    if (o.check) all = check_suite();
    all.insert(all.end(), cases.begin(), cases.end());
    Timer t;
    int index = 0;
    for (const Case& c : all) run_case(c, o, t, st, ++index, int(all.size()));
  } catch (const FatalCudaError& e) {
    Json j;
    j.str("type", "fatal").str("error", e.what());
    emit(j);
    std::fprintf(stderr, "harness: fatal CUDA error: %s\n", e.what());
    return 3;
  } catch (const CaseError& e) {  // outside a case: setup
    Json j;
    j.str("type", "fatal").str("error", e.what());
    emit(j);
    std::fprintf(stderr, "harness: error: %s\n", e.what());
    return 3;
  }
  Json s;
  s.str("type", "summary").integer("cases", st.cases).integer("failed", st.failed).integer("errors", st.errors);
  emit(s);
  return (st.failed || st.errors) ? 1 : 0;
}
