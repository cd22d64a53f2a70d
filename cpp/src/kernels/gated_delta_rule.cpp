// Gated DeltaNet's recurrence on the CPU (pyengine/recurrent.h): a work item is one
// request's tokens through one value head over the head's state [dk, dv]. Short runs
// (decode) go token by token (two passes over the state a token: the decay with the key's
// recall, then the update with the query's read; a block of its columns at a time for
// runs of tokens); long runs (prefill) go by the chunked parallel form
// (recurrent_chunks.inc). The loops are built per instruction set (recurrent_kernel.inc).
#include <omp.h>

#include <cmath>
#include <string>
#include <tuple>
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

constexpr const char* kOp = "gated_delta_rule";
constexpr int64_t cuda_max_key_dim = 256;  // (cuda/recurrent_kernels.cuh: kMaxKeyDim)

}  // namespace

void set_recurrent_chunks_from(int64_t tokens) {
  if (tokens < 0) {
    throw InvalidArgument("set_recurrent_chunks_from: tokens must be >= 0 (0: the default), got " +
                          std::to_string(tokens));
  }
  detail::chunks_from_pin.store(tokens, std::memory_order_relaxed);
}

void gated_delta_rule(const TensorView& out, const TensorView& query, const TensorView& key,
                      const TensorView& value, const TensorView& g, const TensorView& beta,
                      const TensorView& state, const TensorView& state_slots,
                      const TensorView& has_state, const TensorView& query_start_loc,
                      float scale, bool normalize, void* stream) {
  const Device& device = query.device;
  for (const auto& [t, name, ndim] :
       {std::tuple{&out, "out", 3}, std::tuple{&query, "query", 3}, std::tuple{&key, "key", 3},
        std::tuple{&value, "value", 3}, std::tuple{&g, "g", 2}, std::tuple{&beta, "beta", 2},
        std::tuple{&state, "state", 4}}) {
    detail::check_dense_float(*t, device, kOp, name, ndim);
  }
  const int64_t tokens = query.shape[0], hk = query.shape[1], dk = query.shape[2];
  const int64_t hv = value.shape[1], dv = value.shape[2];
  detail::check_dims(key, {tokens, hk, dk}, kOp, "key");
  detail::check_dims(value, {tokens, hv, dv}, kOp, "value");
  detail::check_dims(out, {tokens, hv, dv}, kOp, "out");
  detail::check_dims(g, {tokens, hv}, kOp, "g");
  detail::check_dims(beta, {tokens, hv}, kOp, "beta");
  if (hk < 1 || hv % hk != 0) {
    throw InvalidArgument(std::string(kOp) + ": the value heads (" + std::to_string(hv) +
                          ") must be a multiple of the key heads (" + std::to_string(hk) + ")");
  }
  const int64_t num_slots = state.shape[0];
  detail::check_dims(state, {num_slots, hv, dk, dv}, kOp, "state");
  if (!std::isfinite(scale)) throw InvalidArgument(std::string(kOp) + ": scale must be finite");
  if (detail::on_cuda(device, kOp)) {
    detail::check_request_arrays(state_slots, has_state, query_start_loc, device, kOp);
    if (dk > cuda_max_key_dim) {
      throw InvalidArgument(std::string(kOp) + " (CUDA): the key dim must be at most " +
                            std::to_string(cuda_max_key_dim) + ", got " + std::to_string(dk));
    }
#ifdef PYENGINE_WITH_CUDA
    return cuda::gated_delta_rule(out, query, key, value, g, beta, state, state_slots, has_state,
                                  query_start_loc, scale, normalize, stream);
#endif
  }
  (void)stream;
  const detail::StateRequests reqs =
      detail::check_state_requests(state_slots, has_state, query_start_loc, tokens, num_slots, kOp);

  const auto run = detail::recurrent_build(attention_isa()).delta_rule;
  const auto* q = static_cast<const float*>(query.data);
  const auto* k = static_cast<const float*>(key.data);
  const auto* v = static_cast<const float*>(value.data);
  const auto* gates = static_cast<const float*>(g.data);
  const auto* betas = static_cast<const float*>(beta.data);
  auto* o = static_cast<float*>(out.data);
  auto* s = static_cast<float*>(state.data);
  const int64_t items = reqs.count * hv, per_key = hv / hk;
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t n = 0; n < items; ++n) {
    const int64_t r = n / hv, h = n % hv, first = reqs.starts[r];
    const detail::DeltaRun item{
        q + (first * hk + h / per_key) * dk, k + (first * hk + h / per_key) * dk,
        v + (first * hv + h) * dv, gates + first * hv + h, betas + first * hv + h,
        hk * dk, hv * dv, hv, o + (first * hv + h) * dv,
        s + (reqs.slots[r] * hv + h) * dk * dv, reqs.starts[r + 1] - first, dk, dv, scale,
        normalize, reqs.has_state[r] == 0};
    run(item);
  }
}

}  // namespace pyengine
