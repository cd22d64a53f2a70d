// The tensor-core and asynchronous-copy instructions the flash-attention kernel is
// built from (sm_80 and later), as inline PTX. cpp/tests/cuda_host_emulation.h defines
// PYENGINE_CUDA_HOST_EMULATION and host versions of these instead (copy_async,
// commit_copies, wait_copies, mma, load_b_operands, fast_exp2 and PYENGINE_DYNAMIC_SHARED),
// lane by lane as the PTX ISA specifies them. Internal to cuda/.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/element_types.cuh"

namespace pyengine::cuda {

__device__ __forceinline__ uint16_t bits(__half x) { return __half_as_ushort(x); }
__device__ __forceinline__ uint16_t bits(__nv_bfloat16 x) { return __bfloat16_as_ushort(x); }

// Two floats as T in one register, the first in the low half (an mma operand pair).
template <typename T>
__device__ __forceinline__ uint32_t pack(float first, float second) {
  return static_cast<uint32_t>(bits(from_float<T>(first))) |
         (static_cast<uint32_t>(bits(from_float<T>(second))) << 16);
}

#ifndef PYENGINE_CUDA_HOST_EMULATION

// The block's dynamic shared memory, as bytes named `name` (16-byte aligned).
#define PYENGINE_DYNAMIC_SHARED(name) extern __shared__ __align__(16) unsigned char name[]

// A 16-byte copy from global to shared memory that does not hold the thread up; zeros
// where !valid (`global` is then not read).
__device__ __forceinline__ void copy_async(void* shared, const void* global, bool valid) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(shared));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(address), "l"(global),
               "r"(valid ? 16 : 0));
}
// 2^x by the special-function unit alone (ex2.approx.ftz: relative error about 2^-22,
// results under 2^-126 flushed to zero), where exp2f adds a range check and two multiplies
// for subnormal results: softmax weights that small are zeros to a float32 sum anyway.
__device__ __forceinline__ float fast_exp2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ void commit_copies() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most `kPending` of this thread's newest copy groups are in flight.
template <int kPending>
__device__ __forceinline__ void wait_copies() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(kPending) : "memory");
}

// c += a * b over one m16n8k16 tile: A row-major 16x16, B column-major 16x8, C float32.
template <typename T>
__device__ __forceinline__ void mma(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                    uint32_t b1);
template <>
__device__ __forceinline__ void mma<__half>(float (&c)[4], const uint32_t (&a)[4], uint32_t b0,
                                            uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
template <>
__device__ __forceinline__ void mma<__nv_bfloat16>(float (&c)[4], const uint32_t (&a)[4],
                                                   uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Four 8x8 matrices of 16-bit elements from shared memory, transposed: lane l gives the
// address of row l % 8 of matrix l / 8, and register i receives matrix i's elements
// (2 * (l % 4) + {0, 1}, l / 4): the B operand pairs of an mma, two k-halves of two
// n-tiles, from a row-major [k][n] tile.
__device__ __forceinline__ void load_b_operands(uint32_t (&r)[4], const void* row) {
  const auto address = static_cast<uint32_t>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(address)
               : "memory");
}

#endif  // PYENGINE_CUDA_HOST_EMULATION

}  // namespace pyengine::cuda
