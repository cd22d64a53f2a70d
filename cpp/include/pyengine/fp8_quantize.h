// Activations quantized to fp8 e4m3 as an FP8 W8A8 checkpoint's layers take them, CPU,
// float32: out = e4m3(x / s) * s, the rounding to nearest (ties to even) of OCP's E4M3FN
// (3 mantissa bits, largest value 448), x / s first clamped to [-448, 448].
//   dynamic (scale.data null): s = max|x row| / 448, a scale per row (per token);
//   static: s = scale[0], the checkpoint's input_scale, for every row.
// A row of zeros (s = 0) stays zeros. The products of these values with fp8 weights
// (dense over a float8_e4m3fn packed weight) are those of the quantized checkpoint, up to
// float32's rounding of e4m3 * s.
#pragma once

#include "pyengine/tensor_view.h"

namespace pyengine {

// x, out float32 [m, k] with a dense last dim (out may be x); scale float32 [1] or none.
void quantize_fp8_rows(const TensorView& out, const TensorView& x, const TensorView& scale);

}  // namespace pyengine
