/* Scalar helpers shared by radixkv's native CPU kernels (cpu_attention.c, cpu_sampling.c):
 * bf16 <-> float32 and a vectorizable e^x for x <= 0. Header-only (static inline). */
#ifndef RADIXKV_CPU_MATH_H
#define RADIXKV_CPU_MATH_H

#include <stdint.h>

typedef uint16_t bf16_t;

/* A float's bits, e.g. to pack a widened value where the kernels read 32-bit words. */
static inline uint32_t f32_bits(float f) {
    union { uint32_t u; float f; } v;
    v.f = f;
    return v.u;
}

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

/* fp16 (IEEE half) -> float32, exactly; the scale of a quantized KV row is stored as one,
 * little-endian, in the row's last two bytes. No F16C needed (once per row). */
static inline float row_scale(const unsigned char *p) {
    uint32_t h = (uint32_t)p[0] | ((uint32_t)p[1] << 8);
    uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu, man = h & 0x3ffu;
    union { uint32_t u; float f; } v;
    if (exp == 0) {                      /* zero or subnormal: man * 2^-24 */
        v.f = (float)man * 5.9604644775390625e-08f;
        v.u |= sign;
    } else if (exp == 31) {              /* inf / NaN */
        v.u = sign | 0x7f800000u | (man << 13);
    } else {
        v.u = sign | ((exp + 112u) << 23) | (man << 13);
    }
    return v.f;
}

/* float8 e4m3fn -> float32, exactly: 2^(e-7) (1 + m/8), subnormals m 2^-9. The NaN codes 0x7f
 * / 0xff (never written: values are clamped to +-448) read as +-480, as in the torch path. */
static inline float e4m3_to_f32(uint8_t b, uint32_t zero) {
    union { uint32_t u; float f; } v;
    v.u = ((uint32_t)(b & 0x7fu) << 20) | ((uint32_t)(b & 0x80u) << 24);
    v.f *= 0x1p64f;
    v.u ^= zero;
    return v.f * 0x1p56f;
}

/* 0, which the compiler cannot see through (see e4m3_to_f32). */
static inline uint32_t opaque_zero(void) {
    uint32_t z = 0;
    __asm__("" : "+r"(z));
    return z;
}

/* x rounded to bfloat16 (nearest even) and widened back, for finite x: the float a bf16
 * tensor would hold. Branch-free, so a row of them vectorizes. */
static inline float round_bf16_finite(float x) {
    union { uint32_t u; float f; } v;
    v.f = x;
    v.u = (v.u + 0x7fffu + ((v.u >> 16) & 1u)) & 0xffff0000u;
    return v.f;
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
