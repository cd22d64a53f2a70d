// MLA attention's inner loop on AVX512-BF16's dot products, for CPUs without AMX (AMD
// Zen 4 and 5, Intel Cooper Lake): bfloat16 queries over a bfloat16 latent cache, a
// token's every head against its keys, 32 at a time. Internal to pyengine_core.
#pragma once

#include <cstdint>

#include "mla_lanes.h"

namespace pyengine::detail {

// Whether attend_bf16 runs these shapes here: the CPU has AVX512-BF16, the attention
// kernels run their AVX-512 build (attention_isa), and the shapes are the lane kernels'
// (mla_lanes_fit).
bool mla_bf16_fits(const MlaTile& s);

// As attend_amx (mla_amx.h), without tiles.
void attend_bf16(const MlaTile& s, const uint16_t* q, const uint16_t* cache, const int32_t* table,
                 int64_t begin, int64_t end, float scale, float* acc, float* max, float* sum);

}  // namespace pyengine::detail
