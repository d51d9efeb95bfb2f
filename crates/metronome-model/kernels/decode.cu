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
__device__ void decode_attention(const T *q, const T *keys, const T *values, const uint32_t *rows,
                                 const uint32_t *blocks, uint32_t block, T *out, uint32_t heads, uint32_t kv_heads,
                                 uint32_t hd, float scale) {
    const uint32_t i = blockIdx.x, h = blockIdx.y, lane = threadIdx.x;
    const uint32_t kvh = h / (heads / kv_heads);
    const uint32_t chunks = hd / 32;
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
                                                         uint32_t kv_heads, uint32_t hd, float scale) { \
        decode_attention<T>(q, keys, values, rows, blocks, block, out, heads, kv_heads, hd, scale);   \
    }

DECODE_KERNELS(f32, float)
DECODE_KERNELS(bf16, __nv_bfloat16)
