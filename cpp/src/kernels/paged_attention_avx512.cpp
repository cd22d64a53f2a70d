// The paged-attention kernel built for AVX-512 (compiled with its own -m flags).
#define PYENGINE_KERNEL_NS avx512
#include "paged_attention_kernel.inc"
