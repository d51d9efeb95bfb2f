// The element-wise training ops of a decoder layer as one kernel each way, f32 and
// bf16 (T): RMSNorm, SwiGLU, rotary embeddings, the masked softmax, the chunked head's
// per-row work, and gathering rows, forward and backward. Their references are the
// portable forms (src/portable.rs): the same formulas, with the statistics and every
// product a gradient needs computed in f32 whatever T is, as the portable forms do.
//
// RMSNorm, one block of NORM_THREADS threads per row of d values:
//   forward   r = 1 / sqrt(mean(x^2) + eps); y = T(T(x r) w)
//   backward  gw = g w; dx = r (gw - x r mean(gw x r)); wrow = g T(x r), both in f32
//             (wrow summed over rows by candle for the weight's gradient)
// A decode step's residual sum and RMSNorm as one kernel (add_rms_norm), and SwiGLU
// of the decode layout's stacked gate and up product (swiglu_stacked), forward only.
// SwiGLU, one thread per element:
//   forward   o = T(silu(a) b), silu(a) = a / (1 + exp(-a))
//   backward  s = sigmoid(a); da = g b s (1 + a (1 - s)); db = g silu(a)
// Rotary embeddings of x: [n, heads, hd] with f32 tables cos, sin: [n, hd / 2] (the
// rotate-half convention), one thread per rotated pair:
//   forward   o1 = x1 c - x2 s; o2 = x2 c + x1 s
//   backward  the rotation by the negated angle, the same kernel with sign = -1
// Masked softmax of attention scores s: [rows, lk] with the additive f32 mask m: blocks
// of [lq, lk], one per `group` rows of s (group = rows: one mask, the segment's,
// broadcast over the heads; group = heads x lq: one per row of a batch), one block of
// NORM_THREADS per row, in f32 whatever T is (as the portable form casts to f32):
//   forward   p = T(exp(s + m - max) / sum); a row with no visible key (never built by
//             the model: every query sees itself) gets zeros, where the portable form
//             gets NaN
//   backward  ds = T(p (g - sum(g p))), from the forward's p as saved (in T)
// The composed form allocates and walks six [rows, lk] f32 buffers each way.
// The chunked head's per-row work (src/head.rs), on the logits z of a chunk, in f32
// whatever T is, at x = z / T (inv_t = 1 / T):
//   stats     one block of NORM_THREADS per row of vocab values: m = max x,
//             s = sum exp(x - m), u = sum exp(x - m) (x - m); lse = m + log s,
//             entropy = log s - u / s, target log-prob = x[target] - lse, as [rows, 3]
//             f32 (target log-prob, entropy, lse); two passes over the row
//   columns   one thread per element of a block of cols vocabulary columns from
//             `first`, with aux = [rows, 5] f32 (the stats, then the gradients g_l, g_e
//             of the target log-prob and the entropy): log p = x - lse,
//             dz = T([first + j = target] g_l - p (g_l + g_e (log p + entropy))) inv_t
// The composed forms walk about a dozen [rows, vocab] f32 buffers each.
// Gathering rows of a table [rows, d] by ids [n] (the embedding, the targets' hidden
// states), one block of NORM_THREADS per output row forward; backward one block per
// row read, from the index's inverse inv = [rows read (m), offsets (m + 1), sources
// (n)]: out[row] = T(sum of g[source] over its sources, in f32, in their order) into a
// zeroed [rows, d]. candle's index-add runs one thread per column walking all n ids,
// adding in T.

#include <cuda_bf16.h>
#include <stdint.h>

#define NORM_THREADS 256

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// The sum of v over the block (every thread gets it); `shared` holds a float per warp.
// Every warp sums the warps' partial sums, in the same order, so each has the total
// without a second round through `shared` (and every thread reaches each shuffle, which
// the CPU emulation of the kernels needs, emulate/emulate.h).
__device__ float block_sum(float v, float *shared) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? shared[lane] : 0.0f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    __syncthreads();  // `shared` may be reused by the caller's next sum
    return v;
}

// The maximum of v over the block (every thread gets it), as block_sum.
__device__ float block_max(float v, float *shared) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < (int)(blockDim.x / 32) ? shared[lane] : -INFINITY;
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    __syncthreads();
    return v;
}

template <typename T>
__device__ void rms_norm_fwd(const T *x, const T *w, T *y, uint32_t d, float eps) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const T *xr = x + row * d;
    T *yr = y + row * d;
    float ss = 0.0f;
    for (uint32_t i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = to_f(xr[i]);
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(block_sum(ss, shared) / (float)d + eps);
    for (uint32_t i = threadIdx.x; i < d; i += blockDim.x) {
        const float n = to_f(from_f<T>(to_f(xr[i]) * r));
        yr[i] = from_f<T>(n * to_f(w[i]));
    }
}

// dx: [rows, d] and wrow: [rows, d] (g * normalised x per row, the weight's gradient
// once summed over rows), both f32: the host casts dx to T and sums wrow in f32.
template <typename T>
__device__ void rms_norm_bwd(const T *x, const T *w, const T *g, float *dx, float *wrow, uint32_t d, float eps) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const T *xr = x + row * d, *gr = g + row * d;
    float ss = 0.0f;
    for (uint32_t i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = to_f(xr[i]);
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(block_sum(ss, shared) / (float)d + eps);
    float dot = 0.0f;
    for (uint32_t i = threadIdx.x; i < d; i += blockDim.x) {
        dot += to_f(gr[i]) * to_f(w[i]) * to_f(xr[i]) * r;
    }
    const float mean = block_sum(dot, shared) / (float)d;
    for (uint32_t i = threadIdx.x; i < d; i += blockDim.x) {
        const float v = to_f(xr[i]), gv = to_f(gr[i]);
        const float xhat = v * r;
        dx[row * d + i] = r * (gv * to_f(w[i]) - xhat * mean);
        wrow[row * d + i] = gv * to_f(from_f<T>(xhat));
    }
}

template <typename T>
__device__ void swiglu_fwd(const T *a, const T *b, T *o, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float av = to_f(a[i]);
    o[i] = from_f<T>(av / (1.0f + expf(-av)) * to_f(b[i]));
}

// SwiGLU of a stacked gate and up product gu: [rows, 2 inter] (gate columns first),
// the decode layout's: o[row, c] = T(silu(gate) up), as swiglu_fwd of the two halves.
template <typename T>
__device__ void swiglu_stacked(const T *gu, T *o, uint32_t inter, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const size_t row = i / inter, c = i % inter;
    const float av = to_f(gu[row * 2 * inter + c]);
    o[i] = from_f<T>(av / (1.0f + expf(-av)) * to_f(gu[row * 2 * inter + inter + c]));
}

// The residual sum and the next RMSNorm of a decode step in one pass, forward only:
// out[0] = s = T(x + y) (as candle's add in T rounds it), out[1] = rms_norm_fwd(s),
// out: [2, rows, d], one block per row.
template <typename T>
__device__ void add_rms_norm(const T *x, const T *y, const T *w, T *out, uint32_t d, float eps) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const T *xr = x + row * d, *yr = y + row * d;
    T *sr = out + row * d, *nr = out + ((size_t)gridDim.x + row) * d;
    float ss = 0.0f;
    for (uint32_t i = threadIdx.x; i < d; i += blockDim.x) {
        const T s = from_f<T>(to_f(xr[i]) + to_f(yr[i]));
        sr[i] = s;
        const float v = to_f(s);
        ss += v * v;
    }
    const float r = 1.0f / sqrtf(block_sum(ss, shared) / (float)d + eps);
    for (uint32_t i = threadIdx.x; i < d; i += blockDim.x) {
        const float n = to_f(from_f<T>(to_f(sr[i]) * r));
        nr[i] = from_f<T>(n * to_f(w[i]));
    }
}

// da and db side by side: out[0..n] = da, out[n..2n] = db.
template <typename T>
__device__ void swiglu_bwd(const T *a, const T *b, const T *g, T *out, size_t n) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const float av = to_f(a[i]), bv = to_f(b[i]), gv = to_f(g[i]);
    const float s = 1.0f / (1.0f + expf(-av));
    out[i] = from_f<T>(gv * bv * s * (1.0f + av * (1.0f - s)));
    out[n + i] = from_f<T>(gv * av * s);
}

template <typename T>
__device__ void rope(const T *x, const float *cos, const float *sin, T *o, uint32_t heads, uint32_t half,
                     size_t pairs, float sign) {
    const size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= pairs) return;
    const size_t k = i % half;                     // the pair within its head
    const size_t row = i / half;                   // (position, head)
    const size_t pos = row / heads;
    const size_t a = row * 2 * half + k, b = a + half;
    const float c = cos[pos * half + k], s = sign * sin[pos * half + k];
    const float x1 = to_f(x[a]), x2 = to_f(x[b]);
    o[a] = from_f<T>(x1 * c - x2 * s);
    o[b] = from_f<T>(x2 * c + x1 * s);
}

template <typename T>
__device__ void masked_softmax_fwd(const T *s, const float *mask, T *p, uint64_t group, uint32_t lq, uint32_t lk) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const T *sr = s + row * lk;
    const float *mr = mask + ((size_t)(row / group) * lq + row % lq) * lk;
    T *pr = p + row * lk;
    float mx = -INFINITY;
    for (uint32_t i = threadIdx.x; i < lk; i += blockDim.x) mx = fmaxf(mx, to_f(sr[i]) + mr[i]);
    mx = block_max(mx, shared);
    if (mx == -INFINITY) {
        for (uint32_t i = threadIdx.x; i < lk; i += blockDim.x) pr[i] = from_f<T>(0.0f);
        return;
    }
    float sum = 0.0f;
    for (uint32_t i = threadIdx.x; i < lk; i += blockDim.x) sum += expf(to_f(sr[i]) + mr[i] - mx);
    sum = block_sum(sum, shared);
    for (uint32_t i = threadIdx.x; i < lk; i += blockDim.x) pr[i] = from_f<T>(expf(to_f(sr[i]) + mr[i] - mx) / sum);
}

template <typename T>
__device__ void masked_softmax_bwd(const T *p, const T *g, T *ds, uint32_t lk) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const T *pr = p + row * lk, *gr = g + row * lk;
    float dot = 0.0f;
    for (uint32_t i = threadIdx.x; i < lk; i += blockDim.x) dot += to_f(gr[i]) * to_f(pr[i]);
    dot = block_sum(dot, shared);
    for (uint32_t i = threadIdx.x; i < lk; i += blockDim.x) {
        ds[row * lk + i] = from_f<T>(to_f(pr[i]) * (to_f(gr[i]) - dot));
    }
}

template <typename T>
__device__ void logprob_stats(const T *z, const uint32_t *target, float *stats, uint32_t vocab, float inv_t) {
    __shared__ float shared[32];
    const size_t row = blockIdx.x;
    const T *zr = z + row * vocab;
    float mx = -INFINITY;
    for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) mx = fmaxf(mx, to_f(zr[i]) * inv_t);
    mx = block_max(mx, shared);
    float s = 0.0f, u = 0.0f;
    for (uint32_t i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float x = to_f(zr[i]) * inv_t - mx, e = expf(x);
        s += e;
        if (e > 0.0f) u += e * x;  // exp(-inf) (-inf) would be NaN
    }
    s = block_sum(s, shared);
    u = block_sum(u, shared);
    if (threadIdx.x == 0) {
        const float log_s = logf(s), lse = mx + log_s;
        stats[row * 3] = to_f(zr[target[row]]) * inv_t - lse;
        stats[row * 3 + 1] = log_s - u / s;
        stats[row * 3 + 2] = lse;
    }
}

template <typename T>
__device__ void logprob_columns_grad(const T *z, const float *aux, const uint32_t *target, T *dz, uint32_t cols,
                                     uint32_t first, float inv_t, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        const size_t row = i / cols;
        const uint32_t j = (uint32_t)(i % cols);
        const float *a = aux + row * 5;
        const float logp = to_f(z[i]) * inv_t - a[2], g_l = a[3];
        const float hot = first + j == target[row] ? g_l : 0.0f;
        dz[i] = from_f<T>((hot - expf(logp) * (g_l + a[4] * (logp + a[1]))) * inv_t);
    }
}

template <typename T>
__device__ void gather_rows_fwd(const T *table, const uint32_t *ids, T *out, uint32_t d) {
    const size_t r = blockIdx.x;
    const T *src = table + (size_t)ids[r] * d;
    for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) out[r * d + c] = src[c];
}

template <typename T>
__device__ void gather_rows_bwd(const T *g, const uint32_t *inv, T *out, uint32_t m, uint32_t d) {
    const uint32_t b = blockIdx.x;
    const uint32_t *offsets = inv + m, *sources = inv + 2 * (size_t)m + 1;
    const size_t row = inv[b];
    for (uint32_t c = threadIdx.x; c < d; c += blockDim.x) {
        float acc = 0.0f;
        for (uint32_t k = offsets[b]; k < offsets[b + 1]; ++k) acc += to_f(g[(size_t)sources[k] * d + c]);
        out[row * d + c] = from_f<T>(acc);
    }
}

#define NORM_KERNELS(SUFFIX, T)                                                                         \
    extern "C" __global__ void rms_norm_fwd_##SUFFIX(const T *x, const T *w, T *y, uint32_t d, float eps) { \
        rms_norm_fwd<T>(x, w, y, d, eps);                                                               \
    }                                                                                                   \
    extern "C" __global__ void rms_norm_bwd_##SUFFIX(const T *x, const T *w, const T *g, float *dx, float *wrow, \
                                                     uint32_t d, float eps) {                           \
        rms_norm_bwd<T>(x, w, g, dx, wrow, d, eps);                                                     \
    }                                                                                                   \
    extern "C" __global__ void swiglu_fwd_##SUFFIX(const T *a, const T *b, T *o, size_t n) {            \
        swiglu_fwd<T>(a, b, o, n);                                                                      \
    }                                                                                                   \
    extern "C" __global__ void swiglu_bwd_##SUFFIX(const T *a, const T *b, const T *g, T *out, size_t n) { \
        swiglu_bwd<T>(a, b, g, out, n);                                                                 \
    }                                                                                                   \
    extern "C" __global__ void swiglu_stacked_##SUFFIX(const T *gu, T *o, uint32_t inter, size_t n) {  \
        swiglu_stacked<T>(gu, o, inter, n);                                                             \
    }                                                                                                   \
    extern "C" __global__ void add_rms_norm_##SUFFIX(const T *x, const T *y, const T *w, T *out, uint32_t d, \
                                                     float eps) {                                       \
        add_rms_norm<T>(x, y, w, out, d, eps);                                                          \
    }                                                                                                   \
    extern "C" __global__ void rope_##SUFFIX(const T *x, const float *cos, const float *sin, T *o,      \
                                             uint32_t heads, uint32_t half, size_t pairs, float sign) { \
        rope<T>(x, cos, sin, o, heads, half, pairs, sign);                                              \
    }                                                                                                   \
    extern "C" __global__ void masked_softmax_fwd_##SUFFIX(const T *s, const float *mask, T *p, uint64_t group, \
                                                           uint32_t lq, uint32_t lk) {                  \
        masked_softmax_fwd<T>(s, mask, p, group, lq, lk);                                               \
    }                                                                                                   \
    extern "C" __global__ void masked_softmax_bwd_##SUFFIX(const T *p, const T *g, T *ds, uint32_t lk) { \
        masked_softmax_bwd<T>(p, g, ds, lk);                                                            \
    }                                                                                                   \
    extern "C" __global__ void logprob_stats_##SUFFIX(const T *z, const uint32_t *target, float *stats,   \
                                                      uint32_t vocab, float inv_t) {                    \
        logprob_stats<T>(z, target, stats, vocab, inv_t);                                               \
    }                                                                                                   \
    extern "C" __global__ void logprob_columns_grad_##SUFFIX(const T *z, const float *aux, const uint32_t *target, \
                                                             T *dz, uint32_t cols, uint32_t first, float inv_t, \
                                                             size_t n) {                                \
        logprob_columns_grad<T>(z, aux, target, dz, cols, first, inv_t, n);                             \
    }                                                                                                   \
    extern "C" __global__ void gather_rows_fwd_##SUFFIX(const T *table, const uint32_t *ids, T *out, uint32_t d) { \
        gather_rows_fwd<T>(table, ids, out, d);                                                         \
    }                                                                                                   \
    extern "C" __global__ void gather_rows_bwd_##SUFFIX(const T *g, const uint32_t *inv, T *out, uint32_t m, \
                                                        uint32_t d) {                                   \
        gather_rows_bwd<T>(g, inv, out, m, d);                                                          \
    }

NORM_KERNELS(f32, float)
NORM_KERNELS(bf16, __nv_bfloat16)
