// out [m, n] = x [m, k] @ w + bias with int8 weights and int8 activations (W8A8): w a
// per-output-channel symmetric int8 weight (w = q * scale[j]), x quantized per row on
// the fly (x ~ xq * sx, sx = max|x| / 127, xq = round(x / sx)), the products summed in
// int32, exactly, and out = sx * scale[j] * sum + bias[j] in float32. CPU only.
//
// The weight is packed once into panels of kInt8PanelWidth columns, each k / 4 groups of
// [kInt8PanelWidth][4] bytes (four consecutive k of a column together), so that one
// AVX-512 VNNI vpdpbusd multiplies 4 k of 16 columns by 4 bytes of x at once; after the
// panels come each column's sum of q (int32), which turns x's offset to unsigned bytes
// (xq + 128) back into the signed product, and a flag: whether any q is -128 (which the
// AVX2 build cannot take; such a weight runs the portable loops there).
#pragma once

#include <cstdint>

#include "pyengine/tensor_view.h"

namespace pyengine {

inline constexpr int64_t kInt8PanelWidth = 16;

// Bytes a packed int8 [n, k] weight takes.
int64_t packed_int8_weight_size(int64_t k, int64_t n);

// Packs q [n, k] (int8, output-major, as checkpoints store it) into `packed` (int8
// [packed_int8_weight_size(k, n)]).
void pack_int8_weight(const TensorView& packed, const TensorView& q);

// out [m, n] = quantized x [m, k] @ the packed weight, times scale [n] (float32) and
// x's per-row scale, + bias [n] (optional: bias.data null). x and out float32 with a
// dense last dim.
void int8_dense(const TensorView& out, const TensorView& x, const TensorView& packed,
                const TensorView& scale, const TensorView& bias, int64_t n);

// Whether int8_dense uses AVX-512 VNNI: on CPUs with it, unless the quantized kernels
// are pinned to another build (set_quantized_dense_isa: avx2, generic).
bool int8_dense_vnni();

}  // namespace pyengine
