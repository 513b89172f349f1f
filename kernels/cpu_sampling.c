/* Greedy tokens and log-sum-exps of float32 logits, for the engine's sampling step.
 *
 * Why: each decode step of the embedded model reduces 16 x 49152 logits twice in torch,
 * max(dim) for the greedy token (0.76 ms) and a full log_softmax (0.84 ms) of which only the
 * chosen token's entry is read unless a request asked for top logprobs. Here one row is read
 * three times in vectorized loops (max; the first index holding it; sum of e^(x - max)).
 *
 * tokens[r] = the lowest index of row r's maximum (torch.max(dim)'s choice), lse[r] = max +
 * log(sum_v e^(x_v - max)). A row holding a NaN returns -1 (the caller then uses torch; a row
 * of -inf and +inf only, no finite log-sum-exp, gets its max as lse).
 */
#include <math.h>
#include <stdint.h>

#include "cpu_math.h"

int radixkv_greedy_logsumexp(const float *logits, int rows, int vocab, int64_t row_stride,
                             int64_t *tokens, float *lse) {
    for (int r = 0; r < rows; r++) {
        const float *x = logits + (int64_t)r * row_stride;
        float m = -INFINITY;
        for (int v = 0; v < vocab; v++) m = x[v] > m ? x[v] : m;   /* NaNs are skipped here */
        int64_t tok = -1;
        for (int v0 = 0; v0 < vocab && tok < 0; v0 += 16) {
            int end = v0 + 16 < vocab ? v0 + 16 : vocab, hit = 0;
            for (int v = v0; v < end; v++) hit |= x[v] == m;
            if (hit) {
                for (int v = v0; v < end; v++) {
                    if (x[v] == m) { tok = v; break; }
                }
            }
        }
        if (m == -INFINITY || m == INFINITY) {   /* all -inf, or an inf: no finite lse */
            lse[r] = m;
        } else {
            /* Float partial sums of 512 terms (the vectorized loop: 64 a lane with AVX2),
             * added up in double: one float sum over the whole row drifted by up to 1.2e-5
             * in the log on a 49152-entry row with AVX2's 8 lanes (6144 terms a lane). */
            double sum = 0.0;
            for (int v0 = 0; v0 < vocab; v0 += 512) {
                int end = v0 + 512 < vocab ? v0 + 512 : vocab;
                float part = 0.f;
                for (int v = v0; v < end; v++) part += exp_nonpositive(x[v] - m);
                sum += (double)part;
            }
            if (sum != sum) return -1;                  /* a NaN in the row reached the sum */
            lse[r] = m + (float)log(sum);
        }
        tokens[r] = tok;
    }
    return 0;
}
