// The AMX tile unit's availability and configuration (see amx_tiles.h).
#include "amx_tiles.h"

#include <atomic>
#include <string>

#include "pyengine/dense.h"
#include "pyengine/errors.h"
#include "quantized_panel.h"

#ifdef PYENGINE_AMX
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace pyengine {
namespace detail {
namespace {

std::atomic<bool>& amx_tiles_allowed() {
  static std::atomic<bool> allowed{true};
  return allowed;
}

#ifdef PYENGINE_AMX
// cpuid leaf 7's edx bits: AMX-BF16 22, AMX-TILE 24, AMX-INT8 25.
unsigned amx_feature_bits() {
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  __asm__("cpuid" : "=a"(eax), "=b"(ebx), "=c"(ecx), "=d"(edx) : "a"(7), "c"(0));
  return edx;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t bytes_per_row[16] = {};
  uint8_t rows[16] = {};
};

PYENGINE_AMX_TARGET void configure_tiles() {
  TileConfig config;
  for (int t = 0; t < 8; ++t) {
    config.bytes_per_row[t] = kAmxTileBytes;
    config.rows[t] = kAmxTileRows;
  }
  // GCC 12's _tile_loadconfig tells the compiler it reads only the first 8 bytes, which
  // would let it drop the stores above: make them all visible first.
  __asm__ volatile("" : : "r"(&config) : "memory");
  _tile_loadconfig(&config);
}

PYENGINE_AMX_TARGET void release_tiles() { _tile_release(); }
#endif

}  // namespace

bool amx_usable() {
#ifdef PYENGINE_AMX
  static const bool usable = [] {
    const unsigned edx = amx_feature_bits();
    const bool amx_bf16 = (edx >> 22 & 1) != 0, amx_tile = (edx >> 24 & 1) != 0;
    const bool avx512_bf16 = __builtin_cpu_supports("avx512bf16") != 0;
    if (!amx_bf16 || !amx_tile || !avx512_bf16) return false;
    // Linux hands out the 8 KiB tile state only to processes that ask (arch_prctl
    // ARCH_REQ_XCOMP_PERM for XTILEDATA, feature 18); the grant covers every thread.
    constexpr int kReqXcompPerm = 0x1023, kXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return usable;
#else
  return false;
#endif
}

bool amx_int8_usable() {
#ifdef PYENGINE_AMX
  static const bool usable = amx_usable() && (amx_feature_bits() >> 25 & 1) != 0;
  return usable;
#else
  return false;
#endif
}

bool amx_tiles_enabled() {
  return amx_tiles_allowed().load(std::memory_order_relaxed) && amx_usable() &&
         quantized_avx512();
}

AmxTiles::AmxTiles() {
#ifdef PYENGINE_AMX
  configure_tiles();
#endif
}

AmxTiles::~AmxTiles() {
#ifdef PYENGINE_AMX
  release_tiles();
#endif
}

}  // namespace detail

void set_amx_tiles(bool enabled) {
  if (enabled && !detail::amx_usable()) {
    throw InvalidArgument("set_amx_tiles: this CPU has no AMX with bfloat16 that the OS "
                          "lets this process use");
  }
  detail::amx_tiles_allowed().store(enabled);
}

bool amx_tiles() { return detail::amx_tiles_enabled(); }

}  // namespace pyengine
