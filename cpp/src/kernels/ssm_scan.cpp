// Mamba-2's state-space recurrence on the CPU (pyengine/recurrent.h): a work item is one
// request's tokens through one head over the head's state [P, N]. Short runs (decode) go
// token by token (one pass over the state a token: decay, input along B, read along C);
// long runs (prefill) by chunks, the scan's state-space dual form (recurrent_chunks.inc).
// The loops are built per instruction set (recurrent_kernel.inc).
#include <omp.h>

#include <cmath>
#include <string>
#include <tuple>

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

constexpr const char* kOp = "ssm_scan";
constexpr int64_t cuda_max_state_size = 256;  // (cuda/recurrent_kernels.cuh: kMaxStateSize)

}  // namespace

void ssm_scan(const TensorView& out, const TensorView& x, const TensorView& dt,
              const TensorView& A, const TensorView& B, const TensorView& C, const TensorView& D,
              const TensorView& dt_bias, const TensorView& state, const TensorView& state_slots,
              const TensorView& has_state, const TensorView& query_start_loc, bool dt_softplus,
              float dt_min, float dt_max, void* stream) {
  const Device& device = x.device;
  for (const auto& [t, name, ndim] :
       {std::tuple{&out, "out", 3}, std::tuple{&x, "x", 3}, std::tuple{&dt, "dt", 2},
        std::tuple{&B, "B", 3}, std::tuple{&C, "C", 3}, std::tuple{&state, "state", 4}}) {
    detail::check_dense_float(*t, device, kOp, name, ndim);
  }
  const int64_t tokens = x.shape[0], heads = x.shape[1], head_dim = x.shape[2];
  const int64_t groups = B.shape[1], state_size = B.shape[2], num_slots = state.shape[0];
  detail::check_dims(out, {tokens, heads, head_dim}, kOp, "out");
  detail::check_dims(dt, {tokens, heads}, kOp, "dt");
  detail::check_dims(B, {tokens, groups, state_size}, kOp, "B");
  detail::check_dims(C, {tokens, groups, state_size}, kOp, "C");
  detail::check_dims(state, {num_slots, heads, head_dim, state_size}, kOp, "state");
  if (groups < 1 || heads % groups != 0) {
    throw InvalidArgument(std::string(kOp) + ": the heads (" + std::to_string(heads) +
                          ") must be a multiple of B's and C's groups (" +
                          std::to_string(groups) + ")");
  }
  detail::check_float_vector(A, device, kOp, "A", heads);
  const float* d = detail::optional_float_vector(D, device, kOp, "D", heads);
  const float* bias = detail::optional_float_vector(dt_bias, device, kOp, "dt_bias", heads);
  if (!(dt_min <= dt_max) || std::isnan(dt_min)) {
    throw InvalidArgument(std::string(kOp) + ": dt_min must be at most dt_max");
  }
  if (detail::on_cuda(device, kOp)) {
    detail::check_request_arrays(state_slots, has_state, query_start_loc, device, kOp);
    if (state_size > cuda_max_state_size) {
      throw InvalidArgument(std::string(kOp) + " (CUDA): the state size must be at most " +
                            std::to_string(cuda_max_state_size) + ", got " +
                            std::to_string(state_size));
    }
#ifdef PYENGINE_WITH_CUDA
    return cuda::ssm_scan(out, x, dt, A, B, C, D, dt_bias, state, state_slots, has_state,
                          query_start_loc, dt_softplus, dt_min, dt_max, stream);
#endif
  }
  (void)stream;
  const detail::StateRequests reqs =
      detail::check_state_requests(state_slots, has_state, query_start_loc, tokens, num_slots, kOp);

  const auto run = detail::recurrent_build(attention_isa()).ssm;
  const auto* xs = static_cast<const float*>(x.data);
  const auto* dts = static_cast<const float*>(dt.data);
  const auto* bs = static_cast<const float*>(B.data);
  const auto* cs = static_cast<const float*>(C.data);
  const auto* as = static_cast<const float*>(A.data);
  auto* o = static_cast<float*>(out.data);
  auto* s = static_cast<float*>(state.data);
  const int64_t items = reqs.count * heads, per_group = heads / groups;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t n = 0; n < items; ++n) {
    const int64_t r = n / heads, h = n % heads, first = reqs.starts[r];
    const int64_t g = h / per_group;
    run({xs + (first * heads + h) * head_dim, dts + first * heads + h,
         bs + (first * groups + g) * state_size, cs + (first * groups + g) * state_size,
         heads * head_dim, heads, groups * state_size, o + (first * heads + h) * head_dim,
         s + (reqs.slots[r] * heads + h) * head_dim * state_size, as[h],
         d != nullptr ? d[h] : 0.0f, bias != nullptr ? bias[h] : 0.0f, dt_min, dt_max,
         reqs.starts[r + 1] - first, head_dim, state_size, dt_softplus, reqs.has_state[r] == 0});
  }
}

}  // namespace pyengine
