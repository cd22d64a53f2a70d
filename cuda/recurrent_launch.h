// Host-side launchers of the CUDA recurrent-state kernels. Plain C++ (no CUDA types), so
// that the glue in cpp/src/kernels (gated_delta_rule.cpp, causal_conv1d.cpp,
// ssm_scan.cpp), which checks shapes, dtypes and devices first, can call them.
#pragma once

#include "pyengine/tensor_view.h"

namespace pyengine::cuda {

// The contracts of pyengine/recurrent.h on `stream` (a cudaStream_t; nullptr: the
// default stream) of the tensors' CUDA device. The request arrays stay on the device and
// are not read back to be checked. Throws std::runtime_error with the CUDA error string
// when a launch fails.
void gated_delta_rule(const TensorView& out, const TensorView& query, const TensorView& key,
                      const TensorView& value, const TensorView& g, const TensorView& beta,
                      const TensorView& state, const TensorView& state_slots,
                      const TensorView& has_state, const TensorView& query_start_loc,
                      float scale, bool normalize, void* stream);
void causal_conv1d(const TensorView& out, const TensorView& x, const TensorView& weight,
                   const TensorView& bias, const TensorView& state, const TensorView& state_slots,
                   const TensorView& has_state, const TensorView& query_start_loc, bool silu,
                   void* stream);
void ssm_scan(const TensorView& out, const TensorView& x, const TensorView& dt,
              const TensorView& A, const TensorView& B, const TensorView& C, const TensorView& D,
              const TensorView& dt_bias, const TensorView& state, const TensorView& state_slots,
              const TensorView& has_state, const TensorView& query_start_loc, bool dt_softplus,
              float dt_min, float dt_max, void* stream);

}  // namespace pyengine::cuda
