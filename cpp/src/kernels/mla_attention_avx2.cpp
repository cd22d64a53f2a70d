// The portable MLA kernel built for AVX2 (compiled with its own -m flags).
#define PYENGINE_KERNEL_NS avx2
#include "mla_kernel.inc"
