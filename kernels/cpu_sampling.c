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
        float sum = 0.f;
        if (m == -INFINITY || m == INFINITY) {   /* all -inf, or an inf: no finite lse */
            lse[r] = m;
        } else {
            for (int v = 0; v < vocab; v++) sum += exp_nonpositive(x[v] - m);
            if (sum != sum) return -1;                  /* a NaN in the row reached the sum */
            lse[r] = m + logf(sum);
        }
        tokens[r] = tok;
    }
    return 0;
}
