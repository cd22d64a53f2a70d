// Loops the compiler vectorizes, built for each x86 vector width where the compiler
// clones functions per target (the clone is picked at load time). Internal to
// pyengine_core. AVX2 CPUs take the x86-64-v3 clone, which has FMA: GCC's "avx2" target
// does not, and its float loops multiplied and added in two instructions, rounding
// twice, where the AVX-512 build and the hand-written kernels fuse them (the "avx2" clone
// stays for AVX2 CPUs short of the rest of v3).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PYENGINE_VECTOR_CLONES \
  __attribute__((target_clones("avx512f", "arch=x86-64-v3", "avx2", "default")))
#else
#define PYENGINE_VECTOR_CLONES
#endif

namespace pyengine::detail {

// Whether the CPU has AVX-512, so that loops over GCC vectors of 16 floats run in its
// registers: elsewhere GCC lowers such vectors through the stack, element by element, and
// the loops take vectors of 8 floats instead. (By the CPU, not a pin: the AVX-512 clone
// has no FMA for 8 floats, no AVX512VL, and would round their multiply-adds twice.)
inline bool wide_vectors() {
#if defined(__x86_64__) && defined(__GNUC__)
  static const bool wide = __builtin_cpu_supports("avx512f");
  return wide;
#else
  return false;
#endif
}

}  // namespace pyengine::detail
