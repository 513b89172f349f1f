/* Paged decode attention for the CPU: one query token per sequence, read through block tables.
 *
 * Why native code: on the CPU a decode step's attention is many tiny problems (per sequence and
 * KV head: G query rows against L keys of head_dim D). torch's SDPA pays a fixed cost per
 * (sequence, head) that dwarfs the arithmetic, and the torch path must first gather every
 * sequence's K/V blocks into a contiguous copy. This kernel reads K and V where they lie in the
 * paged pool and keeps everything of one (sequence, KV head) in registers and on the stack.
 *
 * Numerics: float32 throughout (scores, softmax, accumulation), as the flash kernels do; the
 * output is rounded once to the cache dtype (bfloat16 round-to-nearest-even). The softmax is the
 * online (streaming) form over tiles of 16 keys. exp is a degree-6 polynomial with range
 * reduction (relative error < 2e-7 for the arguments here, x <= 0), which the compiler can
 * vectorize (libm's expf is not, without -fopenmp and libmvec).
 *
 * Built by kernels/native.py with the machine's C compiler (-O3 -march=native -ffast-math
 * -fno-finite-math-only) on first use and cached; the sizes are compile-time constants so the
 * compiler keeps a (sequence, KV head)'s accumulators in vector registers. Combinations not
 * instantiated below return -2 and the caller takes the torch path.
 *
 * Layouts (all contiguous):
 *   q, out        [n, hq, D]                     hq = G * hkv; query head h reads KV head h / G
 *   k_cache, v    [num_blocks, bs, hkv, D]
 *   block_tables  int32 [n, max_blocks]          entries past ceil(len / bs) are never read
 *   seq_lens      int32 [n], >= 1
 */
#include <math.h>
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

#define TILE 16

/* One (sequence, KV head): G query rows of head dim D against the sequence's L keys. */
#define DEFINE_HEAD(NAME, T, LOAD, STORE, G, D)                                                 \
static void NAME(const T *q, const T *k_cache, const T *v_cache, const int32_t *table, int L,   \
                 int bs, int hkv, int h, float scale, T *out) {                                 \
    float qf[G][D], acc[G][D], mx[G], sum[G];                                                   \
    for (int i = 0; i < G; i++) {                                                               \
        for (int e = 0; e < D; e++) { qf[i][e] = LOAD(q[i * D + e]) * scale; acc[i][e] = 0.f; } \
        mx[i] = -INFINITY;                                                                      \
        sum[i] = 0.f;                                                                           \
    }                                                                                           \
    for (int j0 = 0; j0 < L; j0 += TILE) {                                                      \
        int nt = L - j0 < TILE ? L - j0 : TILE;                                                 \
        float s[G][TILE];                                                                       \
        for (int t = 0; t < nt; t++) {                                                          \
            int j = j0 + t;                                                                     \
            const T *kp = k_cache + (((int64_t)table[j / bs] * bs + j % bs) * hkv + h) * D;     \
            float kf[D];                                                                        \
            for (int e = 0; e < D; e++) kf[e] = LOAD(kp[e]);                                    \
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
            const T *vp = v_cache + (((int64_t)table[j / bs] * bs + j % bs) * hkv + h) * D;     \
            float vf[D];                                                                        \
            for (int e = 0; e < D; e++) vf[e] = LOAD(vp[e]);                                    \
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

#define DEFINE_BOTH(G, D)                                                                       \
    DEFINE_HEAD(head_f32_##G##_##D, float, LOAD_F32, STORE_F32, G, D)                           \
    DEFINE_HEAD(head_bf16_##G##_##D, bf16_t, LOAD_BF16, STORE_BF16, G, D)

#define DEFINE_D(D) DEFINE_BOTH(1, D) DEFINE_BOTH(2, D) DEFINE_BOTH(3, D) DEFINE_BOTH(4, D)     \
                    DEFINE_BOTH(5, D) DEFINE_BOTH(6, D) DEFINE_BOTH(7, D) DEFINE_BOTH(8, D)
DEFINE_D(16)
DEFINE_D(32)
DEFINE_D(64)
DEFINE_D(128)

typedef void (*head_fn)(const void *, const void *, const void *, const int32_t *, int, int, int,
                        int, float, void *);

#define ENTRY(G, D) { (head_fn)head_f32_##G##_##D, (head_fn)head_bf16_##G##_##D }
#define ROW(D) { ENTRY(1, D), ENTRY(2, D), ENTRY(3, D), ENTRY(4, D), ENTRY(5, D), ENTRY(6, D),   \
                 ENTRY(7, D), ENTRY(8, D) }
static const head_fn HEADS[4][8][2] = { ROW(16), ROW(32), ROW(64), ROW(128) };

/* Returns 0, or -2 when (G, D, dtype) has no instantiation (the caller falls back). */
int radixkv_paged_decode(const void *q, const void *k_cache, const void *v_cache,
                         const int32_t *block_tables, const int32_t *seq_lens, void *out,
                         int n, int hq, int hkv, int d, int bs, int max_blocks, float scale,
                         int is_bf16) {
    int g = hq / hkv, di;
    switch (d) {
        case 16: di = 0; break;
        case 32: di = 1; break;
        case 64: di = 2; break;
        case 128: di = 3; break;
        default: return -2;
    }
    if (g < 1 || g > 8 || g * hkv != hq || (is_bf16 != 0 && is_bf16 != 1)) return -2;
    head_fn fn = HEADS[di][g - 1][is_bf16];
    int64_t elem = is_bf16 ? 2 : 4;
    for (int s = 0; s < n; s++) {
        for (int h = 0; h < hkv; h++) {
            int64_t off = ((int64_t)s * hq + (int64_t)h * g) * d * elem;
            fn((const char *)q + off, k_cache, v_cache, block_tables + (int64_t)s * max_blocks,
               seq_lens[s], bs, hkv, h, scale, (char *)out + off);
        }
    }
    return 0;
}

/* The version of this file's interface; kernels/native.py refuses a library that differs. */
int radixkv_native_abi(void) { return 1; }
