// Runs CUDA kernels on the host, for tests on machines without a GPU: the kernel source
// is compiled as C++ (CUDA's headers give __half, __nv_bfloat16 and their conversions on
// the host), and `launch` runs every CUDA thread of a block as a host thread, one block
// after another. Emulated: threadIdx/blockIdx/blockDim/gridDim (1-D blocks, up to 3-D
// grids), __shared__ (static: one block runs at a time) and dynamic shared memory
// (PYENGINE_DYNAMIC_SHARED), __syncthreads, __shfl_xor_sync,
// __shfl_sync and __any_sync over whole warps of 32, rsqrtf, __expf, and the instructions of
// cuda/mma_primitives.cuh
// (mma.sync m16n8k16, ldmatrix .x4 .trans, cp.async), lane by lane as the PTX ISA lays
// out their fragments; asynchronous copies land only when waited for.
//
// Include this before the kernels' header, in one translation unit.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <array>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <memory>
#include <stdexcept>
#include <thread>
#include <type_traits>
#include <vector>

#undef __shared__
#define __shared__ static
#define __launch_bounds__(...)
#define PYENGINE_CUDA_HOST_EMULATION 1
#define PYENGINE_DYNAMIC_SHARED(name)                     \
  unsigned char* name = reinterpret_cast<unsigned char*>( \
      pyengine::emulation::current_block()->dynamic_shared.data())

namespace pyengine::emulation {

// What the threads of the running block share.
struct Block {
  Block(unsigned threads, size_t dynamic_shared_bytes)
      : all(threads),
        lanes(threads),
        fragments(threads),
        rows(threads),
        // All ones (NaN) until written: a kernel that reads it first shows it.
        dynamic_shared((dynamic_shared_bytes + 15) / 16, make_uint4(~0u, ~0u, ~0u, ~0u)) {
    for (unsigned first = 0; first < threads; first += 32) {
      const auto width = static_cast<std::ptrdiff_t>(std::min(32u, threads - first));
      warps.push_back(std::make_unique<std::barrier<>>(width));
    }
  }
  std::barrier<> all;                                  // __syncthreads
  std::vector<std::unique_ptr<std::barrier<>>> warps;  // a warp's exchanges
  std::vector<uint64_t> lanes;                         // a lane's shuffled value
  std::vector<std::array<uint32_t, 6>> fragments;      // a lane's mma a0-a3, b0, b1
  std::vector<const void*> rows;                       // a lane's ldmatrix row address
  std::vector<uint4> dynamic_shared;                   // 16-byte aligned
};

inline Block*& current_block() {
  static thread_local Block* block = nullptr;
  return block;
}

// Aborts, naming `what`, where the hardware would fault on a misaligned address.
inline void require_aligned(const void* address, uintptr_t bytes, const char* what) {
  if (reinterpret_cast<uintptr_t>(address) % bytes != 0) {
    std::fprintf(stderr, "emulated CUDA: %s %p is not %zu-byte aligned\n", what, address,
                 static_cast<size_t>(bytes));
    std::abort();
  }
}

}  // namespace pyengine::emulation

inline thread_local uint3 threadIdx;
inline thread_local uint3 blockIdx;
inline thread_local dim3 blockDim;
inline thread_local dim3 gridDim;

namespace pyengine::emulation {

// Every lane of the calling thread's warp publishes its part, then reads the others'
// once all have published; returns after all have read.
template <class Publish, class Read>
void warp_exchange(const Publish& publish, const Read& read) {
  Block& b = *current_block();
  std::barrier<>& warp = *b.warps[threadIdx.x / 32];
  publish(b);
  warp.arrive_and_wait();
  read(b);
  warp.arrive_and_wait();
}

}  // namespace pyengine::emulation

inline void __syncthreads() { pyengine::emulation::current_block()->all.arrive_and_wait(); }

namespace pyengine::emulation {

// `value` of the lane `source(lane)` of the warp; lanes past the block's last thread
// read their own.
template <typename T, class Source>
T shuffle(T value, const Source& source) {
  static_assert(sizeof(T) <= sizeof(uint64_t));
  T got = value;
  warp_exchange([&](Block& b) { std::memcpy(&b.lanes[threadIdx.x], &value, sizeof(T)); },
                [&](Block& b) {
                  const unsigned lane = threadIdx.x % 32, from = threadIdx.x - lane + source(lane);
                  if (from < b.lanes.size()) std::memcpy(&got, &b.lanes[from], sizeof(T));
                });
  return got;
}

}  // namespace pyengine::emulation

template <typename T>
T __shfl_xor_sync(unsigned /*mask*/, T value, int offset) {
  return pyengine::emulation::shuffle(
      value, [&](unsigned lane) { return (lane ^ static_cast<unsigned>(offset)) % 32; });
}
template <typename T>
T __shfl_sync(unsigned /*mask*/, T value, int source) {
  return pyengine::emulation::shuffle(value,
                                      [&](unsigned) { return static_cast<unsigned>(source) % 32; });
}

// True where `predicate` holds in any lane of the warp (lanes past the block's last thread
// do not exist).
inline int __any_sync(unsigned /*mask*/, int predicate) {
  int any = 0;
  pyengine::emulation::warp_exchange(
      [&](pyengine::emulation::Block& b) { b.lanes[threadIdx.x] = predicate != 0; },
      [&](pyengine::emulation::Block& b) {
        const unsigned first = threadIdx.x - threadIdx.x % 32;
        for (unsigned l = first; l < first + 32 && l < b.lanes.size(); ++l) any |= b.lanes[l] != 0;
      });
  return any;
}

inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline float __expf(float x) { return std::exp(x); }
inline int max(int a, int b) { return a < b ? b : a; }
inline int min(int a, int b) { return a < b ? a : b; }
inline int64_t max(int64_t a, int64_t b) { return a < b ? b : a; }
inline int64_t min(int64_t a, int64_t b) { return a < b ? a : b; }

namespace pyengine::cuda {

// cp.async lands as late as the PTX ISA allows: a thread's copies wait in groups
// (commit_copies closes one) until wait_copies<k> leaves at most k groups in flight, so
// that a kernel reading shared memory before its copies are waited for reads stale data.
struct AsyncCopy {
  void* shared;
  const void* global;  // nullptr: zeros
};
inline std::deque<std::vector<AsyncCopy>>& copy_groups() {
  static thread_local std::deque<std::vector<AsyncCopy>> groups(1);  // the last one open
  return groups;
}
// The destination reads as NaN (all ones) from the issue until the copy lands: a kernel
// that refills a buffer others still read shows it.
inline void copy_async(void* shared, const void* global, bool valid) {
  emulation::require_aligned(shared, 16, "cp.async destination");
  if (valid) emulation::require_aligned(global, 16, "cp.async source");
  std::memset(shared, 0xff, 16);
  copy_groups().back().push_back({shared, valid ? global : nullptr});
}
inline void commit_copies() { copy_groups().emplace_back(); }

// ex2.approx.ftz.f32: flushes results under 2^-126 to zero.
inline float fast_exp2(float x) {
  const float y = std::exp2(x);
  return y < 0x1p-126f ? 0.0f : y;
}
template <int kPending>
void wait_copies() {
  auto& groups = copy_groups();  // committed groups, then the open one
  while (groups.size() > static_cast<size_t>(kPending) + 1) {
    for (const AsyncCopy& c : groups.front()) {
      if (c.global != nullptr) {
        std::memcpy(c.shared, c.global, 16);
      } else {
        std::memset(c.shared, 0, 16);
      }
    }
    groups.pop_front();
  }
}

// The 16-bit element `half` (0: the low one) of a register, as float.
template <typename T>
float element_of(uint32_t reg, int half) {
  const auto bits = static_cast<uint16_t>(half == 0 ? reg & 0xffffu : reg >> 16);
  if constexpr (std::is_same_v<T, __half>) {
    __half_raw raw;
    raw.x = bits;
    return __half2float(__half(raw));
  } else {
    const uint32_t word = static_cast<uint32_t>(bits) << 16;
    float value = 0.0f;
    std::memcpy(&value, &word, sizeof value);
    return value;
  }
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: with g = lane / 4 and q = lane % 4,
// A register i holds row g + 8 * (i % 2), columns 2q + {0, 1} + 8 * (i / 2); B register
// j holds rows 2q + {0, 1} + 8j of column g; C element e is row g + 8 * (e / 2), column
// 2q + e % 2.
template <typename T>
void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  const unsigned lane = threadIdx.x % 32, first = threadIdx.x - lane;
  emulation::warp_exchange(
      [&](emulation::Block& b) { b.fragments[threadIdx.x] = {a[0], a[1], a[2], a[3], b0, b1}; },
      [&](emulation::Block& b) {
        for (int e = 0; e < 4; ++e) {
          const int m = static_cast<int>(lane / 4) + 8 * (e / 2);
          const int n = 2 * static_cast<int>(lane % 4) + e % 2;
          float sum = 0.0f;
          for (int k = 0; k < 16; ++k) {
            const auto& a_lane =
                b.fragments[first + static_cast<unsigned>((m % 8) * 4 + k % 8 / 2)];
            const auto& b_lane = b.fragments[first + static_cast<unsigned>(n * 4 + k % 8 / 2)];
            sum += element_of<T>(a_lane[(m >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0)], k % 2) *
                   element_of<T>(b_lane[k >= 8 ? 5 : 4], k % 2);
          }
          c[e] += sum;
        }
      });
}

// ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16: lane l gives row l % 8 of matrix l / 8;
// register i receives matrix i's elements (rows 2 * (l % 4) + {0, 1}, column l / 4).
inline void load_b_operands(uint32_t (&r)[4], const void* row) {
  emulation::require_aligned(row, 16, "ldmatrix row");
  const unsigned lane = threadIdx.x % 32, first = threadIdx.x - lane;
  emulation::warp_exchange([&](emulation::Block& b) { b.rows[threadIdx.x] = row; },
                           [&](emulation::Block& b) {
                             for (unsigned i = 0; i < 4; ++i) {
                               const unsigned top = first + 8 * i + 2 * (lane % 4);
                               const auto* upper = static_cast<const uint16_t*>(b.rows[top]);
                               const auto* lower = static_cast<const uint16_t*>(b.rows[top + 1]);
                               r[i] =
                                   upper[lane / 4] | (static_cast<uint32_t>(lower[lane / 4]) << 16);
                             }
                           });
}

}  // namespace pyengine::cuda

namespace pyengine::emulation {

// Runs `kernel()` (a call of the kernel with its arguments) as grid x threads CUDA
// threads, block by block, each with `dynamic_shared_bytes` of dynamic shared memory.
template <class Kernel>
void launch(dim3 grid, unsigned threads, const Kernel& kernel, size_t dynamic_shared_bytes = 0) {
  if (threads == 0 || threads > 1024) throw std::invalid_argument("launch: 1 to 1024 threads");
  for (unsigned z = 0; z < grid.z; ++z) {
    for (unsigned y = 0; y < grid.y; ++y) {
      for (unsigned x = 0; x < grid.x; ++x) {
        Block block(threads, dynamic_shared_bytes);
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
            // An exited thread no longer holds up its block's or warp's barriers (as on
            // the GPU, where exited threads count as arrived).
            block.all.arrive_and_drop();
            block.warps[t / 32]->arrive_and_drop();
          });
        }
        for (std::thread& thread : running) thread.join();
      }
    }
  }
}

}  // namespace pyengine::emulation
