// The request arrays of the recurrent-state kernels (pyengine/recurrent.h), checked:
// int32, dense, one per request; on the CPU also their values: query_start_loc runs from
// 0 to the step's tokens without going back, each request's state slot lies in the state
// tensor and no two share one (both would write it), has_state holds 0 or 1 (on CUDA they
// stay on the device, unread). Internal to pyengine_core.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "pyengine/errors.h"
#include "pyengine/tensor_view.h"
#include "tensor_checks.h"

namespace pyengine::detail {

struct StateRequests {
  const int32_t *starts, *slots, *has_state;
  int64_t count;
};

// The request arrays' shapes and dtypes (int32, dense, on `device`): their requests.
inline int64_t check_request_arrays(const TensorView& state_slots, const TensorView& has_state,
                                    const TensorView& query_start_loc, const Device& device,
                                    const char* op) {
  for (const auto* t : {&state_slots, &has_state, &query_start_loc}) {
    const char* name = t == &state_slots ? "state_slots"
                       : t == &has_state ? "has_state"
                                         : "query_start_loc";
    check_device(*t, device, op, name);
    check_shape(*t, op, name, 1);
    check_dtype(*t, DType::kInt32, op, name);
    if (!t->is_contiguous()) throw InvalidArgument(arg(op, name) + " must be dense");
  }
  const int64_t count = state_slots.shape[0];
  if (has_state.shape[0] != count || query_start_loc.shape[0] != count + 1) {
    throw InvalidArgument(std::string(op) + ": state_slots and has_state [num_reqs] and " +
                          "query_start_loc [num_reqs + 1] disagree: " + state_slots.describe() +
                          ", " + has_state.describe() + ", " + query_start_loc.describe());
  }
  return count;
}

// The same on the CPU, and their values.
inline StateRequests check_state_requests(const TensorView& state_slots,
                                          const TensorView& has_state,
                                          const TensorView& query_start_loc, int64_t num_tokens,
                                          int64_t num_slots, const char* op) {
  const int64_t count =
      check_request_arrays(state_slots, has_state, query_start_loc, Device{}, op);
  const auto* starts = static_cast<const int32_t*>(query_start_loc.data);
  const auto* slots = static_cast<const int32_t*>(state_slots.data);
  const auto* has = static_cast<const int32_t*>(has_state.data);
  if (starts[0] != 0 || starts[count] != num_tokens) {
    throw InvalidArgument(std::string(op) + ": query_start_loc must run from 0 to the " +
                          std::to_string(num_tokens) + " tokens");
  }
  std::vector<bool> taken(static_cast<size_t>(num_slots), false);
  for (int64_t i = 0; i < count; ++i) {
    std::string at = "[";  // (appended, not "[" + ...: GCC 12 warns of a false overlap)
    at += std::to_string(i);
    at += "]";
    if (starts[i + 1] < starts[i]) {
      throw InvalidArgument(std::string(op) + ": query_start_loc goes back at " + at);
    }
    if (slots[i] < 0 || slots[i] >= num_slots) {
      throw InvalidArgument(std::string(op) + ": state_slots" + at + " is " +
                            std::to_string(slots[i]) + ", outside [0, " +
                            std::to_string(num_slots) + ")");
    }
    if (taken[static_cast<size_t>(slots[i])]) {
      throw InvalidArgument(std::string(op) + ": state_slots" + at + " (" +
                            std::to_string(slots[i]) + ") is another request's too");
    }
    taken[static_cast<size_t>(slots[i])] = true;
    if (has[i] != 0 && has[i] != 1) {
      throw InvalidArgument(std::string(op) + ": has_state" + at + " must be 0 or 1");
    }
  }
  return {starts, slots, has, count};
}

// A dense float32 tensor of `ndim` dims on `device`.
inline void check_dense_float(const TensorView& t, const Device& device, const char* op,
                              const char* name, int ndim) {
  check_device(t, device, op, name);
  check_shape(t, op, name, ndim);
  check_dtype(t, DType::kFloat32, op, name);
  if (!t.is_contiguous()) throw InvalidArgument(arg(op, name) + " must be dense, got " + t.describe());
}

// A dense float32 [n] on `device` (a bias, a per-head parameter).
inline void check_float_vector(const TensorView& t, const Device& device, const char* op,
                               const char* name, int64_t n) {
  check_device(t, device, op, name);
  if (t.ndim != 1 || t.shape[0] != n || t.dtype != DType::kFloat32 || t.strides[0] != 1) {
    throw InvalidArgument(arg(op, name) + " must be dense float32 [" + std::to_string(n) +
                          "], got " + t.describe());
  }
}

// An optional dense float32 [n] on `device`: its numbers, or null where it was left out
// (an empty view).
inline const float* optional_float_vector(const TensorView& t, const Device& device,
                                          const char* op, const char* name, int64_t n) {
  if (t.ndim == 0 || t.numel() == 0) return nullptr;
  check_float_vector(t, device, op, name, n);
  return static_cast<const float*>(t.data);
}

// t's dims exactly `want`.
inline void check_dims(const TensorView& t, const std::vector<int64_t>& want, const char* op,
                       const char* name) {
  if (std::vector<int64_t>(t.shape.begin(), t.shape.begin() + t.ndim) != want) {
    std::string dims;
    for (const int64_t d : want) dims += (dims.empty() ? "" : ", ") + std::to_string(d);
    throw InvalidArgument(arg(op, name) + " must be [" + dims + "], got " + t.describe());
  }
}

}  // namespace pyengine::detail
