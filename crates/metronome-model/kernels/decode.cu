// The cached forward's per-layer attention work (decode steps and prefills), read in
// place from the KV cache: its references are the portable forms in src/portable.rs
// (`Kernels::write_decode_rows`, `Kernels::decode_attention`), which gather each
// row's prefix, pad it to the step's longest and run batched products.
//
// A step's rows, in a paged cache of `block`-row blocks: row i's block table is
// blocks[table[i] ..], position p lives at cache row
// blocks[table[i] + p / block] * block + p % block; the row's new key and value go to
// its position len[i] - 1, and it attends to its len[i] cached positions in order
// (`rows` holds table and len interleaved, u32).
//
// decode_write: one thread per element of the new keys (or values) [n, width].
// decode_project: the decode layout's stacked product qkv: [n, (heads + 2 kv_heads) hd]
// (queries, keys, values; the bias, when has_bias, not yet added) made ready in one
// pass, one thread per rotated pair of a query or key head and per value element: the
// bias added and rounded to T (as candle's add in T), the query and key pairs rotated
// by the row's f32 tables cos, sin: [n, hd / 2] as `rope` (kernels/layer.cu) rotates
// them, the query written to q: [n, heads, hd], the key and value to the caches at the
// row's position len[i] - 1. Its reference is the composed form in src/portable.rs
// (`Kernels::decode_project`): bias, rope, decode_write twice.
// decode_attention writes out_rows rows: those from n on (padding for the next
// product's minimum rows) are zeros.
// decode_attention: one warp per (row, query head). Lane l holds the dimensions
// l, l + 32, ... of the query and of the output accumulator; for each cached position
// in order the warp computes the score (a warp sum of the lanes' products), then the
// online softmax update (running maximum and sum in f32). Every row's result depends on
// its own prefix only, in a fixed order: batch-invariant, and no padding is read.

#include <cuda_bf16.h>
#include <stdint.h>

#define MAX_CHUNKS 8  // head_dim up to 256, in chunks of 32

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// The cache row of position p of the row whose block table starts at blocks[table].
__device__ __forceinline__ size_t cache_row(const uint32_t *blocks, uint32_t table, uint32_t block, size_t p) {
    return (size_t)blocks[table + p / block] * block + p % block;
}

template <typename T>
__device__ void decode_write(T *cache, const T *src, const uint32_t *rows, const uint32_t *blocks, uint32_t block,
                             uint32_t width, size_t total) {
    const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= total) return;
    const size_t i = e / width, c = e % width;
    const size_t at = cache_row(blocks, rows[2 * i], block, (size_t)rows[2 * i + 1] - 1);
    cache[at * width + c] = src[e];
}

template <typename T>
__device__ void decode_project(const T *qkv, const T *bias, uint32_t has_bias, const float *cos, const float *sin,
                               const uint32_t *rows, const uint32_t *blocks, uint32_t block, T *q, T *keys,
                               T *values, uint32_t heads, uint32_t kv_heads, uint32_t hd, size_t total) {
    const size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= total) return;
    const uint32_t half = hd / 2, kv_width = kv_heads * hd;
    const uint32_t q_pairs = heads * half, k_pairs = kv_heads * half;
    const uint32_t per_row = q_pairs + k_pairs + kv_width, width = heads * hd + 2 * kv_width;
    const size_t i = e / per_row;
    const uint32_t j = (uint32_t)(e % per_row);
    const T *row = qkv + i * width;
    // Column c of the row with its bias, as the composed form's add leaves it in T.
    auto at = [&](uint32_t c) {
        const float x = to_f(row[c]);
        return has_bias ? to_f(from_f<T>(x + to_f(bias[c]))) : x;
    };
    const size_t slot_row = cache_row(blocks, rows[2 * i], block, (size_t)rows[2 * i + 1] - 1);
    if (j < q_pairs + k_pairs) {
        const bool query = j < q_pairs;
        const uint32_t p = query ? j : j - q_pairs, h = p / half, k = p % half;
        const uint32_t first = (query ? 0 : heads * hd) + h * hd;
        const float c = cos[i * half + k], s = sin[i * half + k];
        const float x1 = at(first + k), x2 = at(first + k + half);
        T *out = query ? q + (i * heads + h) * hd : keys + slot_row * kv_width + h * hd;
        out[k] = from_f<T>(x1 * c - x2 * s);
        out[k + half] = from_f<T>(x2 * c + x1 * s);
    } else {
        const uint32_t c = j - q_pairs - k_pairs;
        values[slot_row * kv_width + c] = from_f<T>(at(heads * hd + kv_width + c));
    }
}

template <typename T>
__device__ void decode_attention(const T *q, const T *keys, const T *values, const uint32_t *rows,
                                 const uint32_t *blocks, uint32_t block, T *out, uint32_t heads, uint32_t kv_heads,
                                 uint32_t hd, float scale, uint32_t n) {
    const uint32_t i = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const uint32_t kvh = h / (heads / kv_heads);
    const uint32_t chunks = hd / 32;
    if (i >= n) {  // a padding row
        T *orow = out + ((size_t)i * heads + h) * hd;
        for (uint32_t j = 0; j < chunks; ++j) orow[lane + 32 * j] = from_f<T>(0.0f);
        return;
    }
    const uint32_t table = rows[2 * i];
    const size_t len = rows[2 * i + 1];
    float qv[MAX_CHUNKS], acc[MAX_CHUNKS];
    const T *qr = q + ((size_t)i * heads + h) * hd;
    for (uint32_t j = 0; j < chunks; ++j) {
        qv[j] = to_f(qr[lane + 32 * j]) * scale;
        acc[j] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    // Position by position in order (the block's row advanced without a division).
    size_t row = cache_row(blocks, table, block, 0);
    for (size_t p = 0; p < len; ++p, ++row) {
        if (p % block == 0) row = cache_row(blocks, table, block, p);
        const size_t at = (row * kv_heads + kvh) * hd;
        float s = 0.0f;
        for (uint32_t j = 0; j < chunks; ++j) s += qv[j] * to_f(keys[at + lane + 32 * j]);
        for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
        const float m_new = fmaxf(m, s);
        const float correction = expf(m - m_new);  // 0 on the first position (m = -inf)
        const float w = expf(s - m_new);
        l = l * correction + w;
        for (uint32_t j = 0; j < chunks; ++j) acc[j] = acc[j] * correction + w * to_f(values[at + lane + 32 * j]);
        m = m_new;
    }
    T *orow = out + ((size_t)i * heads + h) * hd;
    for (uint32_t j = 0; j < chunks; ++j) orow[lane + 32 * j] = from_f<T>(acc[j] / l);
}

#define DECODE_KERNELS(SUFFIX, T)                                                                     \
    extern "C" __global__ void decode_write_##SUFFIX(T *cache, const T *src, const uint32_t *rows,   \
                                                     const uint32_t *blocks, uint32_t block,           \
                                                     uint32_t width, size_t total) {                   \
        decode_write<T>(cache, src, rows, blocks, block, width, total);                               \
    }                                                                                                 \
    extern "C" __global__ void decode_attention_##SUFFIX(const T *q, const T *keys, const T *values, \
                                                         const uint32_t *rows, const uint32_t *blocks, \
                                                         uint32_t block, T *out, uint32_t heads,       \
                                                         uint32_t kv_heads, uint32_t hd, float scale,   \
                                                         uint32_t n) {                                  \
        decode_attention<T>(q, keys, values, rows, blocks, block, out, heads, kv_heads, hd, scale, n); \
    }                                                                                                 \
    extern "C" __global__ void decode_project_##SUFFIX(const T *qkv, const T *bias, uint32_t has_bias,   \
                                                       const float *cos, const float *sin,             \
                                                       const uint32_t *rows, const uint32_t *blocks,   \
                                                       uint32_t block, T *q, T *keys, T *values,        \
                                                       uint32_t heads, uint32_t kv_heads, uint32_t hd,  \
                                                       size_t total) {                                  \
        decode_project<T>(qkv, bias, has_bias, cos, sin, rows, blocks, block, q, keys, values, heads,  \
                          kv_heads, hd, total);                                                         \
    }

DECODE_KERNELS(f32, float)
DECODE_KERNELS(bf16, __nv_bfloat16)
