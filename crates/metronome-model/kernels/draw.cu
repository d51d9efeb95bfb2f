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

// The emulation (emulate/draw.cpp) runs smaller blocks; the device always 1024.
#ifndef DRAW_THREADS
#define DRAW_THREADS 1024
#endif
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

// ---------------------------------------------------------------------------------------
// Truncated draws (src/draw.rs, `invert_truncated`): top-k, then top-p over the top-k
// set, then min-p, and the inverse CDF over the survivors in order of decreasing
// probability (ties to the lower id, NaN with -inf). The host sorts; here each token
// has a 64-bit key that orders it exactly so (its scaled value's bits made monotone,
// then the id reversed), every set the host walks is "the keys at or above some key",
// and that key is found by a binary search over key bits, one block-wide count or f64
// sum per bit, each in a fixed tree order, so a row's result depends on the row alone:
//
//   top-k:  the largest key K with count(key >= K) >= k (the k-th largest key);
//   top-p:  the largest key K with mass(key >= K) >= top_p * mass(top-k set);
//   min-p:  the smallest key whose value passes x - max >= ln(min_p) (a block minimum);
//   draw:   the largest key K with mass(kept, key >= K) > u * mass(kept): the first
//           survivor whose running sum passes the target, as the host's walk.
//
// Each mass is a sum in another order than the host's sequential one, so a survivor set
// or token differs from the host's only when a threshold falls within f64 rounding of
// a running sum. Weights are recomputed in each pass from the logits (only for the keys
// at or above the candidate), which keeps no per-token state beyond the logits.

// The key's value part: the scaled value's bits, made to order as the floats (NaN with
// -inf, -0 with +0, as the host compares them).
__device__ __forceinline__ uint32_t ordered(float x) {
    if (isnan(x)) x = -INFINITY;
    if (x == 0.0f) x = 0.0f;  // -0 becomes +0 (it compares equal, so this is no no-op)
    const uint32_t b = __float_as_uint(x);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ uint64_t key_of(float x, uint32_t i, uint32_t vocab, uint32_t id_bits) {
    return ((uint64_t)ordered(x) << id_bits) | (uint64_t)(vocab - 1 - i);
}

// Block-wide reductions in a fixed tree order (every thread gets the result).
__device__ double block_sum_f64(double v, double *s) {
    const uint32_t t = threadIdx.x;
    s[t] = v;
    __syncthreads();
    for (uint32_t stride = DRAW_THREADS / 2; stride > 0; stride >>= 1) {
        if (t < stride) s[t] += s[t + stride];
        __syncthreads();
    }
    const double r = s[0];
    __syncthreads();
    return r;
}

// The block's largest value (NaN never wins: fmaxf takes the other operand).
__device__ float block_max_f32(float v, float *s) {
    const uint32_t t = threadIdx.x;
    s[t] = v;
    __syncthreads();
    for (uint32_t stride = DRAW_THREADS / 2; stride > 0; stride >>= 1) {
        if (t < stride) s[t] = fmaxf(s[t], s[t + stride]);
        __syncthreads();
    }
    const float r = s[0];
    __syncthreads();
    return r;
}

__device__ uint64_t block_reduce_u64(uint64_t v, uint64_t *s, bool take_min) {
    const uint32_t t = threadIdx.x;
    s[t] = v;
    __syncthreads();
    for (uint32_t stride = DRAW_THREADS / 2; stride > 0; stride >>= 1) {
        if (t < stride) {
            const uint64_t a = s[t], b = s[t + stride];
            s[t] = take_min ? (b < a ? b : a) : a + b;
        }
        __syncthreads();
    }
    const uint64_t r = s[0];
    __syncthreads();
    return r;
}

template <typename T>
__device__ void draw_truncated_row(const T *logits, uint32_t vocab, float inv, double u, uint32_t top_k,
                                   float top_p, double min_floor, uint32_t *token_out, float *logprob_out) {
    __shared__ double s_f64[DRAW_THREADS];
    __shared__ uint64_t s_u64[DRAW_THREADS];
    __shared__ float s_max[DRAW_THREADS];

    const uint32_t t = threadIdx.x;
    const uint32_t chunk = (vocab + DRAW_THREADS - 1) / DRAW_THREADS;
    const uint32_t begin = min(t * chunk, vocab);
    const uint32_t end = min(begin + chunk, vocab);
    uint32_t id_bits = 1;
    while (id_bits < 32 && (vocab - 1) >> id_bits) ++id_bits;
    const uint32_t key_bits = 32 + id_bits;

    // The row's maximum (NaN never wins).
    float best = -INFINITY;
    for (uint32_t i = begin; i < end; ++i) {
        const float x = load(logits, i) * inv;
        if (x > best) best = x;  // NaN compares false
    }
    const float max = block_max_f32(best, s_max);
    if (!isfinite(max)) {
        if (t == 0) {
            *token_out = NONE;
            *logprob_out = __int_as_float(0x7fc00000);
        }
        return;  // every thread of the block returns here: no barrier follows for any
    }

    // The weight sum and the count of the keys at or above `at`.
    auto mass_from = [&](uint64_t at) {
        double sum = 0.0;
        for (uint32_t i = begin; i < end; ++i) {
            const float x = load(logits, i) * inv;
            if (key_of(x, i, vocab, id_bits) >= at) sum += weight(x, max);
        }
        return block_sum_f64(sum, s_f64);
    };
    auto count_from = [&](uint64_t at) {
        uint64_t n = 0;
        for (uint32_t i = begin; i < end; ++i) n += key_of(load(logits, i) * inv, i, vocab, id_bits) >= at;
        return block_reduce_u64(n, s_u64, false);
    };
    // The largest key K >= lo with holds(K), holds being true at lo and falling once
    // (true below some key, false above it): one pass per bit above lo.
    auto largest = [&](uint64_t lo, auto holds) {
        uint64_t k = 0;
        for (int bit = (int)key_bits - 1; bit >= 0; --bit) {
            const uint64_t candidate = k | ((uint64_t)1 << bit);
            if (candidate <= lo || holds(candidate)) k = candidate;
        }
        return k;
    };

    const double total = mass_from(0);
    // The kept set: the keys at or above lo, a token's key; at first every token's.
    uint64_t lo = ~(uint64_t)0;
    for (uint32_t i = begin; i < end; ++i) {
        const uint64_t key = key_of(load(logits, i) * inv, i, vocab, id_bits);
        lo = key < lo ? key : lo;
    }
    lo = block_reduce_u64(lo, s_u64, true);
    if (top_k > 0 && top_k < vocab) lo = largest(lo, [&](uint64_t k) { return count_from(k) >= top_k; });
    if (top_p < 1.0f) {
        const double need = (double)top_p * mass_from(lo);
        lo = largest(lo, [&](uint64_t k) { return mass_from(k) >= need; });
    }
    if (min_floor > -INFINITY) {
        uint64_t smallest = ~(uint64_t)0;
        for (uint32_t i = begin; i < end; ++i) {
            const float x = load(logits, i) * inv;
            const uint64_t key = key_of(x, i, vocab, id_bits);
            if (key >= lo && (double)x - (double)max >= min_floor && key < smallest) smallest = key;
        }
        // The top token always passes (its x - max is 0), so some key does.
        lo = block_reduce_u64(smallest, s_u64, true);
    }
    const double target = u * mass_from(lo);
    // No key passes the target by rounding: the last survivor, the key lo itself.
    const uint64_t key = largest(lo, [&](uint64_t k) { return mass_from(k) > target; });
    if (t == 0) {
        const uint32_t token = vocab - 1 - (uint32_t)(key & (((uint64_t)1 << id_bits) - 1));
        const float x = load(logits, token) * inv;
        *token_out = token;
        *logprob_out = (float)((double)x - ((double)max + log(total)));
    }
}

// logits: [rows, vocab] contiguous; inv, u, top_k, top_p, min_floor (ln min_p, or -inf),
// tokens, logprobs: [rows].
#define DRAW_TRUNCATED_KERNEL(NAME, T)                                                             \
    extern "C" __global__ void NAME(const T *logits, const float *inv, const double *u,             \
                                    const uint32_t *top_k, const float *top_p,                     \
                                    const double *min_floor, uint32_t *tokens, float *logprobs,    \
                                    uint32_t vocab) {                                              \
        const uint32_t row = blockIdx.x;                                                           \
        draw_truncated_row<T>(logits + (size_t)row * vocab, vocab, inv[row], u[row], top_k[row],    \
                              top_p[row], min_floor[row], tokens + row, logprobs + row);           \
    }

DRAW_TRUNCATED_KERNEL(draw_truncated_rows_f32, float)
DRAW_TRUNCATED_KERNEL(draw_truncated_rows_bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------
// The repetition penalty (src/draw.rs, `Penalty::apply`): a row's logits copied to f32
// and each of its context's distinct ids penalised there, as the host does in f32 (a
// positive logit divided by the factor, any other multiplied), before a draw kernel
// reads the copy. One block per row; the ids of a row are distinct (the host dedups
// them), so no two threads write one logit.
#define PENALISE_THREADS 256

template <typename T>
__device__ void penalise_row(const T *logits, float *out, uint32_t vocab, const uint32_t *ids, uint32_t n,
                             float factor) {
    for (uint32_t i = threadIdx.x; i < vocab; i += PENALISE_THREADS) out[i] = load(logits, i);
    __syncthreads();
    for (uint32_t j = threadIdx.x; j < n; j += PENALISE_THREADS) {
        const uint32_t id = ids[j];
        if (id < vocab) {
            const float x = out[id];
            out[id] = x > 0.0f ? x / factor : x * factor;
        }
    }
}

// logits: [rows, vocab]; out: [rows, vocab] f32; offsets: [rows + 1] into ids (row r's
// ids are ids[offsets[r]..offsets[r + 1]]); factor: [rows].
#define PENALISE_KERNEL(NAME, T)                                                                   \
    extern "C" __global__ void NAME(const T *logits, float *out, const uint32_t *offsets,           \
                                    const uint32_t *ids, const float *factor, uint32_t vocab) {     \
        const uint32_t row = blockIdx.x;                                                           \
        penalise_row<T>(logits + (size_t)row * vocab, out + (size_t)row * vocab, vocab,             \
                        ids + offsets[row], offsets[row + 1] - offsets[row], factor[row]);         \
    }

PENALISE_KERNEL(penalise_rows_f32, float)
PENALISE_KERNEL(penalise_rows_bf16, __nv_bfloat16)

// ---------------------------------------------------------------------------------------
// Raw log-probs (src/draw.rs, `raw_logprob`): the drawn token's log-prob under the raw
// logits at temperature 1, for rows that report vLLM's `raw_logprobs`. One block per
// row: the maximum (NaN never wins), each thread's run of weights summed in order and
// the runs' sums in a fixed tree; x_t - (max + ln total). A row without a drawn token
// (NONE) is left as it is.
template <typename T>
__device__ void raw_logprob_row(const T *logits, uint32_t vocab, uint32_t token, float *logprob_out) {
    __shared__ float s_max[DRAW_THREADS];
    __shared__ double s_f64[DRAW_THREADS];
    if (token == NONE) return;  // the whole block returns: no barrier follows for any
    const uint32_t t = threadIdx.x;
    const uint32_t chunk = (vocab + DRAW_THREADS - 1) / DRAW_THREADS;
    const uint32_t begin = min(t * chunk, vocab);
    const uint32_t end = min(begin + chunk, vocab);
    float best = -INFINITY;
    for (uint32_t i = begin; i < end; ++i) {
        const float x = load(logits, i);
        if (x > best) best = x;  // NaN compares false
    }
    const float max = block_max_f32(best, s_max);
    double sum = 0.0;
    for (uint32_t i = begin; i < end; ++i) sum += weight(load(logits, i), max);
    const double total = block_sum_f64(sum, s_f64);
    if (t == 0) *logprob_out = (float)((double)load(logits, token) - ((double)max + log(total)));
}

// logits: [rows, vocab]; tokens, logprobs: [rows] (logprobs overwritten where a token is).
#define RAW_LOGPROB_KERNEL(NAME, T)                                                                \
    extern "C" __global__ void NAME(const T *logits, const uint32_t *tokens, float *logprobs,       \
                                    uint32_t vocab) {                                              \
        const uint32_t row = blockIdx.x;                                                           \
        raw_logprob_row<T>(logits + (size_t)row * vocab, vocab, tokens[row], logprobs + row);       \
    }

RAW_LOGPROB_KERNEL(raw_logprobs_f32, float)
RAW_LOGPROB_KERNEL(raw_logprobs_bf16, __nv_bfloat16)
