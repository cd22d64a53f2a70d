// Activation arithmetic shared by the fused layers and the GEMM epilogues, so that a
// fused path rounds exactly as the separate op does. Internal to pyengine_core.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace pyengine::detail {

// exp(x), about 2 ulp, branch-free so that a loop of it vectorizes: Cody-Waite range
// reduction, a degree-6 polynomial and 2^n built in the exponent bits. x is clamped to
// [-87, 88] (silu needs no more: its gate / (1 + exp(-gate)) is then 0 or gate).
inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float round = 12582912.0f;  // 1.5 * 2^23: adding it rounds to an integer
  const float n = (x * 1.44269504088896341f + round) - round;
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = (p * r * r + r) + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

// out[i] = silu(gate[i]) * up[i] = gate[i] / (1 + exp(-gate[i])) * up[i], float32.
void silu_and_mul_row(const float* __restrict gate, const float* __restrict up,
                      float* __restrict out, int64_t n);

}  // namespace pyengine::detail
