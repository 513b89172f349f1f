/* Paged attention for the CPU, read through block tables: decode (one query token per sequence,
 * float32 and bfloat16) and prefill / extend: float32 where the CPU has AVX2 with FMA or
 * AVX-512, bfloat16 where it has AVX512-BF16. Decode's float32-query heads are AVX2 intrinsics
 * where the build has AVX2 or AVX-512 (DEFINE_DECODE8), the compiler's vectorization of plain C
 * (DEFINE_HEAD) otherwise.
 *
 * Decode.
 * Why native code: on the CPU a decode step's attention is many tiny problems (per sequence and
 * KV head: G query rows against L keys of head_dim D). torch's SDPA pays a fixed cost per
 * (sequence, head) that dwarfs the arithmetic, and the torch path must first gather every
 * sequence's K/V blocks into a contiguous copy. This kernel reads K and V where they lie in the
 * paged pool and keeps everything of one (sequence, KV head) in registers and on the stack.
 *
 * Numerics: float32 throughout (scores, softmax, accumulation), as the flash kernels do; the
 * output is rounded once to the cache dtype (bfloat16 round-to-nearest-even). The one exception
 * is the bf16 prefill's P.V, which rounds P to bf16 as FlashAttention does (see PV below). The softmax is the
 * online (streaming) form over tiles of 16 keys. exp is a degree-6 polynomial with range
 * reduction (relative error < 2e-7 for the arguments here, x <= 0), which the compiler can
 * vectorize (libm's expf is not, without -fopenmp and libmvec).
 *
 * Built by kernels/native.py with the machine's C compiler (-O3 -march=native and fast-math's
 * reassociation flags, not -ffast-math: see FLAGS there) on first use and cached; the sizes are compile-time constants so the
 * compiler keeps a (sequence, KV head)'s accumulators in vector registers. Combinations not
 * instantiated below return -2 (-3: the CPU lacks the instructions) and the caller takes the
 * torch path.
 *
 * Decode also reads int8 and fp8 (e4m3) caches in place (rows of D values + an fp16 scale,
 * engine/kv_quant.py), widening each row as the torch path's dequantized scratch would hold it.
 *
 * Layouts (all contiguous):
 *   q, out        [n, hq, D]                     hq = G * hkv; query head h reads KV head h / G
 *   k_cache, v    [num_blocks, bs, hkv, D]       (quantized: D + 2 bytes per row)
 *   block_tables  int32 [n, max_blocks]          entries past ceil(len / bs) are never read
 *   seq_lens      int32 [n], >= 1
 */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "cpu_math.h"

/* Which vector width the intrinsics below are built for: AVX-512 (16 float lanes) or AVX2 with
 * FMA (8 lanes: most laptops' and Zen 2 / 3 servers' -march=native). Neither: the prefill entry
 * points return -3 (the torch path runs) and decode is the generic C of DEFINE_HEAD. bf16
 * prefill needs AVX512-BF16 besides. */
#if defined(__AVX512F__)
#define VECTOR_LANES 16
#elif defined(__AVX2__) && defined(__FMA__)
#define VECTOR_LANES 8
#else
#define VECTOR_LANES 0
#endif
/* Decode's float32-query heads are the AVX2 intrinsics of DEFINE_DECODE8 in both vector builds:
 * on an AVX-512 EPYC (Zen 5) they took 0.63-0.88x the time of the compiler's 16-lane
 * vectorization of DEFINE_HEAD (`radixkv bench kernels`, the library built both ways on one
 * machine, docs/kernels.md). */
#define DECODE8 (VECTOR_LANES >= 8)
#if VECTOR_LANES
#include <immintrin.h>

/* exp_nonpositive's steps (cpu_math.h) on a vector of x <= 0, for a vector width W (_mm256 /
 * _mm512) and its round-to-nearest ROUND: clamp, k = round(x log2 e), r = x - k ln 2 in two
 * parts, p = the degree-6 polynomial of r. Leaves k and p; the caller scales p by 2^k. One
 * macro for both widths so that their constants and order cannot drift apart (the AVX2 and
 * AVX-512 prefill kernels are meant to give the same bits). */
#define EXP_NONPOS_STEPS(W, ROUND, x, k, p) do {                                                \
        x = W##_max_ps(x, W##_set1_ps(-87.0f));                                                 \
        k = ROUND(W##_mul_ps(x, W##_set1_ps(1.44269504088896341f)),                             \
                  _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);                               \
        __typeof__(x) r_ = W##_fnmadd_ps(k, W##_set1_ps(0.693145751953125f), x);                \
        r_ = W##_fnmadd_ps(k, W##_set1_ps(1.428606765330187e-06f), r_);                         \
        p = W##_set1_ps(1.0f / 720);                                                            \
        p = W##_fmadd_ps(p, r_, W##_set1_ps(1.0f / 120));                                       \
        p = W##_fmadd_ps(p, r_, W##_set1_ps(1.0f / 24));                                        \
        p = W##_fmadd_ps(p, r_, W##_set1_ps(1.0f / 6));                                         \
        p = W##_fmadd_ps(p, r_, W##_set1_ps(0.5f));                                             \
        p = W##_fmadd_ps(p, r_, W##_set1_ps(1.0f));                                             \
        p = W##_fmadd_ps(p, r_, W##_set1_ps(1.0f));                                             \
    } while (0)
#endif

#define TILE 16

/* Tiles ahead whose K / V rows a decode head prefetches (into L1). Why: a head's rows are
 * every hkv-th of the pool's, a stride the hardware prefetchers follow poorly under a decode
 * head's work per row; from DRAM (a step's K / V after its GEMMs streamed the weights through
 * the caches) 4 sequences x 600 keys x 30 layers of the embedded model took 5.1 ms on one Zen 5
 * core, ~10 GB/s, where a plain read of those rows runs at ~25. 1 or 2 tiles ahead did best;
 * 4 and 8 were slower, as was prefetching into L2 only. -DPREFETCH_TILES=0: none (the
 * before of a measurement). */
#ifndef PREFETCH_TILES
#define PREFETCH_TILES 2
#endif
#define PREFETCH_AHEAD(k_cache, v_cache, j0, L, ROWB) do {                                      \
        int ja_ = (j0) + TILE * PREFETCH_TILES;                                                 \
        int na_ = PREFETCH_TILES < 1 ? 0 : (L) - ja_ < TILE ? (L) - ja_ : TILE;                 \
        for (int t_ = 0; t_ < na_; t_++) {                                                      \
            const char *kp_ = KV_ROW(k_cache, ja_ + t_, ROWB);                                  \
            const char *vp_ = KV_ROW(v_cache, ja_ + t_, ROWB);                                  \
            for (int o_ = 0; o_ < (ROWB); o_ += 64) {                                           \
                __builtin_prefetch(kp_ + o_, 0, 3);                                             \
                __builtin_prefetch(vp_ + o_, 0, 3);                                             \
            }                                                                                   \
        }                                                                                       \
    } while (0)

/* Key j's row for KV head h in a cache of ROWB-byte rows, through the sequence's block table. */
#define KV_ROW(cache, j, ROWB)                                                                  \
    ((cache) + (((int64_t)table[(j) / bs] * bs + (j) % bs) * hkv + h) * (int64_t)(ROWB))

/* One (sequence, KV head): G query rows of head dim D against the sequence's L keys. The
 * cache holds rows of ROWB bytes; ROWLOAD(dst, row) widens one into float dst[D]. GMAX sizes
 * the accumulators and G bounds the loops: both the constant G for the float caches (the
 * accumulators then live in vector registers), or GMAX 8 and the runtime group size g for the
 * quantized ones (a quarter of the instantiations, so the build stays ~7 s). */
#define DEFINE_HEAD(NAME, QT, QLOAD, STORE, ROWB, ROWLOAD, GMAX, G, D)                          \
static void NAME(const QT *q, const char *k_cache, const char *v_cache, const int32_t *table,   \
                 int L, int bs, int hkv, int h, float scale, QT *out, int g) {                  \
    float qf[GMAX][D], acc[GMAX][D], mx[GMAX], sum[GMAX];                                       \
    (void)g;                                                                                    \
    for (int i = 0; i < G; i++) {                                                               \
        for (int e = 0; e < D; e++) { qf[i][e] = QLOAD(q[i * D + e]) * scale; acc[i][e] = 0.f; } \
        mx[i] = -INFINITY;                                                                      \
        sum[i] = 0.f;                                                                           \
    }                                                                                           \
    for (int j0 = 0; j0 < L; j0 += TILE) {                                                      \
        int nt = L - j0 < TILE ? L - j0 : TILE;                                                 \
        float s[GMAX][TILE];                                                                    \
        PREFETCH_AHEAD(k_cache, v_cache, j0, L, ROWB);                                          \
        for (int t = 0; t < nt; t++) {                                                          \
            int j = j0 + t;                                                                     \
            float kf[D];                                                                        \
            ROWLOAD(kf, KV_ROW(k_cache, j, ROWB), D);                                         \
            for (int i = 0; i < G; i++) {                                                       \
                float a = 0.f;                                                                  \
                for (int e = 0; e < D; e++) a += qf[i][e] * kf[e];                              \
                s[i][t] = a;                                                                    \
            }                                                                                   \
        }                                                                                       \
        for (int i = 0; i < G; i++) {                                                           \
            float m = mx[i];                                                                    \
            for (int t = 0; t < nt; t++) m = s[i][t] > m ? s[i][t] : m;                         \
            float c = exp_nonpositive(mx[i] - m);   /* rescale what came before */             \
            mx[i] = m;                                                                          \
            sum[i] *= c;                                                                        \
            for (int e = 0; e < D; e++) acc[i][e] *= c;                                         \
            for (int t = 0; t < nt; t++) { s[i][t] = exp_nonpositive(s[i][t] - m); sum[i] += s[i][t]; } \
        }                                                                                       \
        for (int t = 0; t < nt; t++) {                                                          \
            int j = j0 + t;                                                                     \
            float vf[D];                                                                        \
            ROWLOAD(vf, KV_ROW(v_cache, j, ROWB), D);                                         \
            for (int i = 0; i < G; i++) {                                                       \
                float p = s[i][t];                                                              \
                for (int e = 0; e < D; e++) acc[i][e] += p * vf[e];                             \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int i = 0; i < G; i++) {                                                               \
        float inv = 1.f / sum[i];                                                               \
        for (int e = 0; e < D; e++) out[i * D + e] = STORE(acc[i][e] * inv);                    \
    }                                                                                           \
}

#define LOAD_F32(x) (x)
#define STORE_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)
#define STORE_BF16(x) f32_to_bf16(x)
#define ROUND_BF16(x) round_bf16_finite(x)   /* a value times its scale: always finite */

/* Float caches: the row as it is. */
#define ROW_F32(dst, p, D) do { const float *r_ = (const float *)(p);                           \
    for (int e = 0; e < D; e++) dst[e] = r_[e]; } while (0)
#define ROW_BF16(dst, p, D) do { const bf16_t *r_ = (const bf16_t *)(p);                        \
    for (int e = 0; e < D; e++) dst[e] = bf16_to_f32(r_[e]); } while (0)
/* Quantized caches (engine/kv_quant.py): D one-byte values, then the row's fp16 scale. A value
 * times its scale is exact in float32 (8 + 11 significant bits at most), then rounded to the
 * model's dtype: what the torch path's dequantized scratch holds, element for element. */
#define ROW_I8(dst, p, D, ROUND) do { const int8_t *r_ = (const int8_t *)(p);                   \
    float sc_ = row_scale((const unsigned char *)(p) + D);                                      \
    for (int e = 0; e < D; e++) dst[e] = ROUND((float)r_[e] * sc_); } while (0)
#define ROW_E4M3(dst, p, D, ROUND) do { const uint8_t *r_ = (const uint8_t *)(p);               \
    float sc_ = row_scale((const unsigned char *)(p) + D);                                      \
    uint32_t z_ = opaque_zero();                                                                \
    for (int e = 0; e < D; e++) dst[e] = ROUND(e4m3_to_f32(r_[e], z_) * sc_); } while (0)
#define ROW_I8_F32(dst, p, D) ROW_I8(dst, p, D, LOAD_F32)
#define ROW_I8_BF16(dst, p, D) ROW_I8(dst, p, D, ROUND_BF16)
#define ROW_E4M3_F32(dst, p, D) ROW_E4M3(dst, p, D, LOAD_F32)
#define ROW_E4M3_BF16(dst, p, D) ROW_E4M3(dst, p, D, ROUND_BF16)

#if DECODE8
/* e^x for x <= 0, 8 lanes: 2^k built in the exponent bits (k >= -126 here), where exp512 has
 * scalef. */
static inline __m256 exp256(__m256 x) {
    __m256 k, p;
    EXP_NONPOS_STEPS(_mm256, _mm256_round_ps, x, k, p);
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(k), _mm256_set1_epi32(127)),
                                  23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

static inline float hmax8(__m256 v) {
    __m128 a = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_max_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
}

static inline float hsum8(__m256 v) {
    __m128 a = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    a = _mm_add_ps(a, _mm_movehl_ps(a, a));
    return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}

/* The pool rows (block * bs + offset) of keys k0 .. k0 + 15 below L (k0 < L), with one division
 * per tile where KV_ROW divides per key (the speed-up expected from it did not show: within the
 * run-to-run noise on the Zen 2 EPYC). Keys from L on get key k0's row (never read as data: their
 * scores are masked or their rows zero). */
static inline void tile_rows(int64_t rows[16], const int32_t *table, int k0, int L, int bs) {
    int b = k0 / bs, off = k0 - b * bs;
    for (int k = 0; k < 16; k++) {
        rows[k] = k0 + k < L ? (int64_t)table[b] * bs + off : rows[0];
        if (++off == bs) { off = 0; b++; }
    }
}

/* Eight vectors of partial sums -> one vector whose lane k is the sum of a[k]'s lanes. */
static inline __m256 reduce8(const __m256 a[8]) {
    __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
    __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
    return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

/* Float32-query decode for AVX2 + FMA (and AVX-512 builds: DECODE8), which the compiler's
 * vectorization of DEFINE_HEAD gave too little of (on the project's Zen 2 EPYC 4.5 GFLOP/s: each (row, key) dot product was
 * reduced across the lanes on its own, and every K / V row copied first). One sequence, KV
 * heads h0 .. h1 - 1 (at most DECODE8_HEADS) at once, so that a tile's K / V rows, which
 * interleave the heads, are read from memory in one pass rather than one head's slice at a
 * time (a plain read of the two patterns: 8 GB/s against 13 here; the kernel itself did not get
 * measurably faster from it, docs/kernels.md). Per tile of 16 keys and per query row of those heads: the
 * scores 8 keys at a time (8 accumulators over the head dims, reduced together into one vector
 * with the keys in the lanes), the online softmax per tile (exp256; the row's maximum and sum
 * across the lanes), then P.V with the head dims in the lanes (up to 64 in registers), keys
 * ascending. A row's arithmetic does not depend on which heads share the call. The next tile's
 * rows are prefetched. Keys past the sequence are never read (their pointers repeat the tile's
 * first key, their P is 0). q and out point at head h0's first query row. */
#define DECODE8_HEADS 4
#define DEFINE_DECODE8(NAME, D, ROWB, ROWPTR)                                                   \
static void NAME(const float *q, const char *k_cache, const char *v_cache, const int32_t *table,\
                 int L, int bs, int hkv, int h0, int h1, float scale, float *out, int g) {      \
    enum { OC = ((D) < 64 ? (D) : 64) / 8, ROWS = 8 * DECODE8_HEADS };                         \
    float qs[ROWS][D] __attribute__((aligned(32))), o[ROWS][D] __attribute__((aligned(32)));    \
    float mx[ROWS], sum[ROWS], pb[8][16] __attribute__((aligned(32))), cs[8];                  \
    float kbuf[16][D] __attribute__((aligned(32))), vbuf[16][D] __attribute__((aligned(32)));   \
    const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0);                              \
    const __m256 ninf = _mm256_set1_ps(-INFINITY);                                              \
    const int rows = (h1 - h0) * g;                                                             \
    for (int i = 0; i < rows; i++) {                                                            \
        for (int e = 0; e < (D); e++) { qs[i][e] = q[i * (D) + e] * scale; o[i][e] = 0.f; }     \
        mx[i] = -INFINITY;                                                                      \
        sum[i] = 0.f;                                                                           \
    }                                                                                           \
    for (int j0 = 0; j0 < L; j0 += 16) {                                                        \
        int nk = L - j0 < 16 ? L - j0 : 16;                                                     \
        int64_t trow[16], nrow[16];                                                             \
        tile_rows(trow, table, j0, L, bs);                                                      \
        if (j0 + 16 < L) {   /* the next tile's rows, the heads of this call in one range each */ \
            tile_rows(nrow, table, j0 + 16, L, bs);                                             \
            for (int k = 0; k < 16 && j0 + 16 + k < L; k++) {                                   \
                int64_t first_ = (nrow[k] * hkv + h0) * (int64_t)(ROWB);                        \
                for (int64_t b = 0; b < (int64_t)(h1 - h0) * (ROWB); b += 64) {                 \
                    _mm_prefetch(k_cache + first_ + b, _MM_HINT_T0);                            \
                    _mm_prefetch(v_cache + first_ + b, _MM_HINT_T0);                            \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        const __m256 in0 = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(nk), lane));\
        const __m256 in1 = _mm256_castsi256_ps(                                                 \
            _mm256_cmpgt_epi32(_mm256_set1_epi32(nk - 8), lane));                               \
        for (int h = h0; h < h1; h++) {                                                         \
            const float *kr[16], *vr[16];                                                       \
            for (int k = 0; k < 16; k++) {                                                      \
                int64_t at_ = (trow[k] * hkv + h) * (int64_t)(ROWB);                            \
                kr[k] = ROWPTR(kbuf[k], k_cache + at_, D);                                      \
                vr[k] = ROWPTR(vbuf[k], v_cache + at_, D);                                      \
            }                                                                                   \
            const int i0 = (h - h0) * g;                                                        \
            for (int i = i0; i < i0 + g; i++) {   /* scores, every row of the head */           \
                for (int half = 0; half < 2; half++) {                                          \
                    __m256 a[8];                                                                \
                    for (int k = 0; k < 8; k++) a[k] = _mm256_setzero_ps();                     \
                    for (int c = 0; c < (D); c += 8) {                                          \
                        __m256 qc = _mm256_load_ps(qs[i] + c);                                  \
                        for (int k = 0; k < 8; k++)                                             \
                            a[k] = _mm256_fmadd_ps(qc, _mm256_loadu_ps(kr[half * 8 + k] + c), a[k]); \
                    }                                                                           \
                    _mm256_store_ps(pb[i - i0] + 8 * half, _mm256_blendv_ps(ninf, reduce8(a),   \
                                                                         half ? in1 : in0));    \
                }                                                                               \
            }                                                                                   \
            for (int i = i0; i < i0 + g; i++) {   /* online softmax step, every row */          \
                __m256 s0 = _mm256_load_ps(pb[i - i0]), s1 = _mm256_load_ps(pb[i - i0] + 8);    \
                float m = hmax8(_mm256_max_ps(s0, s1));                                         \
                m = m > mx[i] ? m : mx[i];                                                      \
                cs[i - i0] = exp_nonpositive(mx[i] - m);   /* rescale what came before */      \
                __m256 mv = _mm256_set1_ps(m);                                                  \
                __m256 p0 = _mm256_and_ps(in0, exp256(_mm256_sub_ps(s0, mv)));                  \
                __m256 p1 = _mm256_and_ps(in1, exp256(_mm256_sub_ps(s1, mv)));                  \
                sum[i] = sum[i] * cs[i - i0] + hsum8(_mm256_add_ps(p0, p1));                    \
                mx[i] = m;                                                                      \
                _mm256_store_ps(pb[i - i0], p0);                                                \
                _mm256_store_ps(pb[i - i0] + 8, p1);                                            \
            }                                                                                   \
            for (int i = i0; i < i0 + g; i++) {   /* P.V, every row */                          \
                __m256 cv = _mm256_set1_ps(cs[i - i0]);                                         \
                for (int c0 = 0; c0 < (D); c0 += OC * 8) {                                      \
                    __m256 ov[OC];                                                              \
                    for (int r = 0; r < OC; r++)                                                \
                        ov[r] = _mm256_mul_ps(_mm256_load_ps(o[i] + c0 + 8 * r), cv);           \
                    for (int k = 0; k < nk; k++) {                                              \
                        __m256 pk = _mm256_broadcast_ss(pb[i - i0] + k);                        \
                        for (int r = 0; r < OC; r++)                                            \
                            ov[r] = _mm256_fmadd_ps(pk, _mm256_loadu_ps(vr[k] + c0 + 8 * r), ov[r]); \
                    }                                                                           \
                    for (int r = 0; r < OC; r++) _mm256_store_ps(o[i] + c0 + 8 * r, ov[r]);     \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    }                                                                                           \
    for (int i = 0; i < rows; i++) {                                                            \
        __m256 inv = _mm256_set1_ps(1.f / sum[i]);                                              \
        for (int e = 0; e < (D); e += 8)                                                        \
            _mm256_storeu_ps(out + i * (D) + e, _mm256_mul_ps(_mm256_load_ps(o[i] + e), inv));  \
    }                                                                                           \
}                                                                                               \
/* the head_fn form: one KV head */                                                             \
static void NAME##_head(const float *q, const char *k_cache, const char *v_cache,              \
                        const int32_t *table, int L, int bs, int hkv, int h, float scale,      \
                        float *out, int g) {                                                    \
    NAME(q, k_cache, v_cache, table, L, bs, hkv, h, h + 1, scale, out, g);                      \
}
/* ROWPTR(buffer, cache row, D): where a key's / value's float32 row is read. A float cache's
 * in place; a quantized one's widened into the buffer first, exactly as the torch path's
 * dequantized scratch holds it (ROW_I8 / ROW_E4M3 above), so that the quantized head's output
 * is the float head's on that scratch, bit for bit. */
#define IN_PLACE_F32(buf, row, D) ((void)(buf), (const float *)(row))
#define WIDEN_I8_F32(buf, row, D) ({ ROW_I8_F32((buf), (row), D); (const float *)(buf); })
#define WIDEN_E4M3_F32(buf, row, D) ({ ROW_E4M3_F32((buf), (row), D); (const float *)(buf); })
#define DEFINE_DECODE8_D(D)                                                                     \
    DEFINE_DECODE8(decode8_f32_##D, D, 4 * (D), IN_PLACE_F32)                                   \
    DEFINE_DECODE8(decode8_i8_f32_##D, D, (D) + 2, WIDEN_I8_F32)                                \
    DEFINE_DECODE8(decode8_e4m3_f32_##D, D, (D) + 2, WIDEN_E4M3_F32)
DEFINE_DECODE8_D(16)
DEFINE_DECODE8_D(32)
DEFINE_DECODE8_D(64)
DEFINE_DECODE8_D(128)
/* The float32-query heads (every group size: the group is a runtime argument here). */
#define HEAD_F32(G, D) decode8_f32_##D##_head
#define HEAD_I8_F32(D) decode8_i8_f32_##D##_head
#define HEAD_E4M3_F32(D) decode8_e4m3_f32_##D##_head
typedef void (*heads_fn)(const void *, const void *, const void *, const int32_t *, int, int, int,
                         int, int, float, void *, int);
/* [head dim][cache kind]: the several-heads form, for the float32-query kinds (0, 2, 4). */
#define HEADS8_ROW(D) { (heads_fn)decode8_f32_##D, 0, (heads_fn)decode8_i8_f32_##D, 0,            \
                        (heads_fn)decode8_e4m3_f32_##D, 0 }
static const heads_fn HEADS8[4][6] = { HEADS8_ROW(16), HEADS8_ROW(32), HEADS8_ROW(64),
                                       HEADS8_ROW(128) };
#define DEFINE_HEAD_F32(G, D)
#define DEFINE_HEADS_Q_F32(D)
#else
#define HEAD_F32(G, D) head_f32_##G##_##D
#define HEAD_I8_F32(D) head_i8_f32_##D
#define HEAD_E4M3_F32(D) head_e4m3_f32_##D
#define DEFINE_HEAD_F32(G, D)                                                                   \
    DEFINE_HEAD(head_f32_##G##_##D, float, LOAD_F32, STORE_F32, 4 * D, ROW_F32, G, G, D)
#define DEFINE_HEADS_Q_F32(D)                                                                   \
    DEFINE_HEAD(head_i8_f32_##D, float, LOAD_F32, STORE_F32, D + 2, ROW_I8_F32, 8, g, D)        \
    DEFINE_HEAD(head_e4m3_f32_##D, float, LOAD_F32, STORE_F32, D + 2, ROW_E4M3_F32, 8, g, D)
#endif

#define DEFINE_BOTH(G, D)                                                                       \
    DEFINE_HEAD_F32(G, D)                                                                       \
    DEFINE_HEAD(head_bf16_##G##_##D, bf16_t, LOAD_BF16, STORE_BF16, 2 * D, ROW_BF16, G, G, D)

#define DEFINE_D(D) DEFINE_BOTH(1, D) DEFINE_BOTH(2, D) DEFINE_BOTH(3, D) DEFINE_BOTH(4, D)     \
                    DEFINE_BOTH(5, D) DEFINE_BOTH(6, D) DEFINE_BOTH(7, D) DEFINE_BOTH(8, D)     \
    DEFINE_HEADS_Q_F32(D)                                                                       \
    DEFINE_HEAD(head_i8_bf16_##D, bf16_t, LOAD_BF16, STORE_BF16, D + 2, ROW_I8_BF16, 8, g, D)   \
    DEFINE_HEAD(head_e4m3_bf16_##D, bf16_t, LOAD_BF16, STORE_BF16, D + 2, ROW_E4M3_BF16, 8, g, D)
DEFINE_D(16)
DEFINE_D(32)
DEFINE_D(64)
DEFINE_D(128)

typedef void (*head_fn)(const void *, const void *, const void *, const int32_t *, int, int, int,
                        int, float, void *, int);

/* [head dim][group - 1][cache kind]: float32, bf16, int8 + f32 query, int8 + bf16 query,
 * e4m3 + f32 query, e4m3 + bf16 query */
#define ENTRY(G, D) { (head_fn)HEAD_F32(G, D), (head_fn)head_bf16_##G##_##D,                   \
                      (head_fn)HEAD_I8_F32(D), (head_fn)head_i8_bf16_##D,                      \
                      (head_fn)HEAD_E4M3_F32(D), (head_fn)head_e4m3_bf16_##D }
#define ROW(D) { ENTRY(1, D), ENTRY(2, D), ENTRY(3, D), ENTRY(4, D), ENTRY(5, D), ENTRY(6, D),   \
                 ENTRY(7, D), ENTRY(8, D) }
#define KINDS 6
static const head_fn HEADS[4][8][KINDS] = { ROW(16), ROW(32), ROW(64), ROW(128) };

#if defined(__x86_64__) || defined(__i386__)
#include <xmmintrin.h>
/* Whether this thread reads denormal float inputs as zero (MXCSR.DAZ, set for example by
 * torch.set_flush_denormal(True)): e4m3_to_f32 passes codes with e = 0 through float
 * subnormals, which DAZ would read as 0. */
static int denormals_are_zero(void) { return (_mm_getcsr() & 0x0040) != 0; }
#else
static int denormals_are_zero(void) { return 0; }
#endif

/* Returns 0, -2 when (G, D, kind) has no instantiation, or -4 for an e4m3 cache on a thread
 * with denormals-are-zero set (the caller falls back: the torch path's conversion does not
 * depend on it). ``kind``: 0 float32, 1 bfloat16 (q, out and cache of that dtype); 2 / 3 an
 * int8 cache with a float32 / bfloat16 query and output; 4 / 5 the same with an e4m3 cache. */
int radixkv_paged_decode(const void *q, const void *k_cache, const void *v_cache,
                         const int32_t *block_tables, const int32_t *seq_lens, void *out,
                         int n, int hq, int hkv, int d, int bs, int max_blocks, float scale,
                         int kind, int part, int parts) {
    int g = hq / hkv, di;
    switch (d) {
        case 16: di = 0; break;
        case 32: di = 1; break;
        case 64: di = 2; break;
        case 128: di = 3; break;
        default: return -2;
    }
    if (g < 1 || g > 8 || g * hkv != hq || kind < 0 || kind >= KINDS) return -2;
    head_fn fn = HEADS[di][g - 1][kind];
    int64_t elem = kind % 2 ? 2 : 4;   /* the query's and output's element size */
    if (parts < 1 || part < 0 || part >= parts) return -2;
    if (kind >= 4 && denormals_are_zero()) return -4;
#if DECODE8
    if (HEADS8[di][kind]) {
        /* Part p takes the p-th contiguous run of the (sequence, KV head) pairs, a sequence's
         * heads DECODE8_HEADS at a time (they share the rows the K / V reads stream). */
        int64_t total = (int64_t)n * hkv, x = total * part / parts, end = total * (part + 1) / parts;
        while (x < end) {
            int s = (int)(x / hkv), h0 = (int)(x % hkv), h1 = h0 + DECODE8_HEADS;
            if (h1 > hkv) h1 = hkv;
            if (h1 - h0 > end - x) h1 = h0 + (int)(end - x);
            int64_t off = ((int64_t)s * hq + (int64_t)h0 * g) * d * elem;
            HEADS8[di][kind]((const char *)q + off, k_cache, v_cache,
                             block_tables + (int64_t)s * max_blocks, seq_lens[s], bs, hkv, h0, h1,
                             scale, (char *)out + off, g);
            x += h1 - h0;
        }
        return 0;
    }
#endif
    for (int s = 0; s < n; s++) {
        for (int h = 0; h < hkv; h++) {
            if ((s * hkv + h) % parts != part) continue;   /* another thread's (seq, head) */
            int64_t off = ((int64_t)s * hq + (int64_t)h * g) * d * elem;
            fn((const char *)q + off, k_cache, v_cache, block_tables + (int64_t)s * max_blocks,
               seq_lens[s], bs, hkv, h, scale, (char *)out + off, g);
        }
    }
    return 0;
}

/* ---------------------------------------------------------------- prefill / extend
 *
 * Query token i of a sequence (position cached + i, cached = seq_len - q_len) attends keys
 * [0, cached + i]. bfloat16 needs AVX512-BF16 (and AVX512F), float32 AVX512F or AVX2 with FMA
 * (DEFINE_PREFILL8: the same arithmetic in 8-lane halves); without them the entry points return
 * -3. Why: torch's CPU flash kernel runs this at 36-64 GFLOP/s on one core; the bf16 kernel at
 * ~250 on the project's Zen 5 EPYC; in float32 on an AVX2-only Zen 2 EPYC (its FMA peak ~41
 * GFLOP/s a core) the flash kernel at 17-21, the AVX2 kernel at 24-25 (kernels/native.py,
 * docs/kernels.md). */
/* An entry point built without the instructions it needs: -3, the caller takes the torch path. */
#define PREFILL_UNAVAILABLE(NAME)                                                               \
int NAME(const void *q, const void *k_cache, const void *v_cache, const int32_t *block_tables,  \
         const int32_t *cu_seqlens_q, const int32_t *seq_lens, void *out, int n, int hq,        \
         int hkv, int d, int bs, int max_blocks, float scale, void *scratch, int part,          \
         int parts) {                                                                           \
    (void)q; (void)k_cache; (void)v_cache; (void)block_tables; (void)cu_seqlens_q;              \
    (void)seq_lens; (void)out; (void)n; (void)hq; (void)hkv; (void)d; (void)bs;                 \
    (void)max_blocks; (void)scale; (void)scratch; (void)part; (void)parts;                      \
    return -3;                                                                                  \
}

#if VECTOR_LANES

/* 32-bit words of a key row, as the kernels read it: bf16 pairs, or float32 values. */
#define KW_BF16(D) ((D) / 2)
#define KW_F32(D) (D)

/* The prefill's pass over a (sequence, KV head)'s rows, which packs V (and a quantized K),
 * prefetches the rows PACK_AHEAD keys on: V into L1 for the pass itself, K into L2 for the
 * tiles that read it in place next (a head's K rows: ~77 KB at 600 keys x 64 dims in bf16). Why
 * as for PREFETCH_AHEAD: the rows are every hkv-th of the pool's and come from memory in a
 * step. */
#ifndef PACK_AHEAD
#define PACK_AHEAD 32
#endif
#define PACK_PREFETCH(kc, vc, j, L, ROWB) do {                                                  \
        int jp_ = (j) + PACK_AHEAD;                                                             \
        if (PACK_AHEAD > 0 && jp_ < (L)) {                                                      \
            int64_t prow_ = ((int64_t)table[jp_ / bs] * bs + jp_ % bs) * hkv + h;               \
            for (int64_t o_ = 0; o_ < (int64_t)(ROWB); o_ += 64) {                              \
                _mm_prefetch((const char *)(vc) + prow_ * (ROWB) + o_, _MM_HINT_T0);            \
                _mm_prefetch((const char *)(kc) + prow_ * (ROWB) + o_, _MM_HINT_T1);            \
            }                                                                                   \
        }                                                                                       \
    } while (0)
/* What is copied once per (sequence, KV head) before the tiles: K into rows of KW words (as
 * they are for float caches, widened for quantized ones) and V widened into float32 rows for
 * the P.V. PACK(key row, value row, K's destination row, V's float row, KW, D).
 * Why K is copied although a float cache's rows could be read in place: the tiles then find
 * key j's words at Kw + j KW (contiguous, rows past the sequence zero) instead of looking up
 * the block table and loading a row pointer per key in every tile of every query head; the
 * scores' broadcasts were a pointer load each. A (sequence, KV head)'s K is read by g query
 * heads x every query tile, so the copy is paid once for all of them: the bf16 prefill of 250
 * tokens over 600 cached (9 / 3 heads of 64) went from 1.46 to 1.30 ms, float32 2.71 -> 2.41 ms
 * (one thread, Zen 5; the same bits). */
#define COPY_K(kb, kw, KW) do { const uint32_t *kr_ = (const uint32_t *)(kb);                  \
    for (int p = 0; p < KW; p++) (kw)[p] = kr_[p]; } while (0)
#define PACK_F32(kb, vb, kw, vdst, KW, D) do { const float *vr_ = (const float *)(vb);         \
    COPY_K(kb, kw, KW); for (int e = 0; e < D; e++) (vdst)[e] = vr_[e]; } while (0)
#define PACK_BF16(kb, vb, kw, vdst, KW, D) do { const bf16_t *vr_ = (const bf16_t *)(vb);      \
    COPY_K(kb, kw, KW); for (int e = 0; e < D; e++) (vdst)[e] = bf16_to_f32(vr_[e]); }          \
    while (0)
/* Quantized caches, float32 query: K's widened values as float32 words. */
#define PACK_Q_F32(ROWLOAD, kb, vb, kw, vdst, KW, D) do { float kf_[D];                         \
    ROWLOAD(kf_, kb, D);                                                                        \
    for (int p = 0; p < KW; p++) (kw)[p] = f32_bits(kf_[p]);                                    \
    ROWLOAD(vdst, vb, D); } while (0)
/* bfloat16 query: the widened values are bf16-exact; pairs packed as a bf16 row's words are. */
#define PACK_Q_BF16(ROWLOAD, kb, vb, kw, vdst, KW, D) do { float kf_[D];                        \
    ROWLOAD(kf_, kb, D);                                                                        \
    for (int p = 0; p < KW; p++)                                                                \
        (kw)[p] = (f32_bits(kf_[2 * p]) >> 16) | (f32_bits(kf_[2 * p + 1]) & 0xffff0000u);      \
    ROWLOAD(vdst, vb, D); } while (0)
#define PACK_I8_F32(kb, vb, kw, vdst, KW, D) PACK_Q_F32(ROW_I8_F32, kb, vb, kw, vdst, KW, D)
#define PACK_E4M3_F32(kb, vb, kw, vdst, KW, D) PACK_Q_F32(ROW_E4M3_F32, kb, vb, kw, vdst, KW, D)
#define PACK_I8_BF16(kb, vb, kw, vdst, KW, D) PACK_Q_BF16(ROW_I8_BF16, kb, vb, kw, vdst, KW, D)
#define PACK_E4M3_BF16(kb, vb, kw, vdst, KW, D)                                                 \
    PACK_Q_BF16(ROW_E4M3_BF16, kb, vb, kw, vdst, KW, D)

typedef void (*prefill_fn)(const void *, const void *, const void *, const int32_t *, int, int,
                           int, int, int, float, void *, uint32_t *, int64_t, int, int);

/* Every sequence of a packed batch through FNS[head dim]; -2 when none is instantiated.
 * A sequence with one query row (a decode riding in a mixed batch) goes through the decode
 * head of cache kind KIND instead: the prefill kernel would pack all of its K and V and run 16
 * query rows per tile for the one it needs (a 1,000-key decode cost ~8x the decode head's
 * time), and the decode head reads the pool in place. Its output is then the same bits a pure
 * decode step gives (the decode head does not depend on the batch). Work split: a one-row
 * sequence's KV heads are numbered like its query heads' tiles (every parts-th). */
static int prefill_all(const prefill_fn fns[4], int64_t elem, int kind, const void *q,
                       const void *k_cache, const void *v_cache, const int32_t *block_tables,
                       const int32_t *cu_seqlens_q, const int32_t *seq_lens, void *out, int n,
                       int hq, int hkv, int d, int bs, int max_blocks, float scale,
                       void *scratch, int part, int parts) {
    int di;
    switch (d) {
        case 16: di = 0; break;
        case 32: di = 1; break;
        case 64: di = 2; break;
        case 128: di = 3; break;
        default: return -2;
    }
    if (hkv < 1 || hq % hkv != 0 || parts < 1 || part < 0 || part >= parts) return -2;
    const int g = hq / hkv;
    const head_fn decode = g <= 8 && kind >= 0 && kind < KINDS ? HEADS[di][g - 1][kind] : 0;
    int64_t tile0 = 0;   /* (query head, query tile) pairs of the sequences before */
    for (int s = 0; s < n; s++) {
        int start = cu_seqlens_q[s], q_len = cu_seqlens_q[s + 1] - start;
        if (q_len <= 0) continue;
        int64_t off = (int64_t)start * hq * d * elem;
        const int32_t *table = block_tables + (int64_t)s * max_blocks;
        if (q_len == 1 && decode) {
            for (int h = 0; h < hkv; h++) {
                if ((tile0 + h) % parts != part) continue;
                int64_t hoff = off + (int64_t)h * g * d * elem;
                decode((const char *)q + hoff, k_cache, v_cache, table, seq_lens[s], bs, hkv, h,
                       scale, (char *)out + hoff, g);
            }
        } else {
            fns[di]((const char *)q + off, k_cache, v_cache, table, q_len, seq_lens[s], bs, hq,
                    hkv, scale, (char *)out + off, scratch, tile0, part, parts);
        }
        tile0 += (int64_t)hq * ((q_len + 15) / 16);
    }
    return 0;
}
#endif

#if VECTOR_LANES == 16
static inline __m512 exp512(__m512 x) {   /* x <= 0 */
    __m512 k, p;
    EXP_NONPOS_STEPS(_mm512, _mm512_roundscale_ps, x, k, p);
    return _mm512_scalef_ps(p, k);
}

/* How each dtype forms the scores. KW: 32-bit words of a key row. Query rows are transposed
 * once per 16-row tile into qt[KW][16] (lanes = query rows); each key's words are broadcast
 * from its packed row (kb: the tile's first key's, KW words a key, see PACK above).
 * bf16: AVX512-BF16's dot product multiplies a pair exactly and accumulates in float32.
 * float32: one FMA per dimension. Per (row, key) the pairs / dimensions are accumulated in
 * ascending order, whichever operand is broadcast. KW: KW_BF16 / KW_F32 above. */
#define DOT_BF16(S, qt, kb, KW) for (int p = 0; p < (KW); p++) {                                \
        __m512bh qv_ = (__m512bh)_mm512_load_si512((qt) + p * 16);                              \
        for (int k = 0; k < 16; k++)                                                            \
            S[k] = _mm512_dpbf16_ps(S[k], qv_,                                                  \
                                    (__m512bh)_mm512_set1_epi32((int)(kb)[k * (KW) + p]));      \
    }
#define DOT_F32(S, qt, kb, KW) for (int p = 0; p < (KW); p++) {                                 \
        __m512 qv_ = _mm512_load_ps((const float *)(qt) + p * 16);                              \
        for (int k = 0; k < 16; k++)                                                            \
            S[k] = _mm512_fmadd_ps(qv_, _mm512_set1_ps(((const float *)(kb))[k * (KW) + p]),    \
                                   S[k]);                                                       \
    }
#define STORE16_BF16(op, v) _mm256_storeu_si256((__m256i *)(op), (__m256i)_mm512_cvtneps_pbh(v))
#define STORE16_F32(op, v) _mm512_storeu_ps((op), (v))

/* P.V per dtype. After a tile's softmax step, P (16 keys x 16 query rows, float32, a row per
 * lane of S[k]) is written where P.V reads it (PSTORE); then each output row i (its head dims
 * in the lanes, O[i] = ot + i * D) is rescaled by its c_i and accumulates the tile's keys in
 * ascending order (PV):
 *   float32: one FMA per key, P[k][i] broadcast against V row k (float32 rows, VROW_F32);
 *   bf16: one dot product per key pair, (P[2p][i], P[2p+1][i]) rounded to bf16 (round to
 *         nearest even) against V's key pairs interleaved into 32-bit words (bf16 V is exact
 *         in them): half the instructions of the FMAs. P is rounded as torch's CPU flash kernel
 *         and the GPU flash kernels round it for a bf16 P.V; the row sum l is the float32 P's.
 * VROW(Vs, j, tmp, D): where key j's V row is widened (float32: in place in the scratch; bf16:
 * a temporary that STOREV then packs into the pair words). */
#define VROW_F32(Vs, j, tmp, D) ((float *)(Vs) + (int64_t)(j) * (D))
#define VROW_BF16(Vs, j, tmp, D) (tmp)
#define STOREV_F32(Vs, j, vrow, D) do { (void)(vrow); } while (0)
#define STOREV_BF16(Vs, j, vrow, D) do {                                                        \
        uint16_t *vh_ = (uint16_t *)((uint32_t *)(Vs) + (int64_t)((j) / 2) * (D)) + (j) % 2;      \
        for (int e = 0; e < (D); e++) vh_[2 * e] = (uint16_t)(f32_bits((vrow)[e]) >> 16);        \
    } while (0)
#define PSTORE_F32(pbuf, S) for (int k = 0; k < 16; k++) _mm512_store_ps((float *)(pbuf) + k * 16, S[k]);
#define PSTORE_BF16(pbuf, S) for (int kp = 0; kp < 8; kp++) {                                   \
        __m512i pr_ = (__m512i)_mm512_cvtne2ps_pbh(S[2 * kp + 1], S[2 * kp]);                    \
        _mm512_store_si512((uint32_t *)(pbuf) + kp * 16, _mm512_permutexvar_epi16(PAIR_IDX, pr_)); \
    }
#define PV_F32(ot, pbuf, cs, Vs, k0, D) do {                                                    \
        const float *vt_ = (const float *)(Vs) + (int64_t)(k0) * (D);                            \
        const float *pf_ = (const float *)(pbuf);                                                \
        for (int c0 = 0; c0 < (D); c0 += 16) {                                                   \
            __m512 vk_[16];                                                                      \
            for (int k = 0; k < 16; k++) vk_[k] = _mm512_loadu_ps(vt_ + (int64_t)k * (D) + c0);  \
            for (int i = 0; i < 16; i++) {                                                       \
                __m512 acc = _mm512_mul_ps(_mm512_load_ps((ot) + i * (D) + c0),                  \
                                           _mm512_set1_ps((cs)[i]));                             \
                for (int k = 0; k < 16; k++)                                                     \
                    acc = _mm512_fmadd_ps(_mm512_set1_ps(pf_[k * 16 + i]), vk_[k], acc);         \
                _mm512_store_ps((ot) + i * (D) + c0, acc);                                       \
            }                                                                                    \
        }                                                                                        \
    } while (0)
#define PV_BF16(ot, pbuf, cs, Vs, k0, D) do {                                                   \
        const uint32_t *vp_ = (const uint32_t *)(Vs) + (int64_t)((k0) / 2) * (D);                \
        const uint32_t *pw_ = (const uint32_t *)(pbuf);                                          \
        for (int c0 = 0; c0 < (D); c0 += ((D) >= 32 ? 32 : 16)) {                                \
            if ((D) >= 32) {                                                                     \
                __m512i va_[8], vb_[8];                                                          \
                for (int kp = 0; kp < 8; kp++) {                                                 \
                    va_[kp] = _mm512_loadu_si512(vp_ + (int64_t)kp * (D) + c0);                  \
                    vb_[kp] = _mm512_loadu_si512(vp_ + (int64_t)kp * (D) + c0 + 16);             \
                }                                                                                \
                for (int i = 0; i < 16; i++) {                                                   \
                    __m512 ci_ = _mm512_set1_ps((cs)[i]);                                        \
                    __m512 a0 = _mm512_mul_ps(_mm512_load_ps((ot) + i * (D) + c0), ci_);         \
                    __m512 a1 = _mm512_mul_ps(_mm512_load_ps((ot) + i * (D) + c0 + 16), ci_);    \
                    for (int kp = 0; kp < 8; kp++) {                                             \
                        __m512bh b_ = (__m512bh)_mm512_set1_epi32((int)pw_[kp * 16 + i]);        \
                        a0 = _mm512_dpbf16_ps(a0, (__m512bh)va_[kp], b_);                        \
                        a1 = _mm512_dpbf16_ps(a1, (__m512bh)vb_[kp], b_);                        \
                    }                                                                            \
                    _mm512_store_ps((ot) + i * (D) + c0, a0);                                    \
                    _mm512_store_ps((ot) + i * (D) + c0 + 16, a1);                               \
                }                                                                                \
            } else {                                                                             \
                __m512i vk_[8];                                                                  \
                for (int kp = 0; kp < 8; kp++)                                                   \
                    vk_[kp] = _mm512_loadu_si512(vp_ + (int64_t)kp * (D) + c0);                  \
                for (int i = 0; i < 16; i++) {                                                   \
                    __m512 acc = _mm512_mul_ps(_mm512_load_ps((ot) + i * (D) + c0),              \
                                               _mm512_set1_ps((cs)[i]));                         \
                    for (int kp = 0; kp < 8; kp++)                                               \
                        acc = _mm512_dpbf16_ps(acc, (__m512bh)vk_[kp],                           \
                                               (__m512bh)_mm512_set1_epi32((int)pw_[kp * 16 + i])); \
                    _mm512_store_ps((ot) + i * (D) + c0, acc);                                   \
                }                                                                                \
            }                                                                                    \
        }                                                                                        \
    } while (0)

/* One sequence, every head. Per KV head, V is widened once into rows the P.V reads (float32
 * rows, or bf16 key pairs: see PV above), and a quantized K into rows of KW words. Each query
 * head then walks tiles of 16 query rows x 16 keys, the query rows in the lanes:
 *   S[k] (16 rows in the lanes) = DOT(rows, key k)        bf16 pairs / float32 FMAs
 *   online softmax per row in float32, vertical over the 16 keys (exp512; no horizontal
 *   reductions: a row's maximum and sum are lane-wise)
 *   O[i] = O[i] * c_i + sum_k P[k][i] * V[k]             PV: keys ascending, float32 sums
 * Query rows past q_len and keys past a row's causal bound are masked out; a key past the
 * sequence reads a zero row. scratch: (16 KW + 16 D) * ceil(seq_len / 16) 32-bit words
 * (kernels/native.py sizes it; the bf16 V takes half of its 16 D). */
#define DEFINE_PREFILL(NAME, T, KW, PACK, ROWB, DOT, STORE16, D, VROW, STOREV, PSTORE, PV) \
static void NAME(const T *q, const char *kc, const char *vc, const int32_t *table, \
    int q_len, int L, int bs, int hq, int hkv, float scale, T *out, uint32_t *scratch, \
    int64_t tile0, int part, int parts) { \
    int g = hq / hkv, cached = L - q_len, nt = (L + 15) / 16, qtiles = (q_len + 15) / 16; \
    uint32_t *Kw = scratch;                                  /* [nt * 16][KW] K rows */ \
    uint32_t *Vs = scratch + (int64_t)nt * KW * 16;          /* V rows for PV */ \
    const __m512i lane = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0); \
    const __m512i PAIR_IDX = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, \
        25, 9, 24, 8, 23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0); \
    (void)PAIR_IDX; \
    for (int h = 0; h < hkv; h++) { \
        /* tiles are numbered from tile0 over (query head, query tile); this part takes every \
           parts-th one (causal tiles grow with i0, so round robin balances) */ \
        int64_t first = tile0 + (int64_t)h * g * qtiles, count = (int64_t)g * qtiles; \
        if (count < parts && (((part - first) % parts) + parts) % parts >= count) continue; \
        for (int j = 0; j < nt * 16; j++) { \
            float vtmp[D]; \
            float *vdst = VROW(Vs, j, vtmp, D); \
            uint32_t *kdst = Kw + (int64_t)j * KW; \
            if (j < L) { \
                int64_t row = ((int64_t)table[j / bs] * bs + j % bs) * hkv + h; \
                PACK_PREFETCH(kc, vc, j, L, ROWB); \
                PACK(kc + row * (ROWB), vc + row * (ROWB), kdst, vdst, KW, D); \
            } else { \
                for (int p = 0; p < KW; p++) kdst[p] = 0u; \
                for (int e = 0; e < D; e++) vdst[e] = 0.f; \
            } \
            STOREV(Vs, j, vdst, D); \
        } \
        for (int hh = h * g; hh < (h + 1) * g; hh++) { \
            for (int i0 = 0; i0 < q_len; i0 += 16) { \
                int64_t tile = tile0 + (int64_t)hh * qtiles + i0 / 16; \
                if (tile % parts != part) continue; \
                int nr = q_len - i0 < 16 ? q_len - i0 : 16; \
                __mmask16 rows = (__mmask16)((1u << nr) - 1u); \
                uint32_t qt[KW * 16] __attribute__((aligned(64))); \
                float ot[16 * D] __attribute__((aligned(64))); \
                float pbuf[256] __attribute__((aligned(64))); \
                float cs[16] __attribute__((aligned(64))); \
                for (int i = 0; i < 16; i++) { \
                    const uint32_t *qr = (const uint32_t *)(q + ((int64_t)(i0 + i) * hq + hh) * D); \
                    for (int p = 0; p < KW; p++) qt[p * 16 + i] = i < nr ? qr[p] : 0u; \
                } \
                for (int e = 0; e < D * 16; e++) ot[e] = 0.f; \
                __m512 mv = _mm512_set1_ps(-INFINITY), lv = _mm512_setzero_ps(); \
                int last = cached + i0 + nr - 1; \
                for (int t = 0; t <= last / 16; t++) { \
                    int k0 = t * 16; \
                    __m512 S[16]; \
                    for (int k = 0; k < 16; k++) S[k] = _mm512_setzero_ps(); \
                    DOT(S, qt, Kw + (int64_t)k0 * KW, KW) \
                    __mmask16 vis[16]; \
                    __m512 mnew = mv; \
                    for (int k = 0; k < 16; k++) { \
                        /* row i sees key k0 + k when k0 + k <= cached + i0 + i */ \
                        int lim = k0 + k - cached - i0; \
                        __mmask16 m = lim <= 0 ? rows : (lim > 15 ? 0 : \
                            _mm512_mask_cmpge_epi32_mask(rows, lane, _mm512_set1_epi32(lim))); \
                        vis[k] = m; \
                        S[k] = _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), m, \
                                                  _mm512_mul_ps(S[k], _mm512_set1_ps(scale))); \
                        mnew = _mm512_max_ps(mnew, S[k]); \
                    } \
                    /* rows with a maximum: rescale by exp(old - new); a row's first keys: 0 */ \
                    __mmask16 live = _mm512_cmp_ps_mask(mnew, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ); \
                    __mmask16 had = _mm512_cmp_ps_mask(mv, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ); \
                    __m512 c = _mm512_maskz_mov_ps(had & live, exp512(_mm512_sub_ps(mv, mnew))); \
                    __m512 msafe = _mm512_maskz_mov_ps(live, mnew); \
                    __m512 sum = _mm512_setzero_ps(); \
                    for (int k = 0; k < 16; k++) { \
                        S[k] = _mm512_maskz_mov_ps(vis[k], exp512(_mm512_sub_ps( \
                            _mm512_maskz_mov_ps(vis[k], S[k]), msafe))); \
                        sum = _mm512_add_ps(sum, S[k]); \
                    } \
                    lv = _mm512_add_ps(_mm512_mul_ps(lv, c), sum); \
                    mv = mnew; \
                    _mm512_store_ps(cs, c); \
                    PSTORE(pbuf, S) \
                    PV(ot, pbuf, cs, Vs, k0, D); \
                } \
                _mm512_store_ps(cs, _mm512_div_ps(_mm512_set1_ps(1.f), lv)); \
                for (int i = 0; i < nr; i++) { \
                    T *op = out + ((int64_t)(i0 + i) * hq + hh) * D; \
                    for (int c0 = 0; c0 < D; c0 += 16) \
                        STORE16(op + c0, _mm512_mul_ps(_mm512_load_ps(ot + i * D + c0), \
                                                       _mm512_set1_ps(cs[i]))); \
                } \
            } \
        } \
    } \
}

#define DEFINE_PREFILL_F32(D) \
    DEFINE_PREFILL(prefill_f32_##D, float, KW_F32(D), PACK_F32, 4 * (D), DOT_F32, \
                   STORE16_F32, D, VROW_F32, STOREV_F32, PSTORE_F32, PV_F32) \
    DEFINE_PREFILL(prefill_i8_f32_##D, float, KW_F32(D), PACK_I8_F32, (D) + 2, DOT_F32, \
                   STORE16_F32, D, VROW_F32, STOREV_F32, PSTORE_F32, PV_F32) \
    DEFINE_PREFILL(prefill_e4m3_f32_##D, float, KW_F32(D), PACK_E4M3_F32, (D) + 2, DOT_F32, \
                   STORE16_F32, D, VROW_F32, STOREV_F32, PSTORE_F32, PV_F32)
#elif VECTOR_LANES == 8
/* AVX2 + FMA: 8 float lanes and 16 vector registers, float32 queries only (bf16 needs
 * AVX512-BF16's dot products). The arithmetic is the AVX-512 kernel's, lane for lane: a tile's
 * 16 query rows sit in two vectors (rows 0-7, 8-15) where AVX-512 has one; its 16 keys' scores
 * are formed 6, 6 and 4 keys at a time (12 accumulators, what the registers hold beside the two
 * query vectors and a broadcast: the shape of an AVX2 GEMM's micro-kernel) and kept in sbuf; the
 * online softmax steps once per 16 keys with the same maximum, exp (exp256: exp512's steps)
 * and sums in the same order; P.V takes 6, 6 and 4 rows at a time, 16 head dims each, the keys
 * ascending. So a row's output is meant to be the same bits on either build (tested against the
 * reference here; the equality itself needs a machine with both). */

/* The lanes of rows r0 .. r0 + 7 (ROWS: those below q_len) that see key j: row i sees key j
 * when j <= cached + i. */
#define VIS8(j, r0, ROWS) _mm256_castsi256_ps(                                                  \
    (j) - cached - (r0) <= 0 ? (ROWS) : ((j) - cached - (r0) > 7 ? _mm256_setzero_si256() :     \
        _mm256_and_si256((ROWS), _mm256_cmpgt_epi32(lane, _mm256_set1_epi32((j) - cached - (r0) - 1)))))

/* Scores of keys k0 + KB .. + NK - 1 against the tile's 16 rows (qt: [D][16]), scaled and
 * masked into sbuf[key][16 rows]; the rows' running maxima ma / mb take them in. */
#define SCORES8(NK, KB, D) do {                                                                 \
        __m256 sa_[NK], sb_[NK];                                                                \
        const float *kr_[NK];                                                                   \
        for (int k = 0; k < (NK); k++) {                                                        \
            kr_[k] = (const float *)(Kw + (int64_t)(k0 + (KB) + k) * (D));                      \
            sa_[k] = sb_[k] = _mm256_setzero_ps();                                              \
        }                                                                                       \
        for (int p = 0; p < (D); p++) {                                                         \
            __m256 qa_ = _mm256_load_ps(qt + p * 16), qb_ = _mm256_load_ps(qt + p * 16 + 8);    \
            for (int k = 0; k < (NK); k++) {                                                    \
                __m256 b_ = _mm256_broadcast_ss(kr_[k] + p);                                    \
                sa_[k] = _mm256_fmadd_ps(qa_, b_, sa_[k]);                                      \
                sb_[k] = _mm256_fmadd_ps(qb_, b_, sb_[k]);                                      \
            }                                                                                   \
        }                                                                                       \
        for (int k = 0; k < (NK); k++) {                                                        \
            int j = k0 + (KB) + k;                                                              \
            sa_[k] = _mm256_blendv_ps(ninf, _mm256_mul_ps(sa_[k], vscale), VIS8(j, i0, rows_a)); \
            sb_[k] = _mm256_blendv_ps(ninf, _mm256_mul_ps(sb_[k], vscale),                      \
                                      VIS8(j, i0 + 8, rows_b));                                 \
            ma = _mm256_max_ps(ma, sa_[k]);                                                     \
            mb = _mm256_max_ps(mb, sb_[k]);                                                     \
            _mm256_store_ps(sbuf + ((KB) + k) * 16, sa_[k]);                                    \
            _mm256_store_ps(sbuf + ((KB) + k) * 16 + 8, sb_[k]);                                \
        }                                                                                       \
    } while (0)

/* One half's online-softmax step (rows r0 .. r0 + 7 at lanes OFF of sbuf): P in place of the
 * scores, c (the rescale of what came before) into cs + OFF, the running max / sum updated. */
#define SOFTMAX8(MV, LV, MNEW, OFF, r0, ROWS) do {                                              \
        __m256 live_ = _mm256_cmp_ps(MNEW, ninf, _CMP_NEQ_OQ);                                  \
        __m256 had_ = _mm256_cmp_ps(MV, ninf, _CMP_NEQ_OQ);                                     \
        __m256 c_ = _mm256_and_ps(_mm256_and_ps(had_, live_), exp256(_mm256_sub_ps(MV, MNEW))); \
        __m256 msafe_ = _mm256_and_ps(live_, MNEW), sum_ = _mm256_setzero_ps();                 \
        for (int k = 0; k < 16; k++) {                                                          \
            __m256 vis_ = VIS8(k0 + k, r0, ROWS);                                               \
            __m256 pk_ = _mm256_and_ps(vis_, exp256(_mm256_sub_ps(                              \
                _mm256_and_ps(vis_, _mm256_load_ps(sbuf + k * 16 + (OFF))), msafe_)));          \
            sum_ = _mm256_add_ps(sum_, pk_);                                                    \
            _mm256_store_ps(sbuf + k * 16 + (OFF), pk_);                                        \
        }                                                                                       \
        LV = _mm256_add_ps(_mm256_mul_ps(LV, c_), sum_);                                        \
        MV = MNEW;                                                                              \
        _mm256_store_ps(cs + (OFF), c_);                                                        \
    } while (0)

/* O[i] = O[i] * c_i + sum_k P[k][i] V[k] for rows RB .. RB + NR - 1 (skipped past the tile's
 * rows), 16 head dims at a time, the 16 keys ascending. */
#define PV8(NR, RB, D) do {                                                                     \
        if ((RB) < nr) {                                                                        \
            for (int c0 = 0; c0 < (D); c0 += 16) {                                              \
                __m256 a_[NR][2];                                                               \
                for (int r = 0; r < (NR); r++) {                                                \
                    __m256 cr_ = _mm256_broadcast_ss(cs + (RB) + r);                            \
                    a_[r][0] = _mm256_mul_ps(_mm256_load_ps(ot + ((RB) + r) * (D) + c0), cr_);  \
                    a_[r][1] = _mm256_mul_ps(_mm256_load_ps(ot + ((RB) + r) * (D) + c0 + 8), cr_); \
                }                                                                               \
                for (int k = 0; k < 16; k++) {                                                  \
                    const float *vr_ = Vs + (int64_t)(k0 + k) * (D) + c0;                       \
                    __m256 va_ = _mm256_loadu_ps(vr_), vb_ = _mm256_loadu_ps(vr_ + 8);          \
                    for (int r = 0; r < (NR); r++) {                                            \
                        __m256 p_ = _mm256_broadcast_ss(sbuf + k * 16 + (RB) + r);              \
                        a_[r][0] = _mm256_fmadd_ps(p_, va_, a_[r][0]);                          \
                        a_[r][1] = _mm256_fmadd_ps(p_, vb_, a_[r][1]);                          \
                    }                                                                           \
                }                                                                               \
                for (int r = 0; r < (NR); r++) {                                                \
                    _mm256_store_ps(ot + ((RB) + r) * (D) + c0, a_[r][0]);                      \
                    _mm256_store_ps(ot + ((RB) + r) * (D) + c0 + 8, a_[r][1]);                  \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
    } while (0)

/* One sequence, every head, as DEFINE_PREFILL (same scratch layout, tiles and work split). */
#define DEFINE_PREFILL8(NAME, PACK, ROWB, D) \
static void NAME(const float *q, const char *kc, const char *vc, const int32_t *table, \
    int q_len, int L, int bs, int hq, int hkv, float scale, float *out, uint32_t *scratch, \
    int64_t tile0, int part, int parts) { \
    int g = hq / hkv, cached = L - q_len, nt = (L + 15) / 16, qtiles = (q_len + 15) / 16; \
    uint32_t *Kw = scratch;                                  /* [nt * 16][D] K rows */ \
    float *Vs = (float *)(scratch + (int64_t)nt * (D) * 16); /* V rows for P.V */ \
    const __m256i lane = _mm256_set_epi32(7, 6, 5, 4, 3, 2, 1, 0); \
    const __m256 ninf = _mm256_set1_ps(-INFINITY), vscale = _mm256_set1_ps(scale); \
    for (int h = 0; h < hkv; h++) { \
        int64_t first = tile0 + (int64_t)h * g * qtiles, count = (int64_t)g * qtiles; \
        if (count < parts && (((part - first) % parts) + parts) % parts >= count) continue; \
        for (int j = 0; j < nt * 16; j++) { \
            float *vdst = Vs + (int64_t)j * (D); \
            uint32_t *kdst = Kw + (int64_t)j * (D); \
            if (j < L) { \
                int64_t row = ((int64_t)table[j / bs] * bs + j % bs) * hkv + h; \
                PACK_PREFETCH(kc, vc, j, L, ROWB); \
                PACK(kc + row * (ROWB), vc + row * (ROWB), kdst, vdst, D, D); \
            } else { \
                for (int p = 0; p < (D); p++) kdst[p] = 0u; \
                for (int e = 0; e < (D); e++) vdst[e] = 0.f; \
            } \
        } \
        for (int hh = h * g; hh < (h + 1) * g; hh++) { \
            for (int i0 = 0; i0 < q_len; i0 += 16) { \
                int64_t tile = tile0 + (int64_t)hh * qtiles + i0 / 16; \
                if (tile % parts != part) continue; \
                int nr = q_len - i0 < 16 ? q_len - i0 : 16; \
                const __m256i rows_a = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr), lane); \
                const __m256i rows_b = _mm256_cmpgt_epi32(_mm256_set1_epi32(nr - 8), lane); \
                float qt[(D) * 16] __attribute__((aligned(32))); \
                float ot[16 * (D)] __attribute__((aligned(32))); \
                float sbuf[16 * 16] __attribute__((aligned(32))); \
                float cs[16] __attribute__((aligned(32))); \
                for (int i = 0; i < 16; i++) { \
                    const float *qr = q + ((int64_t)(i0 + i) * hq + hh) * (D); \
                    for (int p = 0; p < (D); p++) qt[p * 16 + i] = i < nr ? qr[p] : 0.f; \
                } \
                for (int e = 0; e < 16 * (D); e++) ot[e] = 0.f; \
                __m256 mva = ninf, mvb = ninf, lva = _mm256_setzero_ps(), lvb = lva; \
                int last = cached + i0 + nr - 1; \
                for (int t = 0; t <= last / 16; t++) { \
                    int k0 = t * 16; \
                    __m256 ma = mva, mb = mvb; \
                    SCORES8(6, 0, D); \
                    SCORES8(6, 6, D); \
                    SCORES8(4, 12, D); \
                    SOFTMAX8(mva, lva, ma, 0, i0, rows_a); \
                    SOFTMAX8(mvb, lvb, mb, 8, i0 + 8, rows_b); \
                    PV8(6, 0, D); \
                    PV8(6, 6, D); \
                    PV8(4, 12, D); \
                } \
                _mm256_store_ps(cs, _mm256_div_ps(_mm256_set1_ps(1.f), lva)); \
                _mm256_store_ps(cs + 8, _mm256_div_ps(_mm256_set1_ps(1.f), lvb)); \
                for (int i = 0; i < nr; i++) { \
                    float *op = out + ((int64_t)(i0 + i) * hq + hh) * (D); \
                    for (int c0 = 0; c0 < (D); c0 += 8) \
                        _mm256_storeu_ps(op + c0, _mm256_mul_ps( \
                            _mm256_load_ps(ot + i * (D) + c0), _mm256_broadcast_ss(cs + i))); \
                } \
            } \
        } \
    } \
}

#define DEFINE_PREFILL_F32(D) \
    DEFINE_PREFILL8(prefill_f32_##D, PACK_F32, 4 * (D), D) \
    DEFINE_PREFILL8(prefill_i8_f32_##D, PACK_I8_F32, (D) + 2, D) \
    DEFINE_PREFILL8(prefill_e4m3_f32_##D, PACK_E4M3_F32, (D) + 2, D)
#endif

#if VECTOR_LANES
DEFINE_PREFILL_F32(16)
DEFINE_PREFILL_F32(32)
DEFINE_PREFILL_F32(64)
DEFINE_PREFILL_F32(128)
static const prefill_fn PREFILL_F32[4] = { (prefill_fn)prefill_f32_16, (prefill_fn)prefill_f32_32,
                                           (prefill_fn)prefill_f32_64, (prefill_fn)prefill_f32_128 };
static const prefill_fn PREFILL_I8_F32[4] = {
    (prefill_fn)prefill_i8_f32_16, (prefill_fn)prefill_i8_f32_32, (prefill_fn)prefill_i8_f32_64,
    (prefill_fn)prefill_i8_f32_128 };
static const prefill_fn PREFILL_E4M3_F32[4] = {
    (prefill_fn)prefill_e4m3_f32_16, (prefill_fn)prefill_e4m3_f32_32,
    (prefill_fn)prefill_e4m3_f32_64, (prefill_fn)prefill_e4m3_f32_128 };

int radixkv_paged_prefill_f32(const void *q, const void *k_cache, const void *v_cache,
                              const int32_t *block_tables, const int32_t *cu_seqlens_q,
                              const int32_t *seq_lens, void *out, int n, int hq, int hkv, int d,
                              int bs, int max_blocks, float scale, void *scratch, int part,
                              int parts) {
    return prefill_all(PREFILL_F32, 4, 0, q, k_cache, v_cache, block_tables, cu_seqlens_q,
                       seq_lens, out, n, hq, hkv, d, bs, max_blocks, scale, scratch, part, parts);
}
#else
PREFILL_UNAVAILABLE(radixkv_paged_prefill_f32)
#endif

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define DEFINE_PREFILL_BF16(D) \
    DEFINE_PREFILL(prefill_bf16_##D, bf16_t, KW_BF16(D), PACK_BF16, 2 * (D), DOT_BF16, \
                   STORE16_BF16, D, VROW_BF16, STOREV_BF16, PSTORE_BF16, PV_BF16) \
    DEFINE_PREFILL(prefill_i8_bf16_##D, bf16_t, KW_BF16(D), PACK_I8_BF16, (D) + 2, DOT_BF16, \
                   STORE16_BF16, D, VROW_BF16, STOREV_BF16, PSTORE_BF16, PV_BF16) \
    DEFINE_PREFILL(prefill_e4m3_bf16_##D, bf16_t, KW_BF16(D), PACK_E4M3_BF16, (D) + 2, \
                   DOT_BF16, STORE16_BF16, D, VROW_BF16, STOREV_BF16, PSTORE_BF16, PV_BF16)
DEFINE_PREFILL_BF16(16)
DEFINE_PREFILL_BF16(32)
DEFINE_PREFILL_BF16(64)
DEFINE_PREFILL_BF16(128)
static const prefill_fn PREFILL_BF16[4] = {
    (prefill_fn)prefill_bf16_16, (prefill_fn)prefill_bf16_32, (prefill_fn)prefill_bf16_64,
    (prefill_fn)prefill_bf16_128 };
static const prefill_fn PREFILL_I8_BF16[4] = {
    (prefill_fn)prefill_i8_bf16_16, (prefill_fn)prefill_i8_bf16_32,
    (prefill_fn)prefill_i8_bf16_64, (prefill_fn)prefill_i8_bf16_128 };
static const prefill_fn PREFILL_E4M3_BF16[4] = {
    (prefill_fn)prefill_e4m3_bf16_16, (prefill_fn)prefill_e4m3_bf16_32,
    (prefill_fn)prefill_e4m3_bf16_64, (prefill_fn)prefill_e4m3_bf16_128 };
#define HAVE_PREFILL_BF16 1

int radixkv_paged_prefill_bf16(const void *q, const void *k_cache, const void *v_cache,
                               const int32_t *block_tables, const int32_t *cu_seqlens_q,
                               const int32_t *seq_lens, void *out, int n, int hq, int hkv, int d,
                               int bs, int max_blocks, float scale, void *scratch, int part,
                               int parts) {
    return prefill_all(PREFILL_BF16, 2, 1, q, k_cache, v_cache, block_tables, cu_seqlens_q,
                       seq_lens, out, n, hq, hkv, d, bs, max_blocks, scale, scratch, part, parts);
}
#else
PREFILL_UNAVAILABLE(radixkv_paged_prefill_bf16)
#endif

/* Prefill / extend over an int8 or e4m3 cache read in place. ``kind`` as in decode: 2 / 3 int8
 * with a float32 / bfloat16 query and output, 4 / 5 e4m3. -3 when built without the
 * instructions that query dtype needs, -4 for e4m3 with denormals-are-zero set, -2 otherwise
 * unsupported. Otherwise as radixkv_paged_prefill_f32. */
#if VECTOR_LANES
int radixkv_paged_prefill_quantized(const void *q, const void *k_cache, const void *v_cache,
                                    const int32_t *block_tables, const int32_t *cu_seqlens_q,
                                    const int32_t *seq_lens, void *out, int n, int hq, int hkv,
                                    int d, int bs, int max_blocks, float scale, void *scratch,
                                    int part, int parts, int kind) {
    const prefill_fn *fns = 0;
    if (kind < 2 || kind > 5) return -2;
    if (kind >= 4 && denormals_are_zero()) return -4;
    if (kind == 2) fns = PREFILL_I8_F32;
    if (kind == 4) fns = PREFILL_E4M3_F32;
#ifdef HAVE_PREFILL_BF16
    if (kind == 3) fns = PREFILL_I8_BF16;
    if (kind == 5) fns = PREFILL_E4M3_BF16;
#endif
    if (!fns) return -3;
    return prefill_all(fns, kind % 2 ? 2 : 4, kind, q, k_cache, v_cache, block_tables,
                       cu_seqlens_q, seq_lens, out, n, hq, hkv, d, bs, max_blocks, scale, scratch,
                       part, parts);
}
#else
int radixkv_paged_prefill_quantized(const void *q, const void *k_cache, const void *v_cache,
                                    const int32_t *block_tables, const int32_t *cu_seqlens_q,
                                    const int32_t *seq_lens, void *out, int n, int hq, int hkv,
                                    int d, int bs, int max_blocks, float scale, void *scratch,
                                    int part, int parts, int kind) {
    (void)q; (void)k_cache; (void)v_cache; (void)block_tables; (void)cu_seqlens_q;
    (void)seq_lens; (void)out; (void)n; (void)hq; (void)hkv; (void)d; (void)bs;
    (void)max_blocks; (void)scale; (void)scratch; (void)part; (void)parts; (void)kind;
    return -3;
}
#endif

/* Every part of a prefill call on the calling thread's OpenMP team: torch's own runtime when
 * the library is built with -fopenmp and loaded into a process that already has torch's
 * libgomp (kernels/native.py checks there is one), so the parts run on the same threads as the
 * GEMMs around them, caught while they still poll, instead of on a Python pool that hands the
 * GIL between threads (~0.1 ms a call). Part p packs its K/V into scratch + p * scratch_words;
 * each row is computed by the same code whatever the split. Returns 0, or the first part's
 * nonzero code; -5 without OpenMP (the caller splits another way). */
typedef int (*prefill_entry)(const void *, const void *, const void *, const int32_t *,
                             const int32_t *, const int32_t *, void *, int, int, int, int, int,
                             int, float, void *, int, int);

/* The most parts a *_parallel call takes (kernels/native.py clamps to it). */
#define MAX_PARTS 256

#ifdef _OPENMP
/* Run CALL (an expression of the part p) for every part on the calling thread's team; return
 * the first part's nonzero code, else 0. */
#define RUN_PARTS(CALL)                                                                         \
    do {                                                                                        \
        int rcs[MAX_PARTS];                                                                     \
        if (parts < 1 || parts > MAX_PARTS) return -2;                                          \
        _Pragma("omp parallel for num_threads(parts) schedule(static, 1)")                      \
        for (int p = 0; p < parts; ++p) rcs[p] = (CALL);                                        \
        for (int p = 0; p < parts; ++p)                                                         \
            if (rcs[p]) return rcs[p];                                                          \
        return 0;                                                                               \
    } while (0)
#endif

int radixkv_prefill_parallel(prefill_entry fn, const void *q, const void *k_cache,
                             const void *v_cache, const int32_t *block_tables,
                             const int32_t *cu_seqlens_q, const int32_t *seq_lens, void *out,
                             int n, int hq, int hkv, int d, int bs, int max_blocks, float scale,
                             int32_t *scratch, int64_t scratch_words, int parts) {
#ifdef _OPENMP
    RUN_PARTS(fn(q, k_cache, v_cache, block_tables, cu_seqlens_q, seq_lens, out, n, hq, hkv, d,
                 bs, max_blocks, scale, scratch + p * scratch_words, p, parts));
#else
    (void)fn; (void)q; (void)k_cache; (void)v_cache; (void)block_tables; (void)cu_seqlens_q;
    (void)seq_lens; (void)out; (void)n; (void)hq; (void)hkv; (void)d; (void)bs;
    (void)max_blocks; (void)scale; (void)scratch; (void)scratch_words; (void)parts;
    return -5;
#endif
}

/* radixkv_paged_decode's parts on the calling thread's OpenMP team, as
 * radixkv_prefill_parallel (the decode packs nothing: no scratch). */
int radixkv_decode_parallel(const void *q, const void *k_cache, const void *v_cache,
                            const int32_t *block_tables, const int32_t *seq_lens, void *out,
                            int n, int hq, int hkv, int d, int bs, int max_blocks, float scale,
                            int kind, int parts) {
#ifdef _OPENMP
    RUN_PARTS(radixkv_paged_decode(q, k_cache, v_cache, block_tables, seq_lens, out, n, hq, hkv,
                                   d, bs, max_blocks, scale, kind, p, parts));
#else
    (void)q; (void)k_cache; (void)v_cache; (void)block_tables; (void)seq_lens; (void)out;
    (void)n; (void)hq; (void)hkv; (void)d; (void)bs; (void)max_blocks; (void)scale;
    (void)kind; (void)parts;
    return -5;
#endif
}

/* Whether this library was built with OpenMP (the *_parallel entries can split). */
int radixkv_native_openmp(void) {
#ifdef _OPENMP
    return 1;
#else
    return 0;
#endif
}

/* The version of this file's interface; kernels/native.py refuses a library that differs. */
int radixkv_native_abi(void) { return 8; }
