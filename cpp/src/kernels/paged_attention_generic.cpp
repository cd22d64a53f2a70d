// The paged-attention kernel built for any CPU.
#define PYENGINE_KERNEL_NS generic
#include "paged_attention_kernel.inc"
