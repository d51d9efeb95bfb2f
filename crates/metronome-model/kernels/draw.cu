// The draw of a decode step's next tokens on the device (src/draw.rs is the reference
// and says what is computed; this file follows its steps). One thread block of
// DRAW_THREADS threads per row; thread t owns the contiguous run of the vocabulary
// [t * chunk, (t + 1) * chunk) and walks it in token order.
//
// Per row: the scaled logits x_i = logit_i * inv (inv = 1 / T, or 1 when greedy or at
// T = 1, as the host scales them); the first index of their maximum (NaN never wins);
// the weights w_i = exp((double)x_i - (double)max) (0 for NaN), summed per run in
// order and the runs' sums scanned in f64; then greedy takes the argmax, and sampling
// the first token whose running sum exceeds u * total (the thread whose run holds it
// walks its run again). The log-prob is x_t - (max + ln total). A row without a finite
// maximum gets token 0xffffffff and the host samples it from its logits (and reports it).

#include <cuda_bf16.h>
#include <stdint.h>

#define DRAW_THREADS 1024
#define NONE 0xffffffffu

__device__ __forceinline__ float load(const float *p, uint32_t i) { return p[i]; }
__device__ __forceinline__ float load(const __nv_bfloat16 *p, uint32_t i) { return __bfloat162float(p[i]); }

__device__ __forceinline__ double weight(float x, float max) {
    return isnan(x) ? 0.0 : exp((double)x - (double)max);
}

template <typename T>
__device__ void draw_row(const T *logits, uint32_t vocab, float inv, uint32_t greedy, double u,
                         uint32_t *token_out, float *logprob_out) {
    __shared__ float s_max[DRAW_THREADS];
    __shared__ uint32_t s_arg[DRAW_THREADS];
    __shared__ double s_sum[DRAW_THREADS];
    __shared__ uint32_t s_last[DRAW_THREADS];
    __shared__ uint32_t s_token;

    const uint32_t t = threadIdx.x;
    const uint32_t chunk = (vocab + DRAW_THREADS - 1) / DRAW_THREADS;
    const uint32_t begin = min(t * chunk, vocab);
    const uint32_t end = min(begin + chunk, vocab);

    // The first index of the run's largest value; NONE when it has none above -inf.
    float best = -INFINITY;
    uint32_t arg = NONE;
    for (uint32_t i = begin; i < end; ++i) {
        const float x = load(logits, i) * inv;
        if (x > best) {
            best = x;
            arg = i;
        }
    }
    s_max[t] = best;
    s_arg[t] = arg;
    if (t == 0) s_token = NONE;
    __syncthreads();
    // Tree reduction: the larger value wins, the lower index on ties; runs are
    // disjoint, so the result is the row's first maximum whatever the pairing.
    for (uint32_t stride = DRAW_THREADS / 2; stride > 0; stride >>= 1) {
        if (t < stride) {
            const float v = s_max[t + stride];
            const uint32_t a = s_arg[t + stride];
            if (a != NONE && (s_arg[t] == NONE || v > s_max[t] || (v == s_max[t] && a < s_arg[t]))) {
                s_max[t] = v;
                s_arg[t] = a;
            }
        }
        __syncthreads();
    }
    const float max = s_max[0];
    const uint32_t top = s_arg[0];
    if (top == NONE || !isfinite(max)) {
        if (t == 0) {
            *token_out = NONE;
            *logprob_out = __int_as_float(0x7fc00000);
        }
        return;  // every thread of the block returns here: no barrier follows for any
    }

    // The run's weight sum in token order, and its last token of positive weight.
    double sum = 0.0;
    uint32_t last = NONE;
    for (uint32_t i = begin; i < end; ++i) {
        const double w = weight(load(logits, i) * inv, max);
        if (w > 0.0) {
            sum += w;
            last = i;
        }
    }
    s_sum[t] = sum;
    s_last[t] = last;
    __syncthreads();
    // Inclusive scan of the runs' sums (Hillis-Steele): s_sum[t] is the sum of runs 0..=t.
    for (uint32_t off = 1; off < DRAW_THREADS; off <<= 1) {
        const double add = t >= off ? s_sum[t - off] : 0.0;
        __syncthreads();
        s_sum[t] += add;
        __syncthreads();
    }
    const double total = s_sum[DRAW_THREADS - 1];

    if (!greedy) {
        const double target = u * total;
        const double before = t == 0 ? 0.0 : s_sum[t - 1];
        if (before <= target && target < s_sum[t] && last != NONE) {
            double acc = before;
            uint32_t found = last;  // rounding between the scan and this walk: the run's last
            for (uint32_t i = begin; i < end; ++i) {
                const double w = weight(load(logits, i) * inv, max);
                if (w > 0.0) {
                    acc += w;
                    if (acc > target) {
                        found = i;
                        break;
                    }
                }
            }
            s_token = found;  // exactly one run satisfies the bounds
        }
        __syncthreads();
    }
    if (t == 0) {
        uint32_t token = top;
        if (!greedy) {
            token = s_token;
            if (token == NONE) {
                // u * total at or beyond the total by rounding: the last token of positive
                // weight, as the host's walk ends.
                for (int r = DRAW_THREADS - 1; r >= 0; --r) {
                    if (s_last[r] != NONE) {
                        token = s_last[r];
                        break;
                    }
                }
            }
        }
        const float x = load(logits, token) * inv;
        *token_out = token;
        *logprob_out = (float)((double)x - ((double)max + log(total)));
    }
}

// logits: [rows, vocab] contiguous; inv, greedy, u, tokens, logprobs: [rows].
#define DRAW_KERNEL(NAME, T)                                                                        \
    extern "C" __global__ void NAME(const T *logits, const float *inv, const uint32_t *greedy,       \
                                    const double *u, uint32_t *tokens, float *logprobs,             \
                                    uint32_t vocab) {                                               \
        const uint32_t row = blockIdx.x;                                                            \
        draw_row<T>(logits + (size_t)row * vocab, vocab, inv[row], greedy[row], u[row], tokens + row, \
                    logprobs + row);                                                                \
    }

DRAW_KERNEL(draw_rows_f32, float)
DRAW_KERNEL(draw_rows_bf16, __nv_bfloat16)
