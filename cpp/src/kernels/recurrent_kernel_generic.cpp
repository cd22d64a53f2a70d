// The recurrent-state kernels' loops built for generic.
#define PYENGINE_KERNEL_NS generic
#include "recurrent_kernel.inc"
