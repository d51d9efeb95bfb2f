// kernels/layer.cu's decode-layout kernels on the CPU (emulate.h): add_rms_norm (the
// residual sum and the next RMSNorm in one pass) and swiglu_stacked, against
// references computed in double from the same inputs (the sum rounded to T, as the
// composed form's add leaves it), f32 and bf16, rows wider than a block's threads.
// Prints the largest errors; exits 1 when one is over its bound. Run by
// metronome-model's tests (tests/it/kernels_on_cpu.rs).
#include "emulate.h"
#include "../layer.cu"

#include <algorithm>
#include <cstdio>
#include <random>

template <typename T> static T to_t(float x);
template <> float to_t<float>(float x) { return x; }
template <> __nv_bfloat16 to_t<__nv_bfloat16>(float x) { return __float2bfloat16(x); }

template <typename T> static bool check_add_rms_norm(uint32_t rows, uint32_t d, double tol, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-2.f, 2.f);
    std::vector<T> x(size_t(rows) * d), y(x.size()), w(d), out(2 * x.size());
    for (auto *v : {&x, &y, &w})
        for (auto &e : *v) e = to_t<T>(u(rng));
    const float eps = 1e-5f;
    emulate_launch(rows, 1, NORM_THREADS, [&] {
        if constexpr (sizeof(T) == 2)
            add_rms_norm_bf16(x.data(), y.data(), w.data(), out.data(), d, eps);
        else
            add_rms_norm_f32(x.data(), y.data(), w.data(), out.data(), d, eps);
    });
    double err_sum = 0, err_norm = 0;
    for (uint32_t r = 0; r < rows; ++r) {
        std::vector<double> s(d);
        double ss = 0;
        for (uint32_t i = 0; i < d; ++i) {
            s[i] = to_f(to_t<T>(to_f(x[r * d + i]) + to_f(y[r * d + i])));
            ss += s[i] * s[i];
        }
        const double inv = 1 / std::sqrt(ss / d + eps);
        for (uint32_t i = 0; i < d; ++i) {
            err_sum = std::max(err_sum, std::abs(to_f(out[size_t(r) * d + i]) - s[i]));
            const double want = s[i] * inv * to_f(w[i]);
            err_norm = std::max(err_norm, std::abs(to_f(out[(size_t(rows) + r) * d + i]) - want) / std::max(1.0, std::abs(want)));
        }
    }
    const bool ok = err_sum == 0 && err_norm <= tol;
    std::printf("%-4s add_rms_norm %u rows of %u: sum err %.2e (bound 0), norm err %.2e (bound %.0e) %s\n",
                sizeof(T) == 2 ? "bf16" : "f32", rows, d, err_sum, err_norm, tol, ok ? "ok" : "OVER");
    return ok;
}

template <typename T> static bool check_swiglu_stacked(uint32_t rows, uint32_t inter, double tol, uint32_t seed) {
    std::mt19937 rng(seed);
    std::uniform_real_distribution<float> u(-3.f, 3.f);
    std::vector<T> gu(size_t(rows) * 2 * inter), o(size_t(rows) * inter);
    for (auto &e : gu) e = to_t<T>(u(rng));
    const size_t n = o.size();
    emulate_launch(unsigned((n + 255) / 256), 1, 256, [&] {
        if constexpr (sizeof(T) == 2)
            swiglu_stacked_bf16(gu.data(), o.data(), inter, n);
        else
            swiglu_stacked_f32(gu.data(), o.data(), inter, n);
    });
    double err = 0;
    for (uint32_t r = 0; r < rows; ++r)
        for (uint32_t c = 0; c < inter; ++c) {
            const double a = to_f(gu[size_t(r) * 2 * inter + c]), b = to_f(gu[size_t(r) * 2 * inter + inter + c]);
            const double want = a / (1 + std::exp(-a)) * b;
            err = std::max(err, std::abs(to_f(o[size_t(r) * inter + c]) - want) / std::max(1.0, std::abs(want)));
        }
    const bool ok = err <= tol;
    std::printf("%-4s swiglu_stacked %u rows of 2 x %u: err %.2e (bound %.0e) %s\n", sizeof(T) == 2 ? "bf16" : "f32",
                rows, inter, err, tol, ok ? "ok" : "OVER");
    return ok;
}

int main() {
    bool ok = true;
    ok &= check_add_rms_norm<float>(3, 600, 1e-6, 1);
    ok &= check_add_rms_norm<__nv_bfloat16>(3, 600, 1e-2, 2);
    ok &= check_swiglu_stacked<float>(3, 300, 1e-6, 3);
    ok &= check_swiglu_stacked<__nv_bfloat16>(3, 300, 1e-2, 4);
    return ok ? 0 : 1;
}
