// out [m, n] = x [m, k] @ w + bias, for the few rows of a decode step (m up to about 64),
// CPU, float32. The weight is packed once into panels of kPanelWidth columns, each
// [k, kPanelWidth] contiguous, so that a step streams every weight byte once, in order
// (hardware prefetch follows it), while tiles of 8 rows x kPanelWidth columns accumulate
// in registers. Larger m is a job for a blocked GEMM library.
#pragma once

#include <cstdint>

#include "pyengine/tensor_view.h"

namespace pyengine {

inline constexpr int64_t kPanelWidth = 48;

// Floats a packed [k, n] weight takes: n rounded up to whole panels.
int64_t packed_weight_size(int64_t k, int64_t n);

// Packs w_t [k, n] (w transposed: the dense right operand) into `packed` (float32
// [packed_weight_size(k, n)]); columns past n in the last panel are zero.
void pack_weight(const TensorView& packed, const TensorView& w_t);

// out [m, n] = x [m, k] @ (the packed weight of k x n) + bias [n] (optional: bias.data
// null). x and out float32 with a dense last dim.
void small_gemm(const TensorView& out, const TensorView& x, const TensorView& packed,
                const TensorView& bias, int64_t n);

// Packs w_t [k, 2n], gate columns then up columns (an MLP's fused gate/up projection), for
// small_gemm_silu_and_mul into `packed` (float32 [2 * packed_weight_size(k, n)]): each
// gate panel followed by the up panel of the same columns.
void pack_gate_up_weight(const TensorView& packed, const TensorView& w_t);

// out [m, n] = silu(x @ gate) * (x @ up) over a pack_gate_up_weight weight: the gate/up
// product never leaves the thread's cache, and the activation rounds exactly as
// silu_and_mul's. x and out float32 with a dense last dim.
void small_gemm_silu_and_mul(const TensorView& out, const TensorView& x, const TensorView& packed,
                             int64_t n);

}  // namespace pyengine
