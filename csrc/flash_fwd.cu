// Translation unit of the forward kernels. Variants are instantiated by NVRTC name expressions such as
// "flash_fwd_kernel<FwdKernelTraits<64, 4, 1, 4, 64, false, false, 1>>" (see volta_train/kernels/variants.py).
#include "flash_fwd_kernel.cuh"
