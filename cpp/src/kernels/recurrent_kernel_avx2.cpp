// The recurrent-state kernels' loops built for avx2.
#define PYENGINE_KERNEL_NS avx2
#include "recurrent_kernel.inc"
