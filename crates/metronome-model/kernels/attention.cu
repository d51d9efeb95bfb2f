// The attention of a training batch's packed rows, segment by segment, flash style:
// forward and backward without a [T, T] score or probability tensor anywhere, reading
// q: [n, heads, hd] and k, v: [n, kv_heads, hd] in the token-major layout the
// projections write (no permutes into a head-major layout and back), f32 or bf16 (T),
// every product and statistic in f32. Its reference is the fused CPU op
// (src/ops/attention.rs) and the portable per-segment form (src/portable.rs): the same
// visibility rule and formulas.
//
// A segment's query i sees the first visible + i + 1 keys of its key list: its
// ancestors' whole spans (visible keys), then its own causal prefix. The host lays out
// (src/cuda.rs, FlashLayout), as u32:
//   seg      [segments][5]: row start (global position of the row's first token), the
//            segment's start in its row, its length, visible, offset of its key list
//   keys     the key lists, each key as its global position
//   qtiles   [tiles][2]: (segment, first query) for every QB queries of every segment
//   ktiles   [tiles][2]: (segment, first key) for every KB of a segment's own positions
//   viewers  per segment s, from vrange[s] to vrange[s + 1]: s, then every segment whose
//            ancestors include s (they see all of s's keys)
//
// forward   one block of THREADS per (query tile, head); four lanes per query, each
//           holding a quarter of its scaled query and its output (lane_dim); key
//           and value tiles of KB keys through shared memory; an online softmax
//           (running max m and sum l), as flash attention does. Writes o and the
//           log-sum-exp of each query's scores (lse: [n, heads] f32) for the backward.
// backward  recomputes each block of probabilities from q, k and lse, p = exp(s - lse):
//   dq      one block per (query tile, head): D = sum(dO o) per query (also written to
//           dsum: [n, heads] f32 for dkv), then over the key tiles
//           dp = dO . v, ds = p (dp - D), dq += ds k; dq *= scale
//   dkv     one block per (key tile, kv head), after dq: four lanes per key; over the
//           viewers of the tile's segment (itself causally, its descendants whole), the
//           query heads of the kv head and the query tiles that see the keys:
//           dv += p dO, dk += ds (scale q)
// Every output element is written by one thread, summed in a fixed order: no atomics,
// and the result does not depend on the launch's scheduling (deterministic, as the CPU
// op is).

#include <cuda_bf16.h>
#include <stdint.h>

#define THREADS 128  // four lanes for each of QB queries (or KB keys)
#define QB 32        // queries per tile
#define KB 32        // keys per tile
#define MAX_HD 128   // the largest head dimension (shared tiles of KB x MAX_HD floats)

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// The sum of x over the four lanes of one query (or key): lanes 4r .. 4r + 3 of a warp.
__device__ __forceinline__ float quad_sum(float x) {
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    x += __shfl_xor_sync(0xffffffffu, x, 2);
    return x;
}

// The dimension of a lane's t-th value: the four lanes of a query (or key) take turns
// by chunks of four, lane c holding dimensions 4c .. 4c + 3, then 16 + 4c .., so that
// it reads a shared row's chunk as one 16-byte load (PL, its count, is a multiple of 4).
__device__ __forceinline__ uint32_t lane_dim(uint32_t c, int t) { return 16 * (t / 4) + 4 * c + (t % 4); }

// The dot product of a lane's share of a vector (PL values, at lane_dim) with row `row`
// of a shared tile of hd-wide rows, summed over the four lanes. Chunks whole when hd is
// a multiple of 4 (every model's), element by element otherwise.
template <int PL>
__device__ __forceinline__ float quad_dot(const float (&mine)[PL], const float *tile, uint32_t row, uint32_t hd,
                                          uint32_t c) {
    const float *r = tile + row * hd;
    float part = 0.f;
    if ((hd & 3) == 0) {
#pragma unroll
        for (int t = 0; t < PL; t += 4) {
            const uint32_t d = lane_dim(c, t);
            if (d < hd) {
                const float4 x = *reinterpret_cast<const float4 *>(r + d);
                part += mine[t] * x.x + mine[t + 1] * x.y + mine[t + 2] * x.z + mine[t + 3] * x.w;
            }
        }
    } else {
#pragma unroll
        for (int t = 0; t < PL; ++t) {
            const uint32_t d = lane_dim(c, t);
            if (d < hd) part += mine[t] * r[d];
        }
    }
    return quad_sum(part);
}

// acc += a x (row `row` of a shared tile), over a lane's share, as quad_dot reads it.
template <int PL>
__device__ __forceinline__ void quad_axpy(float (&acc)[PL], float a, const float *tile, uint32_t row, uint32_t hd,
                                          uint32_t c) {
    const float *r = tile + row * hd;
    if ((hd & 3) == 0) {
#pragma unroll
        for (int t = 0; t < PL; t += 4) {
            const uint32_t d = lane_dim(c, t);
            if (d < hd) {
                const float4 x = *reinterpret_cast<const float4 *>(r + d);
                acc[t] += a * x.x;
                acc[t + 1] += a * x.y;
                acc[t + 2] += a * x.z;
                acc[t + 3] += a * x.w;
            }
        }
    } else {
#pragma unroll
        for (int t = 0; t < PL; ++t) {
            const uint32_t d = lane_dim(c, t);
            if (d < hd) acc[t] += a * r[d];
        }
    }
}

// Loads `count` rows (of hd) of a [n, width_heads, hd] tensor into a shared tile: rows
// at global positions pos(j), head `head`, scaled by `scale`.
template <typename T, typename Pos>
__device__ __forceinline__ void load_tile(float *tile, const T *x, uint32_t count, uint32_t width_heads,
                                          uint32_t head, uint32_t hd, float scale, Pos pos) {
    for (uint32_t e = threadIdx.x; e < count * hd; e += THREADS) {
        const uint32_t j = e / hd, d = e - j * hd;
        tile[e] = to_f(x[((size_t)pos(j) * width_heads + head) * hd + d]) * scale;
    }
}

// A block's tile of queries (the forward's and dq's): its head, segment and key list,
// and this thread's query (lane c of query i; a lane past the segment's end is dead,
// computes on the segment's first query and writes nothing).
struct QueryTile {
    uint32_t c, kvh, nkeys, limit;
    const uint32_t *key;
    bool live;
    size_t row;  // the query's row of [n, heads]

    __device__ QueryTile(const uint32_t *seg, const uint32_t *keys, const uint32_t *qtiles, uint32_t heads,
                         uint32_t kv_heads) {
        const uint32_t h = blockIdx.y, *sg = seg + 5 * qtiles[2 * blockIdx.x];
        const uint32_t q0 = qtiles[2 * blockIdx.x + 1], len = sg[2], visible = sg[3];
        const uint32_t i = q0 + (threadIdx.x >> 2);
        key = keys + sg[4];
        kvh = h / (heads / kv_heads);
        c = threadIdx.x & 3;
        live = i < len;
        row = (size_t)(sg[0] + sg[1] + (live ? i : 0)) * heads + h;
        // The keys the tile's last query sees bound the loop; this query sees `limit`.
        nkeys = visible + min(q0 + QB, len);
        limit = visible + i + 1;
    }

    // Loads keys j0 .. j0 + nk of the list (every thread of the block calls it).
    template <typename T>
    __device__ void load_keys(float *ks, float *vs, const T *k, const T *v, uint32_t j0, uint32_t nk,
                              uint32_t kv_heads, uint32_t hd) const {
        __syncthreads();  // the previous tile is read by every thread
        load_tile(ks, k, nk, kv_heads, kvh, hd, 1.f, [&](uint32_t j) { return key[j0 + j]; });
        load_tile(vs, v, nk, kv_heads, kvh, hd, 1.f, [&](uint32_t j) { return key[j0 + j]; });
        __syncthreads();
    }
};

template <typename T, int PL>
__device__ void flash_fwd(const T *q, const T *k, const T *v, T *o, float *lse, const uint32_t *seg,
                          const uint32_t *keys, const uint32_t *qtiles, uint32_t heads, uint32_t kv_heads,
                          uint32_t hd, float scale) {
    __shared__ __align__(16) float ks[KB * MAX_HD];
    __shared__ __align__(16) float vs[KB * MAX_HD];
    const QueryTile qt(seg, keys, qtiles, heads, kv_heads);
    const uint32_t c = qt.c;
    const bool live = qt.live;
    const size_t at = qt.row * hd;
    float qr[PL], acc[PL];
#pragma unroll
    for (int t = 0; t < PL; ++t) {
        const uint32_t d = lane_dim(c, t);
        qr[t] = live && d < hd ? to_f(q[at + d]) * scale : 0.f;
        acc[t] = 0.f;
    }
    float m = -INFINITY, l = 0.f;
    for (uint32_t j0 = 0; j0 < qt.nkeys; j0 += KB) {
        const uint32_t nk = min((uint32_t)KB, qt.nkeys - j0);
        qt.load_keys(ks, vs, k, v, j0, nk, kv_heads, hd);
        float sc[KB];
        float mt = -INFINITY;
#pragma unroll
        for (int j = 0; j < KB; ++j) {
            sc[j] = -INFINITY;
            if (j < nk) {  // uniform over the block: every lane reaches the shuffles
                const float x = quad_dot<PL>(qr, ks, j, hd, c);
                if (j0 + j < qt.limit) sc[j] = x;
            }
            mt = fmaxf(mt, sc[j]);
        }
        // Key 0, in the first tile, is seen by every query: m is finite from then on.
        const float mn = fmaxf(m, mt);
        const float alpha = m == -INFINITY ? 0.f : expf(m - mn);
        l *= alpha;
#pragma unroll
        for (int t = 0; t < PL; ++t) acc[t] *= alpha;
#pragma unroll
        for (int j = 0; j < KB; ++j) {
            if (sc[j] == -INFINITY) continue;
            const float p = expf(sc[j] - mn);
            l += p;
            quad_axpy<PL>(acc, p, vs, j, hd, c);
        }
        m = mn;
    }
    if (live) {
#pragma unroll
        for (int t = 0; t < PL; ++t) {
            const uint32_t d = lane_dim(c, t);
            if (d < hd) o[at + d] = from_f<T>(acc[t] / l);
        }
        if (c == 0) lse[qt.row] = m + logf(l);
    }
}

template <typename T, int PL>
__device__ void flash_bwd_q(const T *q, const T *k, const T *v, const T *o, const T *g, const float *lse,
                            float *dsum, T *dq, const uint32_t *seg, const uint32_t *keys, const uint32_t *qtiles,
                            uint32_t heads, uint32_t kv_heads, uint32_t hd, float scale) {
    __shared__ __align__(16) float ks[KB * MAX_HD];
    __shared__ __align__(16) float vs[KB * MAX_HD];
    const QueryTile qt(seg, keys, qtiles, heads, kv_heads);
    const uint32_t c = qt.c;
    const bool live = qt.live;
    const size_t row = qt.row, at = row * hd;
    float qr[PL], gr[PL], acc[PL];
    float dsum_part = 0.f;
#pragma unroll
    for (int t = 0; t < PL; ++t) {
        const uint32_t d = lane_dim(c, t);
        const bool in = live && d < hd;
        qr[t] = in ? to_f(q[at + d]) * scale : 0.f;
        gr[t] = in ? to_f(g[at + d]) : 0.f;
        dsum_part += in ? gr[t] * to_f(o[at + d]) : 0.f;
        acc[t] = 0.f;
    }
    const float dsum_i = quad_sum(dsum_part);
    const float lse_i = live ? lse[row] : 0.f;
    if (live && c == 0) dsum[row] = dsum_i;
    for (uint32_t j0 = 0; j0 < qt.nkeys; j0 += KB) {
        const uint32_t nk = min((uint32_t)KB, qt.nkeys - j0);
        qt.load_keys(ks, vs, k, v, j0, nk, kv_heads, hd);
        for (uint32_t j = 0; j < nk; ++j) {
            const float x = quad_dot<PL>(qr, ks, j, hd, c);
            const float dp = quad_dot<PL>(gr, vs, j, hd, c);
            const float p = live && j0 + j < qt.limit ? expf(x - lse_i) : 0.f;
            const float ds = p * (dp - dsum_i);
            quad_axpy<PL>(acc, ds, ks, j, hd, c);
        }
    }
    if (live) {
#pragma unroll
        for (int t = 0; t < PL; ++t) {
            const uint32_t d = lane_dim(c, t);
            if (d < hd) dq[at + d] = from_f<T>(acc[t] * scale);
        }
    }
}

template <typename T, int PL>
__device__ void flash_bwd_kv(const T *q, const T *k, const T *v, const T *g, const float *lse, const float *dsum,
                             T *dk, T *dv, const uint32_t *seg, const uint32_t *ktiles, const uint32_t *vrange,
                             const uint32_t *viewers, uint32_t heads, uint32_t kv_heads, uint32_t hd, float scale) {
    __shared__ __align__(16) float qs[QB * MAX_HD];
    __shared__ __align__(16) float gs[QB * MAX_HD];
    __shared__ float lses[QB], dsums[QB];
    const uint32_t kvh = blockIdx.y, s = ktiles[2 * blockIdx.x], k0 = ktiles[2 * blockIdx.x + 1];
    const uint32_t *sg = seg + 5 * s;
    const uint32_t len = sg[2];
    const uint32_t r = threadIdx.x >> 2, c = threadIdx.x & 3, jl = k0 + r;  // jl: the key in its segment
    const bool live = jl < len;
    const size_t at = ((size_t)(sg[0] + sg[1] + (live ? jl : 0)) * kv_heads + kvh) * hd;
    float kr[PL], vr[PL], dka[PL], dva[PL];
#pragma unroll
    for (int t = 0; t < PL; ++t) {
        const uint32_t d = lane_dim(c, t);
        kr[t] = live && d < hd ? to_f(k[at + d]) : 0.f;
        vr[t] = live && d < hd ? to_f(v[at + d]) : 0.f;
        dka[t] = 0.f;
        dva[t] = 0.f;
    }
    const uint32_t rep = heads / kv_heads;
    for (uint32_t vi = vrange[s]; vi < vrange[s + 1]; ++vi) {
        const uint32_t w = viewers[vi];
        const uint32_t *sw = seg + 5 * w;
        const uint32_t wbase = sw[0] + sw[1], wlen = sw[2];
        // The segment's own queries see its key jl from query jl on; a descendant's all.
        const bool own = w == s;
        for (uint32_t hh = 0; hh < rep; ++hh) {
            const uint32_t h = kvh * rep + hh;
            for (uint32_t i0 = own ? k0 / QB * QB : 0; i0 < wlen; i0 += QB) {
                const uint32_t nq = min((uint32_t)QB, wlen - i0);
                __syncthreads();
                load_tile(qs, q, nq, heads, h, hd, scale, [&](uint32_t i) { return wbase + i0 + i; });
                load_tile(gs, g, nq, heads, h, hd, 1.f, [&](uint32_t i) { return wbase + i0 + i; });
                if (threadIdx.x < nq) {
                    const size_t row = (size_t)(wbase + i0 + threadIdx.x) * heads + h;
                    lses[threadIdx.x] = lse[row];
                    dsums[threadIdx.x] = dsum[row];
                }
                __syncthreads();
                for (uint32_t ii = 0; ii < nq; ++ii) {
                    const float x = quad_dot<PL>(kr, qs, ii, hd, c);  // (scale q) . k
                    const float dp = quad_dot<PL>(vr, gs, ii, hd, c);
                    const bool seen = live && (!own || jl <= i0 + ii);
                    const float p = seen ? expf(x - lses[ii]) : 0.f;
                    const float ds = p * (dp - dsums[ii]);
                    quad_axpy<PL>(dva, p, gs, ii, hd, c);
                    quad_axpy<PL>(dka, ds, qs, ii, hd, c);
                }
            }
        }
    }
    if (live) {
#pragma unroll
        for (int t = 0; t < PL; ++t) {
            const uint32_t d = lane_dim(c, t);
            if (d < hd) {
                dk[at + d] = from_f<T>(dka[t]);
                dv[at + d] = from_f<T>(dva[t]);
            }
        }
    }
}

// Per element type and lane share PL (hd up to 4 PL): flash_{fwd,bwd_q,bwd_kv}_{f32,bf16}_{PL}.
#define FLASH_KERNELS(SUFFIX, T, PL)                                                                          \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_fwd_##SUFFIX##_##PL(                          \
        const T *q, const T *k, const T *v, T *o, float *lse, const uint32_t *seg, const uint32_t *keys,      \
        const uint32_t *qtiles, uint32_t heads, uint32_t kv_heads, uint32_t hd, float scale) {                \
        flash_fwd<T, PL>(q, k, v, o, lse, seg, keys, qtiles, heads, kv_heads, hd, scale);                     \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_bwd_q_##SUFFIX##_##PL(                        \
        const T *q, const T *k, const T *v, const T *o, const T *g, const float *lse, float *dsum, T *dq,     \
        const uint32_t *seg, const uint32_t *keys, const uint32_t *qtiles, uint32_t heads, uint32_t kv_heads, \
        uint32_t hd, float scale) {                                                                           \
        flash_bwd_q<T, PL>(q, k, v, o, g, lse, dsum, dq, seg, keys, qtiles, heads, kv_heads, hd, scale);      \
    }                                                                                                         \
    extern "C" __global__ void __launch_bounds__(THREADS) flash_bwd_kv_##SUFFIX##_##PL(                       \
        const T *q, const T *k, const T *v, const T *g, const float *lse, const float *dsum, T *dk, T *dv,    \
        const uint32_t *seg, const uint32_t *ktiles, const uint32_t *vrange, const uint32_t *viewers,         \
        uint32_t heads, uint32_t kv_heads, uint32_t hd, float scale) {                                        \
        flash_bwd_kv<T, PL>(q, k, v, g, lse, dsum, dk, dv, seg, ktiles, vrange, viewers, heads, kv_heads, hd, \
                            scale);                                                                           \
    }

FLASH_KERNELS(f32, float, 8)
FLASH_KERNELS(f32, float, 16)
FLASH_KERNELS(f32, float, 32)
FLASH_KERNELS(bf16, __nv_bfloat16, 8)
FLASH_KERNELS(bf16, __nv_bfloat16, 16)
FLASH_KERNELS(bf16, __nv_bfloat16, 32)
