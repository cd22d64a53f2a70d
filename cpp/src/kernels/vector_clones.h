// Loops the compiler vectorizes, built for each x86 vector width where the compiler
// clones functions per target (the clone is picked at load time). Internal to
// pyengine_core. AVX2 CPUs take the x86-64-v3 clone, which has FMA: GCC's "avx2" target
// does not, and its float loops multiplied and added in two instructions, rounding
// twice, where the AVX-512 build and the hand-written kernels fuse them (the "avx2" clone
// stays for AVX2 CPUs short of the rest of v3).
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PYENGINE_VECTOR_CLONES __attribute__((target_clones("avx512f", "arch=x86-64-v3", "avx2", "default")))
#else
#define PYENGINE_VECTOR_CLONES
#endif
