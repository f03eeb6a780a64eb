// The launch geometry each kernel exports to the host, so that the launch reads it from the compiled kernel.
//
// Next to every kernel `name<ARGS>` a `__device__` variable `name_geometry<ARGS>` holds its LaunchGeometry. The
// host names it by the NVRTC name expression "&name_geometry<ARGS>", reads its bytes from the cubin's symbol table
// (volta_train/kernels/cubin.py) and launches with them (volta_train/kernels/variants.py LaunchGeometry, same
// field order). The kernels never read these variables: exporting them changes no instruction.
#pragma once

struct LaunchGeometry {
    int dynamic_smem_bytes;  // the kernel's extern __shared__ buffer (opted in above 48 KB)
    int threads;             // threads per block (the __launch_bounds__ of the kernel)
    int block_m;             // query rows per block (forward, dQ, decoding); queries per step (dK/dV)
    int block_n;             // keys per block (0: the kernel has no key blocks)
};
