// The AMX tile unit, as the packed-weight kernels use it: whether this process may, and
// the one tile shape they all take. Internal to pyengine_core.
//
// Every kernel configures the eight tiles alike, 16 rows of 64 bytes (a 16 x 16 float32
// or int32 sum, 16 rows of 32 bfloat16s or 64 bytes, a B operand of 16 pairs or groups of
// 4 rows by 16 columns), so that a thread's configuration serves whichever kernel it runs
// next.
#pragma once

#include <cstdint>

#if defined(__x86_64__) && defined(__linux__) && (defined(__GNUC__) || defined(__clang__))
#define PYENGINE_AMX 1
#include <immintrin.h>
#define PYENGINE_AMX_TARGET \
  __attribute__((target("amx-tile,amx-bf16,amx-int8,avx512f,avx512bw,avx512bf16")))
#endif

namespace pyengine::detail {

inline constexpr int kAmxTileRows = 16;
inline constexpr int kAmxTileBytes = 64;  // a tile row

// Whether this CPU has AMX with bfloat16 (and AVX512-BF16) and Linux lets this process
// use the tile state (asked for once, on the first call).
bool amx_usable();

// Whether AMX's int8 products (tdpbusd) are usable too.
bool amx_int8_usable();

// Whether the bfloat16-panel and int8 kernels take many rows on the tile unit: AMX is
// usable, the quantized kernels run their AVX-512 build and set_amx_tiles has not turned
// it off.
bool amx_tiles_enabled();

// The calling thread's tiles configured as above, for as long as it lives (RAII: the
// tiles released after it). Only where amx_usable().
class AmxTiles {
 public:
  AmxTiles();
  ~AmxTiles();
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
};

}  // namespace pyengine::detail
