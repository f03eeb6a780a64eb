// Translation unit of the backward kernels, instantiated by NVRTC name expressions such as
// "flash_bwd_dkdv_kernel<BwdKernelTraits<64, 1, 8, 64, false, false, true, false, 1, 1, false, false, 1>>" and
// "flash_bwd_dq_kernel<FwdKernelTraits<64, 2, 1, 4, 32, false, false, 1, 1, false, false, false, false>>", each with
// its exported "&<kernel>_geometry<...>" (volta_train/kernels/templates.py, tiles.py).
#include "flash_bwd_kernel.cuh"
#include "flash_bwd_dq_kernel.cuh"
