// Launchers of the recurrent-state kernels (see recurrent_launch.h; the kernels are in
// recurrent_kernels.cuh): a block a request and head (or block of channels).
#include <cuda_runtime.h>

#include <cstdint>

#include "cuda/recurrent_kernels.cuh"
#include "cuda/recurrent_launch.h"
#include "cuda/runtime_guards.h"

namespace pyengine::cuda {
namespace {

using namespace recurrent;  // NOLINT(google-build-using-namespace): this file's kernels

Requests requests(const TensorView& slots, const TensorView& has_state, const TensorView& starts) {
  return {static_cast<const int32_t*>(starts.data), static_cast<const int32_t*>(slots.data),
          static_cast<const int32_t*>(has_state.data)};
}

const float* floats_or_null(const TensorView& t) {
  return t.ndim == 0 || t.numel() == 0 ? nullptr : static_cast<const float*>(t.data);
}

}  // namespace

void gated_delta_rule(const TensorView& out, const TensorView& query, const TensorView& key,
                      const TensorView& value, const TensorView& g, const TensorView& beta,
                      const TensorView& state, const TensorView& state_slots,
                      const TensorView& has_state, const TensorView& query_start_loc,
                      float scale, bool normalize, void* stream) {
  const int64_t num_reqs = state_slots.shape[0], hv = value.shape[1];
  if (num_reqs == 0) return;
  const DeviceGuard guard(query.device.index);
  const DeltaParams p{static_cast<float*>(out.data),
                      static_cast<const float*>(query.data),
                      static_cast<const float*>(key.data),
                      static_cast<const float*>(value.data),
                      static_cast<const float*>(g.data),
                      static_cast<const float*>(beta.data),
                      static_cast<float*>(state.data),
                      requests(state_slots, has_state, query_start_loc),
                      static_cast<int>(query.shape[1]),
                      static_cast<int>(hv),
                      static_cast<int>(query.shape[2]),
                      static_cast<int>(value.shape[2]),
                      scale,
                      normalize};
  const dim3 grid(static_cast<unsigned>(num_reqs), static_cast<unsigned>(hv));
  delta_rule_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  check_cuda("gated_delta_rule", cudaGetLastError(), "kernel launch");
}

void causal_conv1d(const TensorView& out, const TensorView& x, const TensorView& weight,
                   const TensorView& bias, const TensorView& state, const TensorView& state_slots,
                   const TensorView& has_state, const TensorView& query_start_loc, bool silu,
                   void* stream) {
  const int64_t num_reqs = state_slots.shape[0], channels = x.shape[1];
  if (num_reqs == 0 || channels == 0) return;
  const DeviceGuard guard(x.device.index);
  const ConvParams p{static_cast<float*>(out.data),
                     static_cast<const float*>(x.data),
                     static_cast<const float*>(weight.data),
                     floats_or_null(bias),
                     static_cast<float*>(state.data),
                     requests(state_slots, has_state, query_start_loc),
                     static_cast<int>(channels),
                     static_cast<int>(weight.shape[1]),
                     silu};
  const dim3 grid(static_cast<unsigned>(num_reqs),
                  static_cast<unsigned>((channels + kThreads - 1) / kThreads));
  conv_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  check_cuda("causal_conv1d", cudaGetLastError(), "kernel launch");
}

void ssm_scan(const TensorView& out, const TensorView& x, const TensorView& dt,
              const TensorView& A, const TensorView& B, const TensorView& C, const TensorView& D,
              const TensorView& dt_bias, const TensorView& state, const TensorView& state_slots,
              const TensorView& has_state, const TensorView& query_start_loc, bool dt_softplus,
              float dt_min, float dt_max, void* stream) {
  const int64_t num_reqs = state_slots.shape[0], heads = x.shape[1];
  if (num_reqs == 0) return;
  const DeviceGuard guard(x.device.index);
  const SsmParams p{static_cast<float*>(out.data),
                    static_cast<const float*>(x.data),
                    static_cast<const float*>(dt.data),
                    static_cast<const float*>(A.data),
                    static_cast<const float*>(B.data),
                    static_cast<const float*>(C.data),
                    floats_or_null(D),
                    floats_or_null(dt_bias),
                    static_cast<float*>(state.data),
                    requests(state_slots, has_state, query_start_loc),
                    static_cast<int>(heads),
                    static_cast<int>(x.shape[2]),
                    static_cast<int>(B.shape[1]),
                    static_cast<int>(B.shape[2]),
                    dt_min,
                    dt_max,
                    dt_softplus};
  const dim3 grid(static_cast<unsigned>(num_reqs), static_cast<unsigned>(heads));
  ssm_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  check_cuda("ssm_scan", cudaGetLastError(), "kernel launch");
}

}  // namespace pyengine::cuda
