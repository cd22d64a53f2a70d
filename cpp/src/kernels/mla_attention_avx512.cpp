// The portable MLA kernel built for AVX-512 (compiled with its own -m flags).
#define PYENGINE_KERNEL_NS avx512
#include "mla_kernel.inc"
