/* Native CPU versions of the lean forward's per-layer elementwise ops (kernels/fused.py):
 * residual add + RMSNorm, rope + the K/V write of a decode step, and the MLP's silu(gate) * up
 * (bfloat16, AVX-512).
 *
 * Why: at batch 1 these ops are ~20 torch calls a layer (~70 us of dispatch for a few hundred
 * elements each), a tenth of a one-thread decode step of the embedded model. One C call does
 * each in ~2 us.
 *
 * Exactness is the contract, not an aim: every value is computed as the torch references
 * compute it, operation for operation, so the lean forward's logits stay bit-identical to
 * transformers'. Elementwise steps are single IEEE operations, each rounded to the dtype where
 * the reference rounds (bf16: round to nearest even, as c10::BFloat16). The one reduction,
 * the mean of squares, follows ATen's cascade sum (aten/src/ATen/native/cpu/SumKernel.cpp,
 * contiguous inner reduction): LANES-wide vector accumulators, 4 of them interleaved, a
 * 4-level cascade over chunks of 2^k vectors, the tail vectors added to the first accumulator,
 * the 4 accumulators folded in order, the scalar tail summed from 0, then the lanes in order;
 * then divided by the row length. LANES is the width of ATen's Vectorized<float> (16 under
 * AVX512, 8 under AVX2) and the last step's division or reciprocal product a parameter:
 * kernels/native_fused.py picks them by comparing against torch bit for bit on this machine,
 * and uses none of this if no combination matches.
 *
 * This file must be built without -ffast-math's reassociation or contraction (native.py builds
 * it apart from the attention kernels, with -ffp-contract=off): a fused multiply-add or a
 * reordered sum would round differently.
 */
#include <stdint.h>
#include <string.h>
#include <math.h>

static inline float bf16_to_f32(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {   /* round to nearest even, as c10::BFloat16 */
    uint32_t u;
    memcpy(&u, &f, 4);
    const uint32_t rounded = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : (uint16_t)rounded;   /* NaN */
}

/* Element access per dtype, written as separate functions (not a runtime branch inside the
 * loops) so that the compiler vectorizes each loop. LOAD_x(p, i) -> float; STORE_x(p, i, v)
 * rounds v to the dtype; RND_x(v): the value a tensor of the dtype holds after rounding v. */
#define LOAD_f32(p, i) (((const float *)(p))[i])
#define STORE_f32(p, i, v) (((float *)(p))[i] = (v))
#define RND_f32(v) (v)
#define LOAD_bf16(p, i) bf16_to_f32(((const uint16_t *)(p))[i])
#define STORE_bf16(p, i, v) (((uint16_t *)(p))[i] = f32_to_bf16(v))
#define RND_bf16(v) bf16_to_f32(f32_to_bf16(v))

#define LEVELS 4
#define ILP 4

static int64_t ceil_log2(int64_t x) {
    if (x <= 2) return 1;
    int64_t v = x - 1, last = -1;
    while (v) { v >>= 1; ++last; }
    return last + 1;
}

/* ATen's cascade sum of sq[0..n) (see the header comment): the scalar path, for n < lanes. */
static float cascade_sum_scalar(const float *sq, int64_t n) {
    const int64_t size_ilp = n / ILP;
    float acc[LEVELS][ILP];
    memset(acc, 0, sizeof acc);
    const int64_t power = ceil_log2(size_ilp) / LEVELS > 4 ? ceil_log2(size_ilp) / LEVELS : 4;
    const int64_t step = (int64_t)1 << power, mask = step - 1;
    int64_t i = 0;
    while (i + step <= size_ilp) {
        for (int64_t j = 0; j < step; ++j, ++i)
            for (int k = 0; k < ILP; ++k) acc[0][k] += sq[i * ILP + k];
        for (int j = 1; j < LEVELS; ++j) {
            for (int k = 0; k < ILP; ++k) { acc[j][k] += acc[j - 1][k]; acc[j - 1][k] = 0.0f; }
            if ((i & (mask << (j * power))) != 0) break;
        }
    }
    for (; i < size_ilp; ++i)
        for (int k = 0; k < ILP; ++k) acc[0][k] += sq[i * ILP + k];
    for (int j = 1; j < LEVELS; ++j)
        for (int k = 0; k < ILP; ++k) acc[0][k] += acc[j][k];
    for (int64_t m = size_ilp * ILP; m < n; ++m) acc[0][0] += sq[m];
    for (int k = 1; k < ILP; ++k) acc[0][0] += acc[0][k];
    return 0.0f + acc[0][0];
}

/* The vector path with LN lanes (a constant, so the lane loops vectorize). */
#define DEFINE_CASCADE(LN) \
static float cascade_sum_##LN(const float *sq, int64_t n) { \
    const int64_t vecs = n / LN, size_ilp = vecs / ILP; \
    float acc[LEVELS][ILP][LN]; \
    memset(acc, 0, sizeof acc); \
    const int64_t lg = ceil_log2(size_ilp) / LEVELS; \
    const int64_t power = lg > 4 ? lg : 4; \
    const int64_t step = (int64_t)1 << power, mask = step - 1; \
    int64_t i = 0; \
    while (i + step <= size_ilp) { \
        for (int64_t j = 0; j < step; ++j, ++i) \
            for (int k = 0; k < ILP; ++k) \
                for (int l = 0; l < LN; ++l) acc[0][k][l] += sq[(i * ILP + k) * LN + l]; \
        for (int j = 1; j < LEVELS; ++j) { \
            for (int k = 0; k < ILP; ++k) \
                for (int l = 0; l < LN; ++l) { \
                    acc[j][k][l] += acc[j - 1][k][l]; \
                    acc[j - 1][k][l] = 0.0f; \
                } \
            if ((i & (mask << (j * power))) != 0) break; \
        } \
    } \
    for (; i < size_ilp; ++i) \
        for (int k = 0; k < ILP; ++k) \
            for (int l = 0; l < LN; ++l) acc[0][k][l] += sq[(i * ILP + k) * LN + l]; \
    for (int j = 1; j < LEVELS; ++j) \
        for (int k = 0; k < ILP; ++k) \
            for (int l = 0; l < LN; ++l) acc[0][k][l] += acc[j][k][l]; \
    for (int64_t m = size_ilp * ILP; m < vecs; ++m) \
        for (int l = 0; l < LN; ++l) acc[0][0][l] += sq[m * LN + l]; \
    for (int k = 1; k < ILP; ++k) \
        for (int l = 0; l < LN; ++l) acc[0][0][l] += acc[0][k][l]; \
    float total = 0.0f; \
    for (int64_t m = vecs * LN; m < n; ++m) total += sq[m]; \
    for (int l = 0; l < LN; ++l) total += acc[0][0][l]; \
    return 0.0f + total; \
}
DEFINE_CASCADE(4)
DEFINE_CASCADE(8)
DEFINE_CASCADE(16)

static float cascade_sum(const float *sq, int64_t n, int lanes) {
    if (n < lanes) return cascade_sum_scalar(sq, n);
    switch (lanes) {
        case 4: return cascade_sum_4(sq, n);
        case 8: return cascade_sum_8(sq, n);
        default: return cascade_sum_16(sq, n);
    }
}

#define MAX_HIDDEN 16384

/* Calls of at least this many elements split their rows over the calling thread's OpenMP team
 * (torch's: kernels/native.py explains the shared runtime); each row is computed by the same
 * code on whichever thread, so the bits do not depend on the split. Off (0) unless
 * radixkv_fused_set_parallel(1) says the process has one OpenMP runtime. */
#define PAR_NUMEL 32768
static int par_on = 0;

int radixkv_fused_set_parallel(int on) {
#ifdef _OPENMP
    par_on = on != 0;
    return par_on;
#else
    (void)on;
    return 0;
#endif
}

/* One row of the norm: s = x (+ residual, rounded; stored to sum_out), sq = s * s. */
#define DEFINE_NORM_ROW(TY)                                                                     \
static void norm_in_##TY(const void *x, const void *residual, void *sum_out, int64_t base,     \
                         int64_t h, float *s, float *sq) {                                      \
    if (residual) {                                                                             \
        for (int64_t i = 0; i < h; ++i) {                                                       \
            const float v = RND_##TY(LOAD_##TY(x, base + i) + LOAD_##TY(residual, base + i));   \
            STORE_##TY(sum_out, base + i, v);                                                   \
            s[i] = v;                                                                           \
            sq[i] = v * v;                                                                      \
        }                                                                                       \
    } else {                                                                                    \
        for (int64_t i = 0; i < h; ++i) {                                                       \
            const float v = LOAD_##TY(x, base + i);                                             \
            s[i] = v;                                                                           \
            sq[i] = v * v;                                                                      \
        }                                                                                       \
    }                                                                                           \
}                                                                                               \
static void norm_out_##TY(const float *s, float scale, const void *weight, void *out,           \
                          int64_t base, int64_t h) {                                            \
    for (int64_t i = 0; i < h; ++i)                                                             \
        STORE_##TY(out, base + i, LOAD_##TY(weight, i) * RND_##TY(s[i] * scale));               \
}
DEFINE_NORM_ROW(f32)
DEFINE_NORM_ROW(bf16)

/* out[r] = rms_norm(s[r]) * weight, s[r] = x[r] + residual[r] (rounded to the dtype; written
 * to sum_out) or x[r] when residual is NULL. rows of h contiguous elements; dtype 0 float32,
 * 1 bfloat16 (weight in the same dtype). recip: divide the sum of squares by h (0) or multiply
 * by 1/h (1). Returns 0, or -1 for an unsupported size or lane count. */
int radixkv_add_rms_norm(const void *x, const void *residual, const void *weight, void *out,
                         void *sum_out, int64_t rows, int64_t h, float eps, int dtype,
                         int lanes, int recip) {
    if (h < 1 || h > MAX_HIDDEN || (lanes != 4 && lanes != 8 && lanes != 16)) return -1;
    const float inv_h = 1.0f / (float)h;
#pragma omp parallel for if (par_on && rows > 1 && rows * h >= PAR_NUMEL) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        float s[MAX_HIDDEN], sq[MAX_HIDDEN];
        const int64_t base = r * h;
        if (dtype) norm_in_bf16(x, residual, sum_out, base, h, s, sq);
        else norm_in_f32(x, residual, sum_out, base, h, s, sq);
        const float total = cascade_sum(sq, h, lanes);
        const float var = recip ? total * inv_h : total / (float)h;
        const float scale = 1.0f / sqrtf(var + eps);
        if (dtype) norm_out_bf16(s, scale, weight, out, base, h);
        else norm_out_f32(s, scale, weight, out, base, h);
    }
    return 0;
}

/* Rope of one row of d elements (src, stride 1) into dst, as fused.rope_ref rounds it:
 * out = x * cos, then out[:half] -= x2 * sin[:half], out[half:] += x1 * sin[half:], each
 * product and each sum rounded to the dtype. */
#define DEFINE_ROPE_ROW(TY, ET)                                                                 \
static inline void rope_row_##TY(const ET *restrict x, ET *restrict out,                        \
                                 const ET *restrict c, const ET *restrict sn, int64_t d) {      \
    const int64_t half = d / 2;                                                                 \
    for (int64_t i = 0; i < half; ++i) {                                                        \
        const float x1 = LOAD_##TY(x, i), x2 = LOAD_##TY(x, half + i);                          \
        const float lo = RND_##TY(x1 * LOAD_##TY(c, i));                                        \
        const float hi = RND_##TY(x2 * LOAD_##TY(c, half + i));                                 \
        const float t_lo = RND_##TY(x2 * LOAD_##TY(sn, i));                                     \
        const float t_hi = RND_##TY(x1 * LOAD_##TY(sn, half + i));                              \
        STORE_##TY(out, i, lo - t_lo);                                                          \
        STORE_##TY(out, half + i, hi + t_hi);                                                   \
    }                                                                                           \
}
DEFINE_ROPE_ROW(f32, float)
DEFINE_ROPE_ROW(bf16, uint16_t)

static inline void rope_row(const void *src, int64_t s0, void *dst, int64_t d0, const void *cos,
                            const void *sin, int64_t c0, int64_t d, int dtype) {
    if (dtype)
        rope_row_bf16((const uint16_t *)src + s0, (uint16_t *)dst + d0,
                      (const uint16_t *)cos + c0, (const uint16_t *)sin + c0, d);
    else
        rope_row_f32((const float *)src + s0, (float *)dst + d0, (const float *)cos + c0,
                     (const float *)sin + c0, d);
}

/* The decode step's rope and K/V write: for each of t tokens, q (hq heads) and k (hkv heads)
 * rotated by the token's cos/sin rows ([t, d], contiguous), q into q_out ([t, hq, d],
 * contiguous), k into k_cache's slot and v copied into v_cache's (caches [num_slots, hkv, d]
 * contiguous). q/k/v rows: token stride tok_stride elements, head stride d, element stride 1
 * (views of the fused qkv GEMM's output). slots: int64; a negative slot (PAD_SLOT) is skipped.
 * Returns 0; -1 for an odd head_dim, -2 for a slot past the cache (checked before anything is
 * written, so nothing is). */
int radixkv_rope_write_kv(const void *q, const void *k, const void *v, const void *cos,
                          const void *sin, void *q_out, void *k_cache, void *v_cache,
                          const int64_t *slots, int64_t t, int64_t hq, int64_t hkv, int64_t d,
                          int64_t tok_stride, int64_t num_slots, int dtype) {
    if (d % 2) return -1;
    for (int64_t i = 0; i < t; ++i)
        if (slots[i] >= num_slots) return -2;
    const size_t elem = dtype ? 2 : 4;
#pragma omp parallel for if (par_on && t > 1 && t * (hq + hkv) * d >= PAR_NUMEL) schedule(static)
    for (int64_t i = 0; i < t; ++i) {
        const int64_t row = i * tok_stride;
        for (int64_t hh = 0; hh < hq; ++hh)
            rope_row(q, row + hh * d, q_out, (i * hq + hh) * d, cos, sin, i * d, d, dtype);
        const int64_t slot = slots[i];
        if (slot < 0) continue;
        for (int64_t hh = 0; hh < hkv; ++hh)
            rope_row(k, row + hh * d, k_cache, (slot * hkv + hh) * d, cos, sin, i * d, d, dtype);
        memcpy((char *)v_cache + (size_t)(slot * hkv * d) * elem,
               (const char *)v + (size_t)row * elem, (size_t)(hkv * d) * elem);
    }
    return 0;
}

/* ------------------------------------------------------------------ silu(gate) * up, bf16
 *
 * fused.silu_mul_ref is F.silu(gate) * up: two torch ops, each a pass over the [T, I] rows
 * (silu's result written in bf16, then read back for the product). Here one pass computes
 * what ATen's vectorized bf16 kernels compute, element for element:
 *   silu: s = x / (1 + exp(-x)) in float32 (ATen's silu_kernel, Vectorized<float>), exp being
 *         SLEEF's expf with 1-ulp accuracy (Sleef_expf16_u10: its steps below, in its order,
 *         with its fused multiply-adds), then rounded to bf16;
 *   mul:  the bf16 product, exact in float32 (8-bit significands), rounded to bf16.
 * Rounding to bf16 is ATen's vectorized conversion: to nearest even, any NaN -> 0xffff (the
 * scalar c10::BFloat16 conversion gives 0x7fc0; ATen's vector loops never reach it for a row
 * length that is a multiple of its vector, which native_fused.py requires). Whether that is
 * what this machine's torch computes is not assumed: native_fused.py runs every one of the
 * 65,536 bf16 gate values through both and uses this only if every bit agrees. */
#if defined(__AVX512F__)
#include <immintrin.h>

static inline __m512 sleef_expf16_u10(__m512 d) {
    const __m512i q = _mm512_cvt_roundps_epi32(
        _mm512_mul_ps(d, _mm512_set1_ps(1.442695040888963407359924681001892137426645954152985934135449406931f)),
        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 qf = _mm512_cvtepi32_ps(q);
    __m512 s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-0.693145751953125f), d);
    s = _mm512_fmadd_ps(qf, _mm512_set1_ps(-1.428606765330187045e-06f), s);
    __m512 u = _mm512_set1_ps(0.000198527617612853646278381f);
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00139304355252534151077271f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.00833336077630519866943359f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.0416664853692054748535156f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.166666671633720397949219f));
    u = _mm512_fmadd_ps(u, s, _mm512_set1_ps(0.5f));
    u = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_fmadd_ps(_mm512_mul_ps(s, s), u, s));
    /* u * 2^q as two factors (q may exceed the exponent range of one) */
    const __m512i qh = _mm512_srai_epi32(q, 1);
    const __m512 p1 = _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_add_epi32(qh, _mm512_set1_epi32(0x7f)), 23));
    const __m512 p2 = _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_add_epi32(_mm512_sub_epi32(q, qh), _mm512_set1_epi32(0x7f)), 23));
    u = _mm512_mul_ps(_mm512_mul_ps(u, p1), p2);
    u = _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(d, _mm512_set1_ps(-104.f), _CMP_LT_OQ),
                           _mm512_setzero_ps());
    return _mm512_mask_mov_ps(u, _mm512_cmp_ps_mask(_mm512_set1_ps(100.f), d, _CMP_LT_OQ),
                              _mm512_set1_ps(INFINITY));
}

static inline __m512 bf16x16_load(const uint16_t *p) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}

/* Rounded to bf16 as ATen's vectorized conversion: to nearest even, NaN -> 0xffff. */
static inline __m256i bf16x16_round(__m512 f) {
    const __m512i b = _mm512_castps_si512(f);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(
        _mm512_add_epi32(b, _mm512_add_epi32(_mm512_set1_epi32(0x7fff), lsb)), 16);
    r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q),
                              _mm512_set1_epi32(0xffff));
    return _mm512_cvtepi32_epi16(r);
}

/* Eight vectors at a time, each step applied to all eight: one vector's chain (the exp's
 * polynomial, the division, two roundings) is ~30 dependent operations, and interleaving gives
 * the core independent work beside each. 250 rows of 1,536 on a Zen 5 core: one vector per
 * iteration 185 us (torch: 172), two 170, four 152, eight 122, twelve or sixteen 126. */
#define SILU_W 8
/* n (<= SILU_W) vectors of 16 elements, stage by stage. */
static inline void silu_mul_vectors(const uint16_t *restrict g, const uint16_t *restrict u,
                                    uint16_t *restrict o, int n) {
    __m512 x[SILU_W], e[SILU_W];
    for (int w = 0; w < n; w++) x[w] = bf16x16_load(g + 16 * w);
    for (int w = 0; w < n; w++)
        e[w] = sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x[w]));
    for (int w = 0; w < n; w++) {
        const __m256i s = bf16x16_round(
            _mm512_div_ps(x[w], _mm512_add_ps(_mm512_set1_ps(1.0f), e[w])));
        const __m512 sf = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(s), 16));
        _mm256_storeu_si256((__m256i *)(o + 16 * w),
                            bf16x16_round(_mm512_mul_ps(sf, bf16x16_load(u + 16 * w))));
    }
}

static inline void silu_mul_row_bf16(const uint16_t *restrict g, const uint16_t *restrict u,
                                     uint16_t *restrict o, int64_t inter) {
    int64_t i = 0;
    for (; i + 16 * SILU_W <= inter; i += 16 * SILU_W)
        silu_mul_vectors(g + i, u + i, o + i, SILU_W);
    for (; i < inter; i += 16)
        silu_mul_vectors(g + i, u + i, o + i, 1);
}
#endif

/* out[r] = silu(gate_up[r, :inter]) * gate_up[r, inter:] for rows of 2 inter contiguous bf16
 * elements (dtype 1) into rows of inter. Returns 0; -1 where it does not apply (float32, a
 * row length not a multiple of 16, a build without AVX-512): the caller runs torch. */
int radixkv_silu_mul(const void *gate_up, void *out, int64_t rows, int64_t inter, int dtype) {
#if defined(__AVX512F__)
    if (dtype != 1 || inter < 16 || inter % 16) return -1;
#pragma omp parallel for if (par_on && rows > 1 && rows * inter >= PAR_NUMEL) schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
        const uint16_t *g = (const uint16_t *)gate_up + r * 2 * inter;
        silu_mul_row_bf16(g, g + inter, (uint16_t *)out + r * inter, inter);
    }
    return 0;
#else
    (void)gate_up; (void)out; (void)rows; (void)inter; (void)dtype;
    return -1;
#endif
}

int radixkv_fused_abi(void) { return 3; }
