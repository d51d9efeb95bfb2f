// kernels/decode.cu's decode_project and decode_attention (with padding rows) on the
// CPU (emulate.h), against references computed in double from the same inputs: a
// paged cache of 4-row blocks whose rows' block tables are out of order, grouped-query
// heads, with and without a bias, f32 and bf16. Every cache row a step does not write
// must keep what it held. Prints the largest errors; exits 1 when one is over its
// bound. Run by metronome-model's tests (tests/it/kernels_on_cpu.rs).
#include "emulate.h"
#include "../decode.cu"

#include <algorithm>
#include <cstdio>
#include <random>

template <typename T> static T to_t(float x);
template <> float to_t<float>(float x) { return x; }
template <> __nv_bfloat16 to_t<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <typename T> static bool same(T a, T b) { return std::memcmp(&a, &b, sizeof(T)) == 0; }

struct Step {
    uint32_t heads = 4, kvh = 2, hd = 32, block = 4;
    std::vector<uint32_t> blocks = {5, 2, 7, 0, 3, 6, 1, 4};  // 8 blocks of 4 cache rows
    std::vector<uint32_t> rows = {0, 7, 3, 1, 4, 14};         // (table start, length) per row
    uint32_t n() const { return uint32_t(rows.size() / 2); }
    size_t cache_row(uint32_t i, size_t p) const {
        return size_t(blocks[rows[2 * i] + p / block]) * block + p % block;
    }
};

template <typename T>
static bool check_project(const Step &st, bool with_bias, double tol, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    const uint32_t n = st.n(), padded = n + 2, half = st.hd / 2;
    const uint32_t qw = st.heads * st.hd, kvw = st.kvh * st.hd, width = qw + 2 * kvw;
    std::vector<T> qkv(size_t(padded) * width), bias(width);
    for (auto &x : qkv) x = to_t<T>(u(rng));
    for (auto &x : bias) x = to_t<T>(u(rng));
    std::vector<float> cos(size_t(n) * half), sin(size_t(n) * half);
    for (size_t i = 0; i < cos.size(); ++i) {
        const float a = 3.f * u(rng);
        cos[i] = std::cos(a);
        sin[i] = std::sin(a);
    }
    const size_t cache_rows = st.blocks.size() * st.block;
    const T sentinel = to_t<T>(7.f);
    std::vector<T> keys(cache_rows * kvw, sentinel), values(cache_rows * kvw, sentinel), q(size_t(n) * qw);
    const uint32_t per_row = (st.heads + st.kvh) * half + kvw;
    const size_t total = size_t(n) * per_row;
    const unsigned grid = unsigned((total + 255) / 256);
    emulate_launch(grid, 1, 256, [&] {
        if constexpr (sizeof(T) == 2)
            decode_project_bf16(qkv.data(), bias.data(), with_bias, cos.data(), sin.data(), st.rows.data(),
                                st.blocks.data(), st.block, q.data(), keys.data(), values.data(), st.heads, st.kvh,
                                st.hd, total);
        else
            decode_project_f32(qkv.data(), bias.data(), with_bias, cos.data(), sin.data(), st.rows.data(),
                               st.blocks.data(), st.block, q.data(), keys.data(), values.data(), st.heads, st.kvh,
                               st.hd, total);
    });
    // The reference: the bias added and rounded to T (as the composed form's add in T),
    // then the rotation in double.
    auto in = [&](uint32_t i, uint32_t c) {
        const float x = to_f(qkv[size_t(i) * width + c]);
        return double(with_bias ? to_f(to_t<T>(x + to_f(bias[c]))) : x);
    };
    double err = 0;
    std::vector<bool> written(cache_rows, false);
    for (uint32_t i = 0; i < n; ++i) {
        const size_t at = st.cache_row(i, st.rows[2 * i + 1] - 1);
        written[at] = true;
        auto rotated = [&](uint32_t first, uint32_t k, bool second) {
            const double c = cos[i * half + k], s = sin[i * half + k];
            const double x1 = in(i, first + k), x2 = in(i, first + k + half);
            return second ? x2 * c + x1 * s : x1 * c - x2 * s;
        };
        for (uint32_t h = 0; h < st.heads; ++h)
            for (uint32_t k = 0; k < half; ++k)
                for (int second = 0; second < 2; ++second) {
                    const double want = rotated(h * st.hd, k, second);
                    err = std::max(err, std::abs(to_f(q[(size_t(i) * st.heads + h) * st.hd + k + second * half]) - want));
                }
        for (uint32_t h = 0; h < st.kvh; ++h)
            for (uint32_t k = 0; k < half; ++k)
                for (int second = 0; second < 2; ++second) {
                    const double want = rotated(qw + h * st.hd, k, second);
                    err = std::max(err, std::abs(to_f(keys[at * kvw + h * st.hd + k + second * half]) - want));
                }
        for (uint32_t c = 0; c < kvw; ++c) err = std::max(err, std::abs(to_f(values[at * kvw + c]) - in(i, qw + kvw + c)));
    }
    bool untouched = true;
    for (size_t r = 0; r < cache_rows; ++r)
        for (uint32_t c = 0; !written[r] && c < kvw; ++c)
            untouched &= same(keys[r * kvw + c], sentinel) && same(values[r * kvw + c], sentinel);
    const bool ok = err <= tol && untouched;
    std::printf("%-4s decode_project %-9s heads %u/%u hd %u: max err %.2e (bound %.0e), other cache rows %s %s\n",
                sizeof(T) == 2 ? "bf16" : "f32", with_bias ? "with bias" : "no bias", st.heads, st.kvh, st.hd, err,
                tol, untouched ? "kept" : "WRITTEN", ok ? "ok" : "OVER");
    return ok;
}

template <typename T> static bool check_attention(const Step &st, double tol, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-1.f, 1.f);
    const uint32_t n = st.n(), out_rows = n + 3;
    const uint32_t qw = st.heads * st.hd, kvw = st.kvh * st.hd;
    const size_t cache_rows = st.blocks.size() * st.block;
    std::vector<T> q(size_t(n) * qw), keys(cache_rows * kvw), values(cache_rows * kvw);
    for (auto *v : {&q, &keys, &values})
        for (auto &x : *v) x = to_t<T>(u(rng));
    std::vector<T> out(size_t(out_rows) * qw, to_t<T>(9.f));
    const float scale = 1.f / std::sqrt(float(st.hd));
    emulate_launch(out_rows, st.heads, 32, [&] {
        if constexpr (sizeof(T) == 2)
            decode_attention_bf16(q.data(), keys.data(), values.data(), st.rows.data(), st.blocks.data(), st.block,
                                  out.data(), st.heads, st.kvh, st.hd, scale, n);
        else
            decode_attention_f32(q.data(), keys.data(), values.data(), st.rows.data(), st.blocks.data(), st.block,
                                 out.data(), st.heads, st.kvh, st.hd, scale, n);
    });
    double err = 0;
    for (uint32_t i = 0; i < n; ++i) {
        const size_t len = st.rows[2 * i + 1];
        for (uint32_t h = 0; h < st.heads; ++h) {
            const uint32_t kh = h / (st.heads / st.kvh);
            std::vector<double> s(len);
            double m = -1e300, sum = 0;
            for (size_t p = 0; p < len; ++p) {
                const size_t at = st.cache_row(i, p) * kvw + kh * st.hd;
                double dot = 0;
                for (uint32_t d = 0; d < st.hd; ++d)
                    dot += double(to_f(q[(size_t(i) * st.heads + h) * st.hd + d])) * scale * to_f(keys[at + d]);
                s[p] = dot;
                m = std::max(m, dot);
            }
            for (auto &x : s) sum += (x = std::exp(x - m));
            for (uint32_t d = 0; d < st.hd; ++d) {
                double want = 0;
                for (size_t p = 0; p < len; ++p) want += s[p] / sum * to_f(values[st.cache_row(i, p) * kvw + kh * st.hd + d]);
                err = std::max(err, std::abs(to_f(out[(size_t(i) * st.heads + h) * st.hd + d]) - want));
            }
        }
    }
    bool zeros = true;
    for (size_t e = size_t(n) * qw; e < out.size(); ++e) zeros &= to_f(out[e]) == 0.f;
    const bool ok = err <= tol && zeros;
    std::printf("%-4s decode_attention heads %u/%u hd %u, %u rows into %u: max err %.2e (bound %.0e), padding %s %s\n",
                sizeof(T) == 2 ? "bf16" : "f32", st.heads, st.kvh, st.hd, n, out_rows, err, tol,
                zeros ? "zeros" : "NOT ZERO", ok ? "ok" : "OVER");
    return ok;
}

int main() {
    Step st;
    bool ok = true;
    for (bool bias : {false, true}) {
        ok &= check_project<float>(st, bias, 1e-6, 1 + bias);
        ok &= check_project<__nv_bfloat16>(st, bias, 1e-2, 3 + bias);
    }
    ok &= check_attention<float>(st, 1e-5, 5);
    ok &= check_attention<__nv_bfloat16>(st, 1e-2, 6);
    Step wide;  // heads of 64: two chunks of 32 per lane
    wide.hd = 64;
    ok &= check_project<float>(wide, true, 1e-6, 7);
    ok &= check_attention<float>(wide, 1e-5, 8);
    return ok ? 0 : 1;
}
