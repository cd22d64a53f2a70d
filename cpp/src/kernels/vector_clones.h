// Loops the compiler vectorizes, built for each x86 vector width where the compiler
// clones functions per target (the clone is picked at load time). Internal to
// pyengine_core.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PYENGINE_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define PYENGINE_VECTOR_CLONES
#endif
