// The portable MLA kernel built for any CPU (compiled with its own -m flags).
#define PYENGINE_KERNEL_NS generic
#include "mla_kernel.inc"
