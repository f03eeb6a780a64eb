// Philox 4x32-10, the counter-based generator of the dropout keep bits (dropout.cuh), identical to
// volta_train/philox.py.
#pragma once
#include "vt_numeric.cuh"

constexpr u32 kPhiloxM0 = 0xD2511F53u;
constexpr u32 kPhiloxM1 = 0xCD9E8D57u;
constexpr u32 kPhiloxW0 = 0x9E3779B9u;
constexpr u32 kPhiloxW1 = 0xBB67AE85u;
constexpr int kPhiloxRounds = 10;

__device__ __forceinline__ u32x4 philox4x32_10(u32 c0, u32 c1, u32 c2, u32 c3, u32 k0, u32 k1) {
#pragma unroll
    for (int round = 0; round < kPhiloxRounds; ++round) {
        const u32 hi0 = __umulhi(kPhiloxM0, c0), lo0 = kPhiloxM0 * c0;
        const u32 hi1 = __umulhi(kPhiloxM1, c2), lo1 = kPhiloxM1 * c2;
        c0 = hi1 ^ c1 ^ k0;
        c1 = lo1;
        c2 = hi0 ^ c3 ^ k1;
        c3 = lo0;
        k0 += kPhiloxW0;
        k1 += kPhiloxW1;
    }
    return u32x4{c0, c1, c2, c3};
}
