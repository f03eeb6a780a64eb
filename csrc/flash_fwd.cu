// Translation unit of the forward kernels. Variants are instantiated by NVRTC name expressions such as
// "flash_fwd_kernel<FwdKernelTraits<64, 2, 1, 4, 32, false, false, 1, 1, false, false>>" (volta_train/kernels/tiles.py).
#include "flash_fwd_kernel.cuh"
