// Translation unit of the backward kernels, instantiated by NVRTC name expressions such as
// "flash_bwd_dkdv_kernel<BwdKernelTraits<64, 1, 4, 32, false, false, true>>" and
// "flash_bwd_dq_kernel<FwdKernelTraits<64, 2, 1, 4, 32, false, false>>", each with its exported
// "&<kernel>_geometry<...>" (volta_train/kernels/tiles.py, variants.py).
#include "flash_bwd_kernel.cuh"
#include "flash_bwd_dq_kernel.cuh"
