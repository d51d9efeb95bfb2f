// kernels/draw.cu on the CPU (emulate.h): for each row given on stdin, the plain and
// the truncated draw, and the plain draw of the row penalised (penalise_rows) with the
// raw log-prob of what it drew (raw_logprobs), for metronome-model's tests
// (tests/it/kernels_on_cpu.rs) to compare with src/draw.rs, the host's reference, on
// the same logits. Blocks of 64 threads (the device's are 1024 and 256): the kernels'
// runs, sums and searches are the same code at any block size, and 64 fibers keep the
// emulation quick.
//
// stdin, whitespace-separated, every float as its bits in hex:
//   dtype rows vocab                      (dtype 0: f32 logits, 1: bf16)
//   per row: inv u greedy top_k top_p min_floor factor n id_1 .. id_n
//            (inv f32, u f64, top_p f32, min_floor f64, factor f32; the n distinct
//            context ids of the penalty, in decimal)
//   rows * vocab logits                   (f32 bits, or bf16 bits)
// stdout, per row, in hex: "<plain token> <log-prob bits> <truncated token> <log-prob
// bits> <penalised token> <log-prob bits> <its raw log-prob bits>".
#define DRAW_THREADS 64
#define PENALISE_THREADS 64
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

struct Row {
    float inv, top_p, factor;
    double u, floor;
    uint32_t greedy, top_k;
};

template <typename T>
static void run(uint32_t rows, uint32_t vocab, const std::vector<Row> &row, const std::vector<uint32_t> &offsets,
                const std::vector<uint32_t> &ids, const std::vector<T> &logits) {
    std::vector<float> inv(rows), top_p(rows), factor(rows);
    std::vector<double> u(rows), floor(rows);
    std::vector<uint32_t> greedy(rows), top_k(rows);
    for (uint32_t r = 0; r < rows; ++r) {
        inv[r] = row[r].inv, top_p[r] = row[r].top_p, factor[r] = row[r].factor;
        u[r] = row[r].u, floor[r] = row[r].floor;
        greedy[r] = row[r].greedy, top_k[r] = row[r].top_k;
    }
    std::vector<uint32_t> plain(rows), truncated(rows), penalised(rows);
    std::vector<float> plain_lp(rows), truncated_lp(rows), penalised_lp(rows), raw_lp(rows);
    std::vector<float> copy(size_t(rows) * vocab);
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
    emulate_launch(rows, 1, PENALISE_THREADS, [&] {
        if constexpr (sizeof(T) == 2)
            penalise_rows_bf16(logits.data(), copy.data(), offsets.data(), ids.data(), factor.data(), vocab);
        else
            penalise_rows_f32(logits.data(), copy.data(), offsets.data(), ids.data(), factor.data(), vocab);
    });
    emulate_launch(rows, 1, DRAW_THREADS, [&] {
        draw_rows_f32(copy.data(), inv.data(), greedy.data(), u.data(), penalised.data(), penalised_lp.data(), vocab);
    });
    raw_lp = penalised_lp;  // rows without a token keep what they had, as on the device
    emulate_launch(rows, 1, DRAW_THREADS, [&] {
        if constexpr (sizeof(T) == 2)
            raw_logprobs_bf16(logits.data(), penalised.data(), raw_lp.data(), vocab);
        else
            raw_logprobs_f32(logits.data(), penalised.data(), raw_lp.data(), vocab);
    });
    for (uint32_t r = 0; r < rows; ++r)
        std::printf("%x %x %x %x %x %x %x\n", plain[r], __float_as_uint(plain_lp[r]), truncated[r],
                    __float_as_uint(truncated_lp[r]), penalised[r], __float_as_uint(penalised_lp[r]),
                    __float_as_uint(raw_lp[r]));
}

int main() {
    uint32_t dtype, rows, vocab;
    if (std::scanf("%u %u %u", &dtype, &rows, &vocab) != 3) return 2;
    std::vector<Row> row(rows);
    std::vector<uint32_t> offsets{0}, ids;
    for (auto &w : row) {
        uint64_t b_inv, b_u, b_p, b_floor, b_factor;
        uint32_t n;
        if (std::scanf("%" SCNx64 " %" SCNx64 " %u %u %" SCNx64 " %" SCNx64 " %" SCNx64 " %u", &b_inv, &b_u, &w.greedy,
                       &w.top_k, &b_p, &b_floor, &b_factor, &n) != 8)
            return 2;
        w.inv = from_bits<float>(b_inv);
        w.u = from_bits<double>(b_u);
        w.top_p = from_bits<float>(b_p);
        w.floor = from_bits<double>(b_floor);
        w.factor = from_bits<float>(b_factor);
        for (uint32_t j = 0; j < n; ++j) {
            uint32_t id;
            if (std::scanf("%u", &id) != 1) return 2;
            ids.push_back(id);
        }
        offsets.push_back(uint32_t(ids.size()));
    }
    ids.push_back(0);  // never read, so that no row's ids are an empty vector's
    std::vector<uint32_t> bits(size_t(rows) * vocab);
    for (auto &b : bits)
        if (std::scanf("%x", &b) != 1) return 2;
    if (dtype == 1) {
        std::vector<__nv_bfloat16> logits(bits.size());
        for (size_t i = 0; i < bits.size(); ++i) logits[i].bits = uint16_t(bits[i]);
        run(rows, vocab, row, offsets, ids, logits);
    } else {
        std::vector<float> logits(bits.size());
        for (size_t i = 0; i < bits.size(); ++i) logits[i] = from_bits<float>(bits[i]);
        run(rows, vocab, row, offsets, ids, logits);
    }
    return 0;
}
