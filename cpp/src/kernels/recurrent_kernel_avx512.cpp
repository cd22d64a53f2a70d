// The recurrent-state kernels' loops built for avx512.
#define PYENGINE_KERNEL_NS avx512
#include "recurrent_kernel.inc"
