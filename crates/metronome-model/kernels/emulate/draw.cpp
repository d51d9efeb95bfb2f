// kernels/draw.cu on the CPU (emulate.h): the plain and the truncated draw of each row
// given on stdin, for metronome-model's tests (tests/it/kernels_on_cpu.rs) to compare
// with src/draw.rs, the host's reference, on the same logits. Blocks of 64 threads
// (the device's are 1024): the kernels' runs, sums and searches are the same code at
// any block size, and 64 fibers keep the emulation quick.
//
// stdin, whitespace-separated, every float as its bits in hex:
//   dtype rows vocab                      (dtype 0: f32 logits, 1: bf16)
//   per row: inv u greedy top_k top_p min_floor   (inv f32, u f64, top_p f32, min_floor f64)
//   rows * vocab logits                   (f32 bits, or bf16 bits)
// stdout, per row, in hex: "<plain token> <plain log-prob bits> <truncated token> <its log-prob bits>".
#define DRAW_THREADS 64
#include "emulate.h"
#include "../draw.cu"

#include <cinttypes>
#include <cstdio>
#include <cstring>

template <typename T> static T from_bits(uint64_t b) {
    T x;
    std::memcpy(&x, &b, sizeof(T));
    return x;
}

template <typename T>
static void run(uint32_t rows, uint32_t vocab, const std::vector<float> &inv, const std::vector<double> &u,
                const std::vector<uint32_t> &greedy, const std::vector<uint32_t> &top_k,
                const std::vector<float> &top_p, const std::vector<double> &floor, const std::vector<T> &logits) {
    std::vector<uint32_t> plain(rows), truncated(rows);
    std::vector<float> plain_lp(rows), truncated_lp(rows);
    emulate_launch(rows, 1, DRAW_THREADS, [&] {
        if constexpr (sizeof(T) == 2)
            draw_rows_bf16(logits.data(), inv.data(), greedy.data(), u.data(), plain.data(), plain_lp.data(), vocab);
        else
            draw_rows_f32(logits.data(), inv.data(), greedy.data(), u.data(), plain.data(), plain_lp.data(), vocab);
    });
    emulate_launch(rows, 1, DRAW_THREADS, [&] {
        if constexpr (sizeof(T) == 2)
            draw_truncated_rows_bf16(logits.data(), inv.data(), u.data(), top_k.data(), top_p.data(), floor.data(),
                                     truncated.data(), truncated_lp.data(), vocab);
        else
            draw_truncated_rows_f32(logits.data(), inv.data(), u.data(), top_k.data(), top_p.data(), floor.data(),
                                    truncated.data(), truncated_lp.data(), vocab);
    });
    for (uint32_t r = 0; r < rows; ++r)
        std::printf("%x %x %x %x\n", plain[r], __float_as_uint(plain_lp[r]), truncated[r],
                    __float_as_uint(truncated_lp[r]));
}

int main() {
    uint32_t dtype, rows, vocab;
    if (std::scanf("%u %u %u", &dtype, &rows, &vocab) != 3) return 2;
    std::vector<float> inv(rows), top_p(rows);
    std::vector<double> u(rows), floor(rows);
    std::vector<uint32_t> greedy(rows), top_k(rows);
    for (uint32_t r = 0; r < rows; ++r) {
        uint64_t b_inv, b_u, b_p, b_floor;
        if (std::scanf("%" SCNx64 " %" SCNx64 " %u %u %" SCNx64 " %" SCNx64, &b_inv, &b_u, &greedy[r], &top_k[r], &b_p,
                       &b_floor) != 6)
            return 2;
        inv[r] = from_bits<float>(b_inv);
        u[r] = from_bits<double>(b_u);
        top_p[r] = from_bits<float>(b_p);
        floor[r] = from_bits<double>(b_floor);
    }
    std::vector<uint32_t> bits(size_t(rows) * vocab);
    for (auto &b : bits)
        if (std::scanf("%x", &b) != 1) return 2;
    if (dtype == 1) {
        std::vector<__nv_bfloat16> logits(bits.size());
        for (size_t i = 0; i < bits.size(); ++i) logits[i].bits = uint16_t(bits[i]);
        run(rows, vocab, inv, u, greedy, top_k, top_p, floor, logits);
    } else {
        std::vector<float> logits(bits.size());
        for (size_t i = 0; i < bits.size(); ++i) logits[i] = from_bits<float>(bits[i]);
        run(rows, vocab, inv, u, greedy, top_k, top_p, floor, logits);
    }
    return 0;
}
