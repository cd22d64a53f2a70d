// The block-quantized GEMM of CUDA (launched by block_gemm.cu): out [m, n] = x [m, k] @
// w^T + bias, x and out 16-bit (half or bfloat16), w [n, k] held as 4- or 8-bit integers
// with a float32 scale and offset per group of k (32, or 16 for Q6_K), w = q * s + o:
// GGUF's blocks, and GPTQ/AWQ/W4A16 in that form. Each weight is widened in registers,
// once (q * s + o in float32, rounded to the 16-bit type: the weight a dequantization
// at load would give), into the B operand of a tensor-core mma (m16n8k16, float32 sums).
// Device code and plain C++ only, so that cpp/tests can run it on the host
// (cuda_host_emulation.h). Internal to cuda/.
//
// The integers are reordered at load (pack_block_gemm_weight) so that a warp reads its
// B operands as 32 consecutive words: for column tile c (8 columns) and k block b (32 k),
// lane l (g = l / 4, t = l % 4) holds column 8c + g's 8 values for the two mma of b, in
// the order mma 0: k 2t, 2t + 1, 2t + 8, 2t + 9, then mma 1: the same + 16 (each mma's
// b0 pair, then its b1 pair); 4-bit: nibble p of one 32-bit word, 8-bit: byte p of 8.
#pragma once

#include <cstdint>

#include "cuda/element_types.cuh"
#include "cuda/mma_primitives.cuh"

namespace pyengine::cuda::block_gemm_kernels {

constexpr int kWarps = 4;     // a block's warps, each an 8-column tile
constexpr int kTileRows = 16;  // rows of x a block covers (an mma's m)
constexpr int kTileColumns = 8;
constexpr int kBlockK = 32;   // k a packed word (or pair of words) covers: two mma

// Values of one lane for one k block, from the packed weight.
template <int kBits>
struct LaneValues {
  int q[8];
};

template <int kBits>
__device__ __forceinline__ LaneValues<kBits> load_lane(const uint8_t* packed, int64_t index) {
  LaneValues<kBits> v;
  if constexpr (kBits == 4) {
    const uint32_t word = reinterpret_cast<const uint32_t*>(packed)[index];
#pragma unroll
    for (int p = 0; p < 8; ++p) v.q[p] = static_cast<int>((word >> (4 * p)) & 15u);
  } else {
    const uint2 pair = reinterpret_cast<const uint2*>(packed)[index];
#pragma unroll
    for (int p = 0; p < 8; ++p) {
      const uint32_t word = p < 4 ? pair.x : pair.y;
      v.q[p] = static_cast<int>(static_cast<int8_t>((word >> (8 * (p % 4))) & 0xffu));
    }
  }
  return v;
}

// The A operand of an mma over x rows [m0, m0 + 16), k [k0, k0 + 16): register i holds
// row m0 + g + 8 (i % 2), columns k0 + 2t + 8 (i / 2) + {0, 1}; rows past m are zeros.
template <typename T>
__device__ __forceinline__ void load_a(uint32_t (&a)[4], const T* x, int64_t x_stride, int m,
                                       int m0, int k0, int g, int t) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const int row = m0 + g + 8 * (i % 2);
    const int column = k0 + 2 * t + 8 * (i / 2);
    float first = 0.0f, second = 0.0f;
    if (row < m) {
      first = to_float(x[row * x_stride + column]);
      second = to_float(x[row * x_stride + column + 1]);
    }
    a[i] = pack<T>(first, second);
  }
}

// grid (ceil(n / 32), ceil(m / 16)), kWarps warps a block. packed: pack_block_gemm_weight's
// layout of n rounded up to 8 columns; scale, offset float32 [n, k / group]; bias float32
// [n] or null. k a multiple of 32, group 32 or 16.
template <typename T, int kBits>
__global__ void __launch_bounds__(kWarps* kWarp)
    block_gemm_kernel(T* __restrict__ out, int64_t out_stride, const T* __restrict__ x,
                      int64_t x_stride, const uint8_t* __restrict__ packed,
                      const float* __restrict__ scale, const float* __restrict__ offset,
                      const float* __restrict__ bias, int m, int n, int k, int group) {
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int tile = blockIdx.x * kWarps + warp;
  if (tile * kTileColumns >= n) return;  // (a whole warp: no mma is left half-done)
  const int m0 = blockIdx.y * kTileRows;
  const int g = lane / 4, t = lane % 4;
  const int column = tile * kTileColumns + g;  // this lane's B column
  const bool real = column < n;
  const int k_blocks = k / kBlockK, groups = k / group;
  float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int b = 0; b < k_blocks; ++b) {
    const LaneValues<kBits> v =
        load_lane<kBits>(packed, (static_cast<int64_t>(tile) * k_blocks + b) * kWarp + lane);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int k0 = b * kBlockK + half * 16;
      const int64_t param = static_cast<int64_t>(column) * groups + k0 / group;
      const float s = real ? scale[param] : 0.0f, o = real ? offset[param] : 0.0f;
      float w[4];
#pragma unroll
      for (int p = 0; p < 4; ++p) w[p] = fmaf(static_cast<float>(v.q[4 * half + p]), s, o);
      uint32_t a[4];
      load_a<T>(a, x, x_stride, m, m0, k0, g, t);
      mma<T>(c, a, pack<T>(w[0], w[1]), pack<T>(w[2], w[3]));
    }
  }
  // C element e: row m0 + g + 8 (e / 2), column 8 tile + 2t + e % 2.
#pragma unroll
  for (int e = 0; e < 4; ++e) {
    const int row = m0 + g + 8 * (e / 2);
    const int col = tile * kTileColumns + 2 * t + e % 2;
    if (row < m && col < n) {
      out[row * out_stride + col] = from_float<T>(bias != nullptr ? c[e] + bias[col] : c[e]);
    }
  }
}

}  // namespace pyengine::cuda::block_gemm_kernels
