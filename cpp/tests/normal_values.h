// Random normal values in a CUDA kernel's storage type, for the host-emulation tests
// (after cuda_host_emulation.h, as the kernels' headers).
#pragma once

#include <random>
#include <vector>

#include "cuda/element_types.cuh"

namespace pyengine::testing {

// n values of N(0, scale^2), each rounded to T.
template <typename T>
std::vector<T> normal_values(std::mt19937& generator, size_t n, float scale) {
  std::normal_distribution<float> normal(0.0f, scale);
  std::vector<T> values(n);
  for (T& x : values) x = pyengine::cuda::from_float<T>(normal(generator));
  return values;
}

}  // namespace pyengine::testing
