/* Scalar helpers shared by radixkv's native CPU kernels (cpu_attention.c, cpu_sampling.c):
 * bf16 <-> float32 and a vectorizable e^x for x <= 0. Header-only (static inline). */
#ifndef RADIXKV_CPU_MATH_H
#define RADIXKV_CPU_MATH_H

#include <stdint.h>

typedef uint16_t bf16_t;

static inline float bf16_to_f32(bf16_t x) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)x) << 16;
    return v.f;
}

static inline bf16_t f32_to_bf16(float f) {   /* round to nearest even; NaN stays a quiet NaN */
    union { uint32_t u; float f; } v;
    v.f = f;
    if ((v.u & 0x7fffffffu) > 0x7f800000u) return (bf16_t)((v.u >> 16) | 0x40u);
    return (bf16_t)((v.u + 0x7fffu + ((v.u >> 16) & 1u)) >> 16);
}

/* e^x for x <= 0: 2^k * p(r), r = x - k ln2, |r| <= ln2 / 2; p the degree-6 Taylor polynomial
 * (relative error < 2e-7 there). Arguments below -87 give e^-87 ~ 1.6e-38, i.e. nothing next to
 * the running maximum's term of 1. Written without branches or libm so it vectorizes. */
static inline float exp_nonpositive(float x) {
    x = x < -87.0f ? -87.0f : x;
    float k = __builtin_rintf(x * 1.44269504088896341f);
    float r = x - k * 0.693145751953125f - k * 1.428606765330187e-06f;
    float p = 1.0f + r * (1.0f + r * (0.5f + r * (1.0f / 6 + r * (1.0f / 24
                + r * (1.0f / 120 + r * (1.0f / 720))))));
    union { uint32_t u; float f; } two_k;
    two_k.u = (uint32_t)((int32_t)k + 127) << 23;
    return p * two_k.f;
}

#endif
