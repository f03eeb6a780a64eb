// Logit soft-capping (Gemma-2, flash-attn's softcap): the scaled score x = q.k * softmax_scale becomes
// softcap * tanh(x / softcap) before ALiBi and the masks.
//
// The kernels hold a score s in their own units, with the log2-domain logit s * score_scale (FP32-ACC:
// s = q.k and score_scale = scale * log2 e; FP16-ACC: Q is pre-scaled, s = q.k * scale * log2 e and
// score_scale = 1). Capping replaces s by t = tanh(s * score_scale / cap_log2), cap_log2 = softcap * log2 e,
// and the score scale by cap_log2: t * cap_log2 = softcap * tanh(x / softcap) * log2 e, the capped logit in
// the log2 domain. Everything after (ALiBi bias / score_scale, masks, the online softmax) is unchanged.
// The backward multiplies dS by d(capped logit)/dx = 1 - t^2.
#pragma once
#include "vt_numeric.cuh"

// tanh x = 1 - 2 / (2^(2x log2 e) + 1). sm_70 has no tanh instruction (MUFU.TANH is sm_75+): one MUFU.EX2 and
// one reciprocal. Saturates to +-1 without NaN (2^x = inf gives 1, 2^x = 0 gives -1); absolute error ~1e-7.
__device__ __forceinline__ float tanh_by_exp2(float x) {
    return 1.f - __fdividef(2.f, fast_exp2(x * (2.f * kLog2e)) + 1.f);
}

struct SoftCap {
    float to_tanh;      // s -> argument of tanh: score_scale / cap_log2
    float score_scale;  // the score scale of the capped scores: cap_log2

    __device__ __forceinline__ SoftCap(float cap_log2, float score_scale_uncapped)
        : to_tanh(score_scale_uncapped / cap_log2), score_scale(cap_log2) {}

    __device__ __forceinline__ float cap(float s) const { return tanh_by_exp2(s * to_tanh); }
    // d(capped score)/d(score) relative to the scale change: 1 - t^2 for a capped score t.
    __device__ __forceinline__ static float derivative(float t) { return fmaf(-t, t, 1.f); }
};

// The capped scores of a warp's S tiles, in place.
template <int kMTiles, int kSTiles>
__device__ __forceinline__ void cap_scores(float (&s)[kMTiles][kSTiles][8], const SoftCap& cap) {
#pragma unroll
    for (int a = 0; a < kMTiles; ++a)
#pragma unroll
        for (int nt = 0; nt < kSTiles; ++nt)
#pragma unroll
            for (int i = 0; i < 8; ++i) s[a][nt][i] = cap.cap(s[a][nt][i]);
}
