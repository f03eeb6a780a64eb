// Numeric basics for the Volta kernels: fixed-width types, half <-> float conversions, fast exp2/log2 and the
// lane-butterfly reductions of row statistics.
//
// The kernel sources are self-contained (no CUDA headers): NVRTC compiles them without a toolkit
// include path, so half precision values are carried as raw 16-bit patterns (`half_bits`) and
// pairs of them in one 32-bit register (`half2_bits`, low half = first element).
#pragma once

typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short half_bits;
typedef unsigned int half2_bits;

struct __align__(16) u32x4 { u32 x, y, z, w; };
struct __align__(8) u32x2 { u32 x, y; };

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

__device__ __forceinline__ float neg_inf() { return __int_as_float(0xff800000); }
__device__ __forceinline__ float pos_inf() { return __int_as_float(0x7f800000); }

// The exponent offset of a row whose running max may still be -inf (no key seen): 0 then, so that
// exp2(-inf - 0) = 0 and nothing becomes NaN.
__device__ __forceinline__ float safe_row_max(float m) { return m == neg_inf() ? 0.f : m; }

// One butterfly step of a reduction across the lanes that differ in `lane_mask` (the whole warp must call it).
__device__ __forceinline__ float max_over_lanes(float x, int lane_mask) {
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, lane_mask));
}

__device__ __forceinline__ float sum_over_lanes(float x, int lane_mask) {
    return x + __shfl_xor_sync(0xffffffffu, x, lane_mask);
}

// The reductions over the whole warp (every lane gets the result; the whole warp must call them).
__device__ __forceinline__ float max_over_warp(float x) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) x = max_over_lanes(x, mask);
    return x;
}

__device__ __forceinline__ float sum_over_warp(float x) {
#pragma unroll
    for (int mask = 16; mask > 0; mask >>= 1) x = sum_over_lanes(x, mask);
    return x;
}

__device__ __forceinline__ float half_to_float(half_bits h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}

__device__ __forceinline__ half_bits float_to_half(float f) {
    half_bits h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

// Two floats rounded to fp16 and packed low-first into one register.
__device__ __forceinline__ half2_bits pack_half2(float lo, float hi) {
    half2_bits r;
    asm("{ .reg .f16 l, h;\n"
        "  cvt.rn.f16.f32 l, %1;\n"
        "  cvt.rn.f16.f32 h, %2;\n"
        "  mov.b32 %0, {l, h}; }" : "=r"(r) : "f"(lo), "f"(hi));
    return r;
}

__device__ __forceinline__ float low_half_to_float(half2_bits v) { return half_to_float((half_bits)(v & 0xffffu)); }
__device__ __forceinline__ float high_half_to_float(half2_bits v) { return half_to_float((half_bits)(v >> 16)); }

// Every f16 of a 16-byte chunk times `scale` (in fp32, rounded back to f16).
__device__ __forceinline__ u32x4 scale_halves(u32x4 v, float scale) {
    v.x = pack_half2(low_half_to_float(v.x) * scale, high_half_to_float(v.x) * scale);
    v.y = pack_half2(low_half_to_float(v.y) * scale, high_half_to_float(v.y) * scale);
    v.z = pack_half2(low_half_to_float(v.z) * scale, high_half_to_float(v.z) * scale);
    v.w = pack_half2(low_half_to_float(v.w) * scale, high_half_to_float(v.w) * scale);
    return v;
}

__device__ __forceinline__ half2_bits mul_half2(half2_bits a, half2_bits b) {
    half2_bits r;
    asm("mul.rn.f16x2 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(b));
    return r;
}

// 2^x with the SFU (MUFU.EX2); ex2(-inf) = 0.
__device__ __forceinline__ float fast_exp2(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ float fast_log2(float x) {
    float y;
    asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

__device__ __forceinline__ u32x4 load_global_16B(const void* ptr) {
    u32x4 v;
    asm volatile("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(ptr));
    return v;
}

__device__ __forceinline__ void store_global_16B(void* ptr, const u32x4& v) {
    asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" :: "l"(ptr), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w));
}

__device__ __forceinline__ void store_global_f32x2(float* ptr, float x, float y) {
    asm volatile("st.global.v2.f32 [%0], {%1, %2};" :: "l"(ptr), "f"(x), "f"(y));
}

__device__ __forceinline__ u32x4 load_shared_16B(const void* ptr) {
    return *reinterpret_cast<const u32x4*>(ptr);
}

__device__ __forceinline__ u32x2 load_shared_8B(const void* ptr) {
    return *reinterpret_cast<const u32x2*>(ptr);
}

__device__ __forceinline__ void store_shared_16B(void* ptr, const u32x4& v) {
    *reinterpret_cast<u32x4*>(ptr) = v;
}

__device__ __forceinline__ u32x4 zero_u32x4() { return u32x4{0u, 0u, 0u, 0u}; }
