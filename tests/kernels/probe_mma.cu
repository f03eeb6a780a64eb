// Test kernel of the run-time compile / cache / launch pipeline (volta_train/kernels/{nvrtc,cache,driver}.py).
//
// Every warp runs ONE mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32, i.e. four independent 8x8x4 products,
// one per quad-pair q = 0..3 (lanes 4q..4q+3 and 4q+16..4q+19), so a test of the output checks the fragment
// layouts of the PTX ISA ("Matrix Fragments for mma.m8n8k4 with .f16 floating point type"):
//   A (.row, 8x4 M x K): lane l holds row (l % 4) + 4 * (l >= 16), columns k = 0..3 (a0..a3)
//   B (.col, 4x8 K x N): lane l holds column (l % 4) + 4 * (l >= 16), rows k = 0..3 (b0..b3)
//   C/D (.f32, 8x8):     c_i at row (l & 1) + (i & 2) + 4 * (l >= 16), column (i & 4) + (l & 2) + (i & 1)
// An .f16x2 register holds its first element in the low 16 bits.
//
// Memory layout, all row-major, for product p = warp * 4 + q:
//   a: f16 [P][8][4] (M x K), b: f16 [P][4][8] (K x N), c: f32 [P][8][8], d: f32 [P][8][8]
//   d[p] = alpha * (a[p] @ b[p] + c[p]), staged through dynamic shared memory (kWarpsPerBlock KB) on the way out.
// Self-contained: no CUDA headers (f16 values travel as unsigned short bit patterns).

struct ProbeParams {
    const unsigned short* a;
    const unsigned short* b;
    const float* c;
    float* d;
    int num_warps;  // warps with a product to compute; the grid may hold more
    float alpha;
};

__device__ __forceinline__ unsigned pack_f16x2(unsigned short first, unsigned short second) {
    return static_cast<unsigned>(first) | (static_cast<unsigned>(second) << 16);
}

template <int kWarpsPerBlock>
__global__ void __launch_bounds__(32 * kWarpsPerBlock) volta_probe_mma_kernel(const ProbeParams params) {
    extern __shared__ float staged[];  // [kWarpsPerBlock][4 quad-pairs][64]
    const int lane = threadIdx.x & 31;
    const int warp_in_block = threadIdx.x >> 5;
    const int warp = blockIdx.x * kWarpsPerBlock + warp_in_block;
    if (warp >= params.num_warps) {
        return;  // whole warps only: the mma below needs all 32 lanes
    }
    const int quad_pair = (lane >> 2) & 3;
    const int upper = lane >> 4;  // 1 for lanes 16..31
    const int product = warp * 4 + quad_pair;
    const unsigned short* a = params.a + product * 32;
    const unsigned short* b = params.b + product * 32;
    const float* c = params.c + product * 64;

    const int a_row = (lane & 3) + 4 * upper;
    const unsigned a01 = pack_f16x2(a[a_row * 4 + 0], a[a_row * 4 + 1]);
    const unsigned a23 = pack_f16x2(a[a_row * 4 + 2], a[a_row * 4 + 3]);
    const int b_col = (lane & 3) + 4 * upper;
    const unsigned b01 = pack_f16x2(b[0 * 8 + b_col], b[1 * 8 + b_col]);
    const unsigned b23 = pack_f16x2(b[2 * 8 + b_col], b[3 * 8 + b_col]);

    float acc[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int row = (lane & 1) + (i & 2) + 4 * upper;
        const int col = (i & 4) + (lane & 2) + (i & 1);
        acc[i] = c[row * 8 + col];
    }
    asm volatile(
        "mma.sync.aligned.m8n8k4.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9}, {%10, %11}, {%0, %1, %2, %3, %4, %5, %6, %7};\n"
        : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3]), "+f"(acc[4]), "+f"(acc[5]), "+f"(acc[6]),
          "+f"(acc[7])
        : "r"(a01), "r"(a23), "r"(b01), "r"(b23));

    float* tile = staged + (warp_in_block * 4 + quad_pair) * 64;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        const int row = (lane & 1) + (i & 2) + 4 * upper;
        const int col = (i & 4) + (lane & 2) + (i & 1);
        tile[row * 8 + col] = params.alpha * acc[i];
    }
    __syncwarp();
    // Each lane writes 8 consecutive floats of the warp's four 8x8 tiles (256 floats).
    float* d = params.d + warp * 256;
    const float* warp_tiles = staged + warp_in_block * 256;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
        d[lane * 8 + i] = warp_tiles[lane * 8 + i];
    }
}
