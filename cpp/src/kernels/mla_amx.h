// MLA attention's inner loop on AMX's tile unit (bfloat16 queries over a bfloat16 latent
// cache): a token's every head against its keys, 32 at a time. Internal to
// pyengine_core.
#pragma once

#include <cstdint>

#include "mla_lanes.h"

namespace pyengine::detail {

// Whether attend_amx runs these shapes: AMX usable (amx_tiles_enabled) and the shapes
// the lane kernels take (mla_lanes_fit).
bool mla_amx_fits(const MlaTile& s);

// Every head's softmax over keys [begin, end) of a request (`table` its block table),
// unnormalised, into acc [heads, value], max and sum [heads]; q [heads, latent] bfloat16
// (as uint16). The caller holds the thread's tiles configured (AmxTiles).
void attend_amx(const MlaTile& s, const uint16_t* q, const uint16_t* cache, const int32_t* table,
                int64_t begin, int64_t end, float scale, float* acc, float* max, float* sum);

}  // namespace pyengine::detail
