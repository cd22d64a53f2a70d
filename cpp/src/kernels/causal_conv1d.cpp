// The short causal convolution on the CPU (pyengine/recurrent.h): a work item is one
// request's tokens, every channel (a token's channels are one row, so each tap is a
// multiply-add of rows), the loops built per instruction set (recurrent_kernel.inc).
#include <omp.h>

#include <string>
#include <vector>

#include "pyengine/attention.h"
#include "pyengine/errors.h"
#include "pyengine/recurrent.h"
#include "recurrent_kernel.h"
#include "state_checks.h"
#ifdef PYENGINE_WITH_CUDA
#include "cuda/recurrent_launch.h"
#endif

namespace pyengine {
namespace {

constexpr const char* kOp = "causal_conv1d";
constexpr int64_t cuda_max_width = 8;  // (cuda/recurrent_kernels.cuh: kMaxWidth)

}  // namespace

void causal_conv1d(const TensorView& out, const TensorView& x, const TensorView& weight,
                   const TensorView& bias, const TensorView& state, const TensorView& state_slots,
                   const TensorView& has_state, const TensorView& query_start_loc, bool silu,
                   void* stream) {
  const Device& device = x.device;
  detail::check_dense_float(x, device, kOp, "x", 2);
  detail::check_dense_float(out, device, kOp, "out", 2);
  detail::check_dense_float(weight, device, kOp, "weight", 2);
  detail::check_dense_float(state, device, kOp, "state", 3);
  const int64_t tokens = x.shape[0], channels = x.shape[1], width = weight.shape[1];
  if (out.shape[0] != tokens || out.shape[1] != channels) {
    throw InvalidArgument(std::string(kOp) + ": out must be x's shape, got " + out.describe());
  }
  if (weight.shape[0] != channels || width < 1) {
    throw InvalidArgument(std::string(kOp) + ": weight must be [" + std::to_string(channels) +
                          ", width >= 1], got " + weight.describe());
  }
  const float* b = detail::optional_float_vector(bias, device, kOp, "bias", channels);
  const int64_t num_slots = state.shape[0];
  if (state.shape[1] != channels || state.shape[2] != width - 1) {
    throw InvalidArgument(std::string(kOp) + ": state must be [num_slots, " +
                          std::to_string(channels) + ", " + std::to_string(width - 1) +
                          "], got " + state.describe());
  }
  if (detail::on_cuda(device, kOp)) {
    detail::check_request_arrays(state_slots, has_state, query_start_loc, device, kOp);
    if (width > cuda_max_width) {
      throw InvalidArgument(std::string(kOp) + " (CUDA): the width must be at most " +
                            std::to_string(cuda_max_width) + ", got " + std::to_string(width));
    }
#ifdef PYENGINE_WITH_CUDA
    return cuda::causal_conv1d(out, x, weight, bias, state, state_slots, has_state,
                               query_start_loc, silu, stream);
#endif
  }
  (void)stream;
  const detail::StateRequests reqs =
      detail::check_state_requests(state_slots, has_state, query_start_loc, tokens, num_slots, kOp);

  // The weight transposed, [width, channels]: a tap's weights are one row.
  std::vector<float> weight_t(static_cast<size_t>(width * channels));
  const auto* w = static_cast<const float*>(weight.data);
  for (int64_t c = 0; c < channels; ++c) {
    for (int64_t j = 0; j < width; ++j) weight_t[static_cast<size_t>(j * channels + c)] = w[c * width + j];
  }
  const auto run = detail::recurrent_build(attention_isa()).conv;
  const auto* in = static_cast<const float*>(x.data);
  auto* o = static_cast<float*>(out.data);
  auto* s = static_cast<float*>(state.data);
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t r = 0; r < reqs.count; ++r) {
    const int64_t first = reqs.starts[r];
    run({in + first * channels, o + first * channels, weight_t.data(), b,
         s + reqs.slots[r] * channels * (width - 1), reqs.starts[r + 1] - first, channels, width,
         silu, reqs.has_state[r] == 0});
  }
}

}  // namespace pyengine
