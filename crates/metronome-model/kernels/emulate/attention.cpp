// kernels/attention.cu on the CPU (emulate.h), against attention computed in double
// from the same inputs: packed rows with a shared-prompt tree, a nested tree and a
// plain row, grouped-query heads, head dimensions for each lane share (PL 8, 16, 32)
// and one that leaves lanes idle, f32 and bf16. The layout is built as src/cuda.rs
// builds it (FlashLayout). Prints the largest errors; exits 1 when one is over its
// bound. Run by metronome-model's tests (tests/it/kernels_on_cpu.rs).
#include "emulate.h"
#include "../attention.cu"

#include <algorithm>
#include <cstdio>
#include <random>

struct Seg {
    uint32_t len;
    int parent;  // -1: a root
};

struct Layout {
    std::vector<uint32_t> seg, keys, qtiles, ktiles, vrange, viewers;
    std::vector<std::vector<uint32_t>> key_lists;  // per segment, for the reference
    std::vector<uint32_t> qbase, qlen, visible;    // per segment
    uint32_t n = 0;
};

static Layout layout_of(const std::vector<std::vector<Seg>> &rows) {
    Layout l;
    std::vector<std::vector<uint32_t>> viewers;
    for (const auto &row : rows) {
        const uint32_t first = uint32_t(l.qlen.size()), row_start = l.n;
        uint32_t start = 0;
        std::vector<uint32_t> starts;
        for (const auto &s : row) {
            starts.push_back(start);
            start += s.len;
        }
        for (size_t i = 0; i < row.size(); ++i) {
            std::vector<uint32_t> chain;  // ancestors, root first
            for (int p = row[i].parent; p >= 0; p = row[p].parent) chain.insert(chain.begin(), uint32_t(p));
            std::vector<uint32_t> keys;
            for (uint32_t a : chain) {
                for (uint32_t j = 0; j < row[a].len; ++j) keys.push_back(row_start + starts[a] + j);
                viewers[first + a].push_back(first + uint32_t(i));
            }
            const uint32_t vis = uint32_t(keys.size());
            for (uint32_t j = 0; j < row[i].len; ++j) keys.push_back(row_start + starts[i] + j);
            const uint32_t s = uint32_t(l.qlen.size());
            l.seg.insert(l.seg.end(), {row_start, starts[i], row[i].len, vis, uint32_t(l.keys.size())});
            l.keys.insert(l.keys.end(), keys.begin(), keys.end());
            l.key_lists.push_back(keys);
            l.qbase.push_back(row_start + starts[i]);
            l.qlen.push_back(row[i].len);
            l.visible.push_back(vis);
            viewers.push_back({s});
            for (uint32_t q0 = 0; q0 < row[i].len; q0 += QB) l.qtiles.insert(l.qtiles.end(), {s, q0});
            for (uint32_t k0 = 0; k0 < row[i].len; k0 += KB) l.ktiles.insert(l.ktiles.end(), {s, k0});
        }
        l.n += start;
    }
    l.vrange.push_back(0);
    for (const auto &v : viewers) {
        l.viewers.insert(l.viewers.end(), v.begin(), v.end());
        l.vrange.push_back(uint32_t(l.viewers.size()));
    }
    return l;
}

struct Grads {
    std::vector<double> o, dq, dk, dv;
};

// Attention and its gradients in double: each segment's query i over the first
// visible + i + 1 keys of its list.
static Grads reference(const Layout &l, const std::vector<double> &q, const std::vector<double> &k,
                       const std::vector<double> &v, const std::vector<double> &g, uint32_t heads, uint32_t kvh,
                       uint32_t hd) {
    Grads r{std::vector<double>(q.size()), std::vector<double>(q.size()), std::vector<double>(k.size()),
            std::vector<double>(k.size())};
    const double scale = 1.0 / std::sqrt(double(hd));
    const uint32_t rep = heads / kvh;
    for (size_t s = 0; s < l.qlen.size(); ++s) {
        for (uint32_t i = 0; i < l.qlen[s]; ++i) {
            const uint32_t qp = l.qbase[s] + i, nk = l.visible[s] + i + 1;
            for (uint32_t h = 0; h < heads; ++h) {
                const uint32_t kh = h / rep;
                auto Q = [&](uint32_t d) { return q[(size_t(qp) * heads + h) * hd + d]; };
                auto K = [&](uint32_t j, uint32_t d) { return k[(size_t(l.key_lists[s][j]) * kvh + kh) * hd + d]; };
                auto V = [&](uint32_t j, uint32_t d) { return v[(size_t(l.key_lists[s][j]) * kvh + kh) * hd + d]; };
                std::vector<double> p(nk);
                double m = -INFINITY, sum = 0;
                for (uint32_t j = 0; j < nk; ++j) {
                    double x = 0;
                    for (uint32_t d = 0; d < hd; ++d) x += Q(d) * K(j, d);
                    p[j] = x * scale;
                    m = std::max(m, p[j]);
                }
                for (auto &x : p) sum += (x = std::exp(x - m));
                for (auto &x : p) x /= sum;
                const size_t at = (size_t(qp) * heads + h) * hd;
                double dsum = 0;
                for (uint32_t d = 0; d < hd; ++d) {
                    double o = 0;
                    for (uint32_t j = 0; j < nk; ++j) o += p[j] * V(j, d);
                    r.o[at + d] = o;
                    dsum += o * g[at + d];
                }
                for (uint32_t j = 0; j < nk; ++j) {
                    const size_t kat = (size_t(l.key_lists[s][j]) * kvh + kh) * hd;
                    double dp = 0;
                    for (uint32_t d = 0; d < hd; ++d) dp += g[at + d] * V(j, d);
                    const double ds = p[j] * (dp - dsum);
                    for (uint32_t d = 0; d < hd; ++d) {
                        r.dq[at + d] += ds * K(j, d) * scale;
                        r.dk[kat + d] += ds * Q(d) * scale;
                        r.dv[kat + d] += p[j] * g[at + d];
                    }
                }
            }
        }
    }
    return r;
}

template <typename T> static T to_t(float x);
template <> float to_t<float>(float x) { return x; }
template <> __nv_bfloat16 to_t<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

// The largest |a - b| relative to the larger of 1 and the largest |b|.
template <typename T> static double rel_err(const std::vector<T> &a, const std::vector<double> &b) {
    double err = 0, big = 1;
    for (size_t i = 0; i < b.size(); ++i) {
        err = std::max(err, std::abs(double(to_f(a[i])) - b[i]));
        big = std::max(big, std::abs(b[i]));
    }
    return err / big;
}

template <typename T>
static bool check(const char *name, const std::vector<std::vector<Seg>> &rows, uint32_t heads, uint32_t kvh,
                  uint32_t hd, double tol_o, double tol_g, uint32_t seed) {
    const Layout l = layout_of(rows);
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    auto fill = [&](size_t count, std::vector<T> &t, std::vector<double> &d) {
        for (size_t i = 0; i < count; ++i) {
            t.push_back(to_t<T>(u(rng)));
            d.push_back(to_f(t.back()));  // the reference reads what the kernel reads
        }
    };
    std::vector<T> q, k, v, g;
    std::vector<double> qd, kd, vd, gd;
    fill(size_t(l.n) * heads * hd, q, qd);
    fill(size_t(l.n) * kvh * hd, k, kd);
    fill(size_t(l.n) * kvh * hd, v, vd);
    fill(size_t(l.n) * heads * hd, g, gd);
    const Grads want = reference(l, qd, kd, vd, gd, heads, kvh, hd);
    std::vector<T> o(q.size()), dq(q.size()), dk(k.size()), dv(k.size());
    std::vector<float> lse(size_t(l.n) * heads), dsum(size_t(l.n) * heads);
    const float scale = 1.f / std::sqrt(float(hd));
    const unsigned nq = unsigned(l.qtiles.size() / 2), nk = unsigned(l.ktiles.size() / 2);
    const int pl = hd <= 32 ? 8 : hd <= 64 ? 16 : 32;
#define RUN(SUFFIX, PL)                                                                                          \
    emulate_launch(nq, heads, THREADS, [&] {                                                                     \
        flash_fwd_##SUFFIX##_##PL(q.data(), k.data(), v.data(), o.data(), lse.data(), l.seg.data(), l.keys.data(), \
                                  l.qtiles.data(), heads, kvh, hd, scale);                                     \
    });                                                                                                          \
    emulate_launch(nq, heads, THREADS, [&] {                                                                     \
        flash_bwd_q_##SUFFIX##_##PL(q.data(), k.data(), v.data(), o.data(), g.data(), lse.data(), dsum.data(),   \
                                    dq.data(), l.seg.data(), l.keys.data(), l.qtiles.data(), heads, kvh, hd,     \
                                    scale);                                                                      \
    });                                                                                                          \
    emulate_launch(nk, kvh, THREADS, [&] {                                                                       \
        flash_bwd_kv_##SUFFIX##_##PL(q.data(), k.data(), v.data(), g.data(), lse.data(), dsum.data(), dk.data(), \
                                     dv.data(), l.seg.data(), l.ktiles.data(), l.vrange.data(),                  \
                                     l.viewers.data(), heads, kvh, hd, scale);                                   \
    });
    constexpr bool bf16 = sizeof(T) == 2;
    if constexpr (bf16) {
        if (pl == 8) { RUN(bf16, 8) }
        if (pl == 16) { RUN(bf16, 16) }
        if (pl == 32) { RUN(bf16, 32) }
    } else {
        if (pl == 8) { RUN(f32, 8) }
        if (pl == 16) { RUN(f32, 16) }
        if (pl == 32) { RUN(f32, 32) }
    }
    const double eo = rel_err(o, want.o), eq = rel_err(dq, want.dq), ek = rel_err(dk, want.dk),
                 ev = rel_err(dv, want.dv);
    const bool ok = eo <= tol_o && eq <= tol_g && ek <= tol_g && ev <= tol_g;
    std::printf("%-4s %-26s heads %u/%u hd %3u (PL %2d): o %.2e dq %.2e dk %.2e dv %.2e (bounds %.0e, %.0e) %s\n",
                bf16 ? "bf16" : "f32", name, heads, kvh, hd, pl, eo, eq, ek, ev, tol_o, tol_g, ok ? "ok" : "OVER");
    return ok;
}

int main() {
    // A shared prompt with three responses (the tiles' edges fall inside segments and
    // a response shorter than a tile), a plain row, and a nested tree (a response to a
    // response beside one to the root).
    const std::vector<std::vector<Seg>> rows = {
        {{40, -1}, {70, 0}, {33, 0}, {5, 0}},
        {{37, -1}},
        {{10, -1}, {12, 0}, {9, 1}, {3, 0}},
    };
    bool ok = true;
    // f32 against double: the bounds of the portable forms' tests (1e-5, 1e-4).
    for (uint32_t hd : {32u, 64u, 128u, 18u}) ok &= check<float>("tree, plain row, nested", rows, 4, 2, hd, 1e-5, 1e-4, hd);
    ok &= check<float>("one head per kv head", rows, 3, 3, 64, 1e-5, 1e-4, 7);
    // bf16 inputs and outputs: each output rounded once (2^-8 of its magnitude).
    for (uint32_t hd : {32u, 64u, 128u}) ok &= check<__nv_bfloat16>("tree, plain row, nested", rows, 4, 2, hd, 1e-2, 1e-2, hd + 1);
    return ok ? 0 : 1;
}
