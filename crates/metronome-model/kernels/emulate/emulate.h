// Runs a CUDA kernel source of this crate on the CPU, so that CI, which has no GPU,
// checks the kernels' own logic (indexing, masking, tiling, the order of their sums)
// and not only that nvcc compiles them. Include this, then the .cu file.
//
// A block's threads run as fibers (ucontext) on one OS thread, in lock step: each runs
// until its next `__syncthreads`, then the next thread runs, and once all have arrived
// the round starts again. `__shared__` arrays become statics (one block runs at a
// time, as if alone on the device), and `__shfl_xor_sync` is an exchange through a
// slot per thread between two barriers, which is right for the kernels here, whose
// every thread of a block reaches each shuffle (the device needs it of a warp only).
// What it cannot check: timing, races that lock step hides (a thread reading what
// another writes between the same two barriers), and the device's rounding of expf
// and logf.
#pragma once
#include <ucontext.h>

#include <bit>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <vector>

struct EmulatedDim3 {
    unsigned x = 0, y = 0, z = 0;
};
inline EmulatedDim3 threadIdx, blockIdx, blockDim, gridDim;

namespace emulated {
inline ucontext_t scheduler;
inline std::vector<ucontext_t> fibers;
inline std::vector<float> slots;
inline const std::function<void()> *kernel = nullptr;
inline unsigned finished = 0;

inline void run_fiber() {
    (*kernel)();
    ++finished;
}
}  // namespace emulated

inline void __syncthreads() { swapcontext(&emulated::fibers[threadIdx.x], &emulated::scheduler); }

inline float __shfl_xor_sync(unsigned, float x, int lane_mask) {
    emulated::slots[threadIdx.x] = x;
    __syncthreads();
    const unsigned partner = (threadIdx.x & ~31u) | ((threadIdx.x & 31u) ^ unsigned(lane_mask));
    const float y = emulated::slots[partner];
    __syncthreads();
    return y;
}

struct float4 {
    float x, y, z, w;
};

using std::isfinite;
using std::isnan;
using std::min;

inline float __int_as_float(int i) { return std::bit_cast<float>(i); }
inline unsigned __float_as_uint(float f) { return std::bit_cast<unsigned>(f); }
#define __align__(n) __attribute__((aligned(n)))
#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(n)
#define __shared__ static

// Runs `kernel()` as a grid of gx x gy blocks of `threads` threads. Exits with a
// message when the threads of a block do not reach the same barriers.
inline void emulate_launch(unsigned gx, unsigned gy, unsigned threads, const std::function<void()> &kernel) {
    constexpr size_t STACK = 256 << 10;
    std::vector<std::vector<char>> stacks(threads, std::vector<char>(STACK));
    emulated::fibers.assign(threads, ucontext_t{});
    emulated::slots.assign(threads, 0.f);
    emulated::kernel = &kernel;
    blockDim = {threads, 1, 1};
    gridDim = {gx, gy, 1};
    for (unsigned by = 0; by < gy; ++by) {
        for (unsigned bx = 0; bx < gx; ++bx) {
            blockIdx = {bx, by, 0};
            emulated::finished = 0;
            for (unsigned t = 0; t < threads; ++t) {
                ucontext_t &f = emulated::fibers[t];
                getcontext(&f);
                f.uc_stack.ss_sp = stacks[t].data();
                f.uc_stack.ss_size = STACK;
                f.uc_link = &emulated::scheduler;
                makecontext(&f, emulated::run_fiber, 0);
            }
            while (emulated::finished < threads) {
                const unsigned before = emulated::finished;
                for (unsigned t = 0; t < threads; ++t) {
                    threadIdx = {t, 0, 0};
                    swapcontext(&emulated::scheduler, &emulated::fibers[t]);
                }
                if (emulated::finished != before && emulated::finished != threads) {
                    std::fprintf(stderr, "block (%u, %u): %u of %u threads ended while others wait at a barrier\n", bx,
                                 by, emulated::finished, threads);
                    std::exit(2);
                }
            }
        }
    }
}
