// Runs simple CUDA kernels on the host, for tests on machines without a GPU: the kernel
// source is compiled as C++ (CUDA's headers give __half, __nv_bfloat16 and their
// conversions on the host), and `launch` runs every CUDA thread of a block as a host
// thread, one block after another. Emulated: threadIdx/blockIdx/blockDim/gridDim (1-D
// blocks, up to 3-D grids), __shared__ (static: one block runs at a time),
// __syncthreads, __shfl_xor_sync over whole warps of 32, rsqrtf. Inline PTX (mma,
// ldmatrix, cp.async) is not: kernels that use it cannot run here.
//
// Include this before the kernels' header, in one translation unit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <barrier>
#include <cmath>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <thread>
#include <vector>

#undef __shared__
#define __shared__ static

namespace pyengine::emulation {

// What the threads of the running block share.
struct Block {
  explicit Block(unsigned threads) : all(threads), lanes(threads) {
    for (unsigned first = 0; first < threads; first += 32) {
      const auto width = static_cast<std::ptrdiff_t>(std::min(32u, threads - first));
      warps.push_back(std::make_unique<std::barrier<>>(width));
    }
  }
  std::barrier<> all;                                  // __syncthreads
  std::vector<std::unique_ptr<std::barrier<>>> warps;  // a warp's shuffles
  std::vector<float> lanes;                            // one shuffle slot per thread
};

inline Block*& current_block() {
  static thread_local Block* block = nullptr;
  return block;
}

}  // namespace pyengine::emulation

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

inline void __syncthreads() { pyengine::emulation::current_block()->all.arrive_and_wait(); }

// Every lane of the warp must call it (as the kernels do); lanes past the block's last
// thread read their own value.
inline float __shfl_xor_sync(unsigned /*mask*/, float value, int offset) {
  pyengine::emulation::Block& b = *pyengine::emulation::current_block();
  const unsigned t = threadIdx.x, warp = t / 32, source = t ^ static_cast<unsigned>(offset);
  b.lanes[t] = value;
  b.warps[warp]->arrive_and_wait();
  const float got = source < b.lanes.size() && source / 32 == warp ? b.lanes[source] : value;
  b.warps[warp]->arrive_and_wait();
  return got;
}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }

namespace pyengine::emulation {

// Runs `kernel()` (a call of the kernel with its arguments) as grid x threads CUDA
// threads, block by block.
template <class Kernel>
void launch(dim3 grid, unsigned threads, const Kernel& kernel) {
  if (threads == 0 || threads > 1024) throw std::invalid_argument("launch: 1 to 1024 threads");
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        Block block(threads);
        std::vector<std::thread> running;
        running.reserve(threads);
        for (unsigned t = 0; t < threads; ++t) {
          running.emplace_back([&, t] {
            threadIdx = make_uint3(t, 0, 0);
            blockIdx = make_uint3(x, y, z);
            blockDim = dim3(threads, 1, 1);
            gridDim = grid;
            current_block() = &block;
            kernel();
          });
        }
        for (std::thread& thread : running) thread.join();
      }
    }
  }
}

}  // namespace pyengine::emulation
