// Stand-in for cuRAND's <curand_kernel.h>, found first on the harness's include path.
//
// CUTLASS example 41 (kernel_forward.h, kernel_backward.h) includes <curand_kernel.h> for dropout. The harness
// instantiates no dropout kernel (every instance has kApplyDropout = false, and the forward's dropout code is compiled
// only with HAS_PYTORCH, which the harness does not define), so cuRAND is never called: these declarations only let
// the headers compile where the CUDA toolkit ships no cuRAND headers (the nvcc 13 install this was built with has
// none). Each function traps if it is ever reached. Generated code of the instances is unaffected: the branches that
// name these functions are removed at compile time (instance.cu checks kApplyDropout == false).
#pragma once

#include <cuda_runtime.h>

struct curandStatePhilox4_32_10 {
  uint4 ctr;
  uint4 output;
  uint2 key;
  unsigned int STATE;
  int boxmuller_flag;
  int boxmuller_flag_double;
  float boxmuller_extra;
  double boxmuller_extra_double;
};
typedef struct curandStatePhilox4_32_10 curandStatePhilox4_32_10_t;

__device__ inline void curand_init(unsigned long long, unsigned long long, unsigned long long,
                                   curandStatePhilox4_32_10_t*) {
  __trap();
}

__device__ inline void skipahead(unsigned long long, curandStatePhilox4_32_10_t*) { __trap(); }

__device__ inline float4 curand_uniform4(curandStatePhilox4_32_10_t*) {
  __trap();
  return make_float4(0.f, 0.f, 0.f, 0.f);
}
