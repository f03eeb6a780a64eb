// Translation unit of the forward and decoding kernels. Variants are instantiated by NVRTC name expressions such as
// "flash_fwd_kernel<FwdKernelTraits<64, 2, 1, 4, 32, false, false, 1, 1, false, false, false, false>>", each with its
// exported "&flash_fwd_kernel_geometry<...>" (volta_train/kernels/templates.py, tiles.py).
#include "flash_fwd_kernel.cuh"
