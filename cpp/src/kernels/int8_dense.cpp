// W8A8 int8 matmul (see pyengine/int8_dense.h): x quantized per row, then int32 sums of
// int8 products, on AVX-512 VNNI (vpdpbusd: unsigned bytes of x times signed bytes of w,
// 4 k at a time), on AVX2 (vpmaddubsw) or in portable loops; all end in the same float32
// arithmetic, so they agree bit for bit.
#include "pyengine/int8_dense.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define PYENGINE_INT8_X86 1
#endif

#include "amx_tiles.h"
#include "float_convert.h"
#include "pyengine/dense.h"
#include "quantized_panel.h"
#include "tensor_checks.h"
#include "vector_clones.h"

namespace pyengine {
namespace {

using detail::arg;

constexpr int64_t kGroup = 4;          // k a byte group of a column holds
constexpr int64_t kRowsPerTile = 8;    // rows of x a tile's sums cover
constexpr int64_t kAmxRowsPerTile = 32;  // the same on AMX: two row tiles
constexpr int64_t kAmxMinRows = 8;       // rows from which the tile unit takes them
constexpr int64_t kPanelsPerUnit = 2;  // panels a thread takes at a time
constexpr int kUnsignedOffset = 128;   // x's bytes are xq + 128 (vpdpbusd's unsigned side)

int64_t padded_k(int64_t k) { return (k + kGroup - 1) / kGroup * kGroup; }
int64_t num_panels(int64_t n) { return (n + kInt8PanelWidth - 1) / kInt8PanelWidth; }
int64_t panel_bytes(int64_t k) { return padded_k(k) * kInt8PanelWidth; }

bool vnni_supported() {
#ifdef PYENGINE_INT8_X86
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vnni");
#else
  return false;
#endif
}

#ifdef PYENGINE_INT8_X86
// quantize_row's values in AVX-512, the same bits (a division, rounded to nearest even,
// clamped), for a finite s > 0. (GCC's clones of the loop ran it 8 floats at a time
// through a rounding that AVX does in 4-float halves; a prefill's rows took a fifth of
// the tile unit's int8 products' time.)
__attribute__((target("avx512f,avx512bw"))) void quantize_values_avx512(const float* row,
                                                                        int64_t k, float s,
                                                                        uint8_t* out) {
  const __m512 scale = _mm512_set1_ps(s), high = _mm512_set1_ps(127.0f);
  const __m512 low = _mm512_set1_ps(-127.0f);
  const __m512i offset = _mm512_set1_epi32(kUnsignedOffset);
  for (int64_t i = 0; i < k; i += 16) {
    const auto live = static_cast<__mmask16>((1u << std::min<int64_t>(16, k - i)) - 1);
    const __m512 q = _mm512_roundscale_ps(_mm512_div_ps(_mm512_maskz_loadu_ps(live, row + i), scale),
                                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 clamped = _mm512_min_ps(_mm512_max_ps(q, low), high);
    _mm512_mask_cvtepi32_storeu_epi8(out + i, live,
                                     _mm512_add_epi32(_mm512_cvtps_epi32(clamped), offset));
  }
}
#endif

// One row's scale, and its xq + 128 into `out` (k of them). Rounding is to nearest, ties
// to even, as numpy's rint.
PYENGINE_VECTOR_CLONES float quantize_row(const float* row, int64_t k, uint8_t* out) {
  const float s = detail::max_abs(row, k) / 127.0f;
  if (!(s > 0.0f)) return s;  // a zero row: every xq 0 (a NaN one: NaN sums)
#ifdef PYENGINE_INT8_X86
  if (std::isfinite(s) && detail::quantized_avx512()) {
    quantize_values_avx512(row, k, s, out);
    return s;
  }
#endif
  // (the clamp a guard, in comparisons that vectorize where std::clamp did not)
  for (int64_t i = 0; i < k; ++i) {
    const float rounded = std::nearbyint(row[i] / s);
    const float q = rounded > 127.0f ? 127.0f : rounded < -127.0f ? -127.0f : rounded;
    out[i] = static_cast<uint8_t>(static_cast<int>(q) + kUnsignedOffset);
  }
  return s;
}

// The per-row scale and xq + 128 of x [m, k], rows kp apart (the padding k, and the rows
// up to m_pad, hold 128: 0).
void quantize_rows(const TensorView& x, int64_t kp, int64_t m_pad, std::vector<uint8_t>& xq,
                   std::vector<float>& row_scale) {
  const int64_t m = x.shape[0], k = x.shape[1];
  xq.assign(static_cast<size_t>(m_pad * kp), static_cast<uint8_t>(kUnsignedOffset));
  row_scale.resize(static_cast<size_t>(m));
  const auto* data = static_cast<const float*>(x.data);
  uint8_t* out = xq.data();
  float* scales = row_scale.data();
#pragma omp parallel for if (m * k >= (1 << 14))
  for (int64_t r = 0; r < m; ++r) scales[r] = quantize_row(data + r * x.strides[0], k, out + r * kp);
}

// The weight's panels, its columns' sums of q, and whether any q is -128.
struct Packed {
  const int8_t* panels;
  const int32_t* column_sums;  // [num_panels * kInt8PanelWidth]
  int64_t kp;
  bool has_minus_128;  // (the AVX2 build's sign trick cannot negate it)

  const int8_t* panel(int64_t p) const { return panels + p * kp * kInt8PanelWidth; }
};

// The one float32 ending of both builds: sx * scale[j] applied to the exact int32 sum.
inline float finish(int32_t dot, float row_scale, float column_scale) {
  return static_cast<float>(dot) * (row_scale * column_scale);
}

// Rows [r0, r0 + rows) times panels [p0, p0 + panels): sums[r][c] over the panels'
// columns, in the portable build.
void tile_generic(const uint8_t* xq, int64_t kp, int64_t rows, const Packed& w, int64_t p0,
                  int64_t panels, int32_t* sums) {
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* x = xq + r * kp;
    for (int64_t p = 0; p < panels; ++p) {
      const int8_t* panel = w.panel(p0 + p);
      int32_t acc[kInt8PanelWidth] = {};
      for (int64_t g = 0; g < kp / kGroup; ++g) {
        const int8_t* group = panel + g * kInt8PanelWidth * kGroup;
        for (int64_t c = 0; c < kInt8PanelWidth; ++c) {
          for (int64_t j = 0; j < kGroup; ++j) {
            acc[c] += (static_cast<int32_t>(x[g * kGroup + j]) - kUnsignedOffset) *
                      group[c * kGroup + j];
          }
        }
      }
      std::memcpy(sums + (r * panels + p) * kInt8PanelWidth, acc, sizeof(acc));
    }
  }
}

#ifdef PYENGINE_INT8_X86
#define PYENGINE_INT8_AVX2 __attribute__((target("avx2")))

// AVX2 has no vpdpbusd: vpmaddubsw multiplies unsigned by signed bytes into saturating
// int16 pairs, so x's sign moves onto w (|xq| times w * sign(xq): pairs of at most
// 2 * 127 * 127, no saturation), and vpmaddwd by ones sums the pairs into int32. A panel's
// 16 columns are two vectors of 8 columns x 4 k.
template <int kRows>
PYENGINE_INT8_AVX2 void tile_avx2(const uint8_t* xq, int64_t kp, const int8_t* panel,
                                  int32_t* sums, int64_t sums_stride) {
  __m256i acc[kRows][2];
  for (int r = 0; r < kRows; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_si256();
  const __m256i ones = _mm256_set1_epi16(1);
  const __m256i offset = _mm256_set1_epi8(static_cast<char>(0x80));
  for (int64_t g = 0; g < kp / kGroup; ++g) {
    const __m256i w0 =
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(panel + g * kInt8PanelWidth * kGroup));
    const __m256i w1 = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(panel + g * kInt8PanelWidth * kGroup + 32));
    for (int r = 0; r < kRows; ++r) {
      int32_t four = 0;
      std::memcpy(&four, xq + r * kp + g * kGroup, sizeof(four));
      const __m256i x = _mm256_xor_si256(_mm256_set1_epi32(four), offset);  // xq, signed
      const __m256i magnitude = _mm256_abs_epi8(x);
      const __m256i p0 = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w0, x));
      const __m256i p1 = _mm256_maddubs_epi16(magnitude, _mm256_sign_epi8(w1, x));
      acc[r][0] = _mm256_add_epi32(acc[r][0], _mm256_madd_epi16(p0, ones));
      acc[r][1] = _mm256_add_epi32(acc[r][1], _mm256_madd_epi16(p1, ones));
    }
  }
  for (int r = 0; r < kRows; ++r) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + r * sums_stride), acc[r][0]);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(sums + r * sums_stride + 8), acc[r][1]);
  }
}

void tile_avx2_rows(const uint8_t* xq, int64_t kp, int64_t rows, const Packed& w, int64_t p0,
                    int64_t panels, int32_t* sums) {
  for (int64_t p = 0; p < panels; ++p) {
    for (int64_t r0 = 0; r0 < rows; r0 += 4) {
      const uint8_t* x = xq + r0 * kp;
      int32_t* out = sums + (r0 * panels + p) * kInt8PanelWidth;
      const int64_t stride = panels * kInt8PanelWidth;
      switch (std::min<int64_t>(4, rows - r0)) {
        case 1: tile_avx2<1>(x, kp, w.panel(p0 + p), out, stride); break;
        case 2: tile_avx2<2>(x, kp, w.panel(p0 + p), out, stride); break;
        case 3: tile_avx2<3>(x, kp, w.panel(p0 + p), out, stride); break;
        default: tile_avx2<4>(x, kp, w.panel(p0 + p), out, stride); break;
      }
    }
  }
}

#define PYENGINE_VNNI __attribute__((target("avx512f,avx512bw,avx512vnni")))

template <int kRows, int kPanels>
PYENGINE_VNNI void tile_vnni(const uint8_t* xq, int64_t kp, const Packed& w, int64_t p0,
                             int32_t* sums) {
  __m512i acc[kRows][kPanels];
  for (int r = 0; r < kRows; ++r) {
    for (int p = 0; p < kPanels; ++p) acc[r][p] = _mm512_setzero_si512();
  }
  const int8_t* panel[kPanels];
  for (int p = 0; p < kPanels; ++p) panel[p] = w.panel(p0 + p);
  for (int64_t g = 0; g < kp / kGroup; ++g) {
    __m512i weights[kPanels];
    for (int p = 0; p < kPanels; ++p) {
      weights[p] = _mm512_loadu_si512(panel[p] + g * kInt8PanelWidth * kGroup);
    }
    for (int r = 0; r < kRows; ++r) {
      int32_t four = 0;
      std::memcpy(&four, xq + r * kp + g * kGroup, sizeof(four));
      const __m512i x = _mm512_set1_epi32(four);
      for (int p = 0; p < kPanels; ++p) acc[r][p] = _mm512_dpbusd_epi32(acc[r][p], x, weights[p]);
    }
  }
  // Each sum counted x's offset 128 times the column's sum of q: taken back out.
  for (int p = 0; p < kPanels; ++p) {
    const __m512i offset = _mm512_mullo_epi32(
        _mm512_set1_epi32(kUnsignedOffset),
        _mm512_loadu_si512(w.column_sums + (p0 + p) * kInt8PanelWidth));
    for (int r = 0; r < kRows; ++r) {
      _mm512_storeu_si512(sums + (r * kPanels + p) * kInt8PanelWidth,
                          _mm512_sub_epi32(acc[r][p], offset));
    }
  }
}

template <int kPanels>
void tile_vnni_rows(const uint8_t* xq, int64_t kp, int64_t rows, const Packed& w, int64_t p0,
                    int32_t* sums) {
  static_assert(kRowsPerTile == 8);
  switch (rows) {
    case 1: return tile_vnni<1, kPanels>(xq, kp, w, p0, sums);
    case 2: return tile_vnni<2, kPanels>(xq, kp, w, p0, sums);
    case 3: return tile_vnni<3, kPanels>(xq, kp, w, p0, sums);
    case 4: return tile_vnni<4, kPanels>(xq, kp, w, p0, sums);
    case 5: return tile_vnni<5, kPanels>(xq, kp, w, p0, sums);
    case 6: return tile_vnni<6, kPanels>(xq, kp, w, p0, sums);
    case 7: return tile_vnni<7, kPanels>(xq, kp, w, p0, sums);
    default: return tile_vnni<8, kPanels>(xq, kp, w, p0, sums);
  }
}
#endif

#ifdef PYENGINE_AMX
constexpr int64_t kAmxK = detail::kAmxTileBytes;  // k of one tile product (16 groups)

// Rows [0, 16 kRowTiles) of xq (kp apart, kp a multiple of kAmxK) times panels p0 and
// p0 + 1 (panels 2) or p0 alone, on AMX: tiles 0-3 the sums (row tile r, panel p: tile
// 2r + p), 4-5 x's row tiles, 6-7 the panels' B tiles (16 groups of a panel: 1 KiB in
// one piece). tdpbusd multiplies x's unsigned bytes by w's signed ones as vpdpbusd does.
template <int kRowTiles>
PYENGINE_AMX_TARGET void tile_amx(const uint8_t* xq, int64_t kp, const Packed& w, int64_t p0,
                                  int64_t panels, int32_t* sums) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (kRowTiles == 2) {
    _tile_zero(2);
    _tile_zero(3);
  }
  const int8_t* first = w.panel(p0);
  const int8_t* second = w.panel(p0 + panels - 1);  // (panels 1: its sums not stored)
  const uint8_t* lower = xq + detail::kAmxTileRows * kp;
  // Each tile is loaded for the next k right after the last product that reads it.
  _tile_loadd(4, xq, kp);
  _tile_loadd(6, first, kAmxK);
  _tile_loadd(7, second, kAmxK);
  if constexpr (kRowTiles == 2) _tile_loadd(5, lower, kp);
  for (int64_t g = 0; g < kp; g += kAmxK) {
    const int64_t next = g + kAmxK;
    const bool more = next < kp;
    _tile_dpbusd(0, 4, 6);
    _tile_dpbusd(1, 4, 7);
    if (more) _tile_loadd(4, xq + next, kp);
    if constexpr (kRowTiles == 2) {
      _tile_dpbusd(2, 5, 6);
      if (more) _tile_loadd(6, first + next * kInt8PanelWidth, kAmxK);
      _tile_dpbusd(3, 5, 7);
      if (more) _tile_loadd(5, lower + next, kp);
    } else if (more) {
      _tile_loadd(6, first + next * kInt8PanelWidth, kAmxK);
    }
    if (more) _tile_loadd(7, second + next * kInt8PanelWidth, kAmxK);
  }
  const int64_t stride = panels * kInt8PanelWidth;  // sums [row][panels][16]
  const int64_t down = detail::kAmxTileRows * stride;
  _tile_stored(0, sums, stride * 4);
  if (panels == 2) _tile_stored(1, sums + kInt8PanelWidth, stride * 4);
  if constexpr (kRowTiles == 2) {
    _tile_stored(2, sums + down, stride * 4);
    if (panels == 2) _tile_stored(3, sums + down + kInt8PanelWidth, stride * 4);
  }
}

// out's rows [0, rows), columns of panels [p0, p0 + panels) from tile_amx's sums: x's
// offset 128 times each column's sum of q taken back out, then finish's arithmetic.
PYENGINE_AMX_TARGET void store_amx_rows(const int32_t* sums, int64_t rows, const Packed& w,
                                        int64_t p0, int64_t panels, int64_t n,
                                        const float* row_scale, const float* scale,
                                        const float* bias, float* out, int64_t ldc) {
  for (int64_t p = 0; p < panels; ++p) {
    const int64_t first = (p0 + p) * kInt8PanelWidth;
    const auto live = static_cast<__mmask16>((1u << std::min(kInt8PanelWidth, n - first)) - 1);
    const __m512i offset = _mm512_mullo_epi32(_mm512_set1_epi32(kUnsignedOffset),
                                              _mm512_loadu_si512(w.column_sums + first));
    const __m512 s = _mm512_maskz_loadu_ps(live, scale + first);
    const __m512 b = bias != nullptr ? _mm512_maskz_loadu_ps(live, bias + first)
                                     : _mm512_setzero_ps();
    for (int64_t r = 0; r < rows; ++r) {
      const __m512i dot = _mm512_sub_epi32(
          _mm512_loadu_si512(sums + (r * panels + p) * kInt8PanelWidth), offset);
      // (row_scale * scale first, as finish multiplies; bias added after the rounding)
      __m512 value = _mm512_mul_ps(_mm512_cvtepi32_ps(dot),
                                   _mm512_mul_ps(_mm512_set1_ps(row_scale[r]), s));
      if (bias != nullptr) value = _mm512_add_ps(value, b);
      _mm512_mask_storeu_ps(out + r * ldc + first, live, value);
    }
  }
}
#endif

enum class Build { kGeneric, kAvx2, kVnni, kAmx };

// The build for this weight and m rows: as pinned (set_quantized_dense_isa,
// set_amx_tiles), AMX from kAmxMinRows rows where k is a multiple of its tiles', VNNI
// where the CPU has it, else AVX2 unless a q is -128.
Build pick_build(const Packed& w, int64_t m) {
#ifdef PYENGINE_AMX
  if (m >= kAmxMinRows && w.kp % kAmxK == 0 && detail::amx_int8_usable() &&
      detail::amx_tiles_enabled()) {
    return Build::kAmx;
  }
#else
  (void)m;
#endif
  const CpuIsa isa = quantized_dense_isa();
  if (isa == CpuIsa::kAvx512 && vnni_supported()) return Build::kVnni;
  if ((isa == CpuIsa::kAvx512 || isa == CpuIsa::kAvx2) && !w.has_minus_128) return Build::kAvx2;
  return Build::kGeneric;
}

void run_tile(Build build, const uint8_t* xq, int64_t kp, int64_t rows, const Packed& w,
              int64_t p0, int64_t panels, int32_t* sums) {
#ifdef PYENGINE_AMX
  if (build == Build::kAmx) {
    if (rows > detail::kAmxTileRows) return tile_amx<2>(xq, kp, w, p0, panels, sums);
    return tile_amx<1>(xq, kp, w, p0, panels, sums);
  }
#endif
#ifdef PYENGINE_INT8_X86
  if (build == Build::kVnni) {
    if (panels == 2) return tile_vnni_rows<2>(xq, kp, rows, w, p0, sums);
    return tile_vnni_rows<1>(xq, kp, rows, w, p0, sums);
  }
  if (build == Build::kAvx2) return tile_avx2_rows(xq, kp, rows, w, p0, panels, sums);
#endif
  (void)build;
  tile_generic(xq, kp, rows, w, p0, panels, sums);
}

Packed check_packed(const char* op, const TensorView& packed, int64_t k, int64_t n) {
  detail::check_cpu(packed, op, "packed");
  const int64_t size = packed_int8_weight_size(k, n);
  if (packed.dtype != DType::kInt8 || packed.ndim != 1 || packed.strides[0] != 1 ||
      packed.shape[0] != size) {
    throw InvalidArgument(std::string(op) + ": packed must be a packed int8 [" +
                          std::to_string(n) + ", " + std::to_string(k) + "] weight: int8 [" +
                          std::to_string(size) + "] (pack_int8_weight), got " + packed.describe());
  }
  const auto* base = static_cast<const int8_t*>(packed.data);
  const int64_t kp = padded_k(k);
  const auto* sums = reinterpret_cast<const int32_t*>(base + num_panels(n) * panel_bytes(k));
  return {base, sums, kp, sums[num_panels(n) * kInt8PanelWidth] != 0};
}

}  // namespace

bool int8_dense_vnni() { return vnni_supported() && detail::quantized_avx512(); }

int64_t packed_int8_weight_size(int64_t k, int64_t n) {
  if (k < 0 || n < 0) {
    throw InvalidArgument("packed_int8_weight_size: k and n must be >= 0, got " +
                          std::to_string(k) + " and " + std::to_string(n));
  }
  // (after the panels: the column sums, int32, then an int32 flag: whether a q is -128)
  return num_panels(n) * (panel_bytes(k) + kInt8PanelWidth * int64_t{sizeof(int32_t)}) +
         int64_t{sizeof(int32_t)};
}

void pack_int8_weight(const TensorView& packed, const TensorView& q) {
  constexpr const char* op = "pack_int8_weight";
  detail::check_rows(q, op, "q", 2, DType::kInt8);
  const int64_t n = q.shape[0], k = q.shape[1];
  detail::check_cpu(packed, op, "packed");
  detail::check_dtype(packed, DType::kInt8, op, "packed");
  const int64_t size = packed_int8_weight_size(k, n);
  if (packed.ndim != 1 || packed.shape[0] != size || packed.strides[0] != 1) {
    throw InvalidArgument(arg(op, "packed") + " must be dense int8 [" +
                          std::to_string(size) + "], got " + packed.describe());
  }
  auto* dst = static_cast<int8_t*>(packed.data);
  std::memset(dst, 0, static_cast<size_t>(size));
  const int64_t panels_bytes = num_panels(n) * panel_bytes(k);
  std::vector<int32_t> sums(static_cast<size_t>(num_panels(n) * kInt8PanelWidth + 1), 0);
  int32_t& has_minus_128 = sums.back();
  for (int64_t j = 0; j < n; ++j) {
    const auto* row = static_cast<const int8_t*>(q.data) + j * q.strides[0];
    int8_t* panel = dst + j / kInt8PanelWidth * panel_bytes(k);
    const int64_t c = j % kInt8PanelWidth;
    for (int64_t i = 0; i < k; ++i) {
      panel[(i / kGroup * kInt8PanelWidth + c) * kGroup + i % kGroup] = row[i];
      sums[static_cast<size_t>(j)] += row[i];
      has_minus_128 |= row[i] == -128 ? 1 : 0;
    }
  }
  std::memcpy(dst + panels_bytes, sums.data(), sums.size() * sizeof(int32_t));
}

void int8_dense(const TensorView& out, const TensorView& x, const TensorView& packed,
                const TensorView& scale, const TensorView& bias, int64_t n) {
  constexpr const char* op = "int8_dense";
  detail::check_x_out(op, out, x, n);
  const int64_t m = x.shape[0], k = x.shape[1];
  const Packed w = check_packed(op, packed, k, n);
  detail::check_vector(scale, op, "scale", n);
  const bool has_bias = bias.data != nullptr;
  if (has_bias) detail::check_vector(bias, op, "bias", n);
  const Build build = pick_build(w, m);
  const int64_t tile_rows = build == Build::kAmx ? kAmxRowsPerTile : kRowsPerTile;
  thread_local std::vector<uint8_t> xq;
  thread_local std::vector<float> row_scale;
  quantize_rows(x, w.kp, (m + tile_rows - 1) / tile_rows * tile_rows, xq, row_scale);
  const auto* s = static_cast<const float*>(scale.data);
  const auto* b = static_cast<const float*>(bias.data);
  auto* c = static_cast<float*>(out.data);
  const int64_t ldc = out.strides[0];
  const int64_t units = (num_panels(n) + kPanelsPerUnit - 1) / kPanelsPerUnit;
  const uint8_t* xq_data = xq.data();
  const float* sx = row_scale.data();
#pragma omp parallel if (units > 1 && m * k * n >= (1 << 16))
  {
    std::optional<detail::AmxTiles> tiles;
    if (build == Build::kAmx) tiles.emplace();
#pragma omp for schedule(guided, 2)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t p0 = u * kPanelsPerUnit;
      const int64_t panels = std::min(kPanelsPerUnit, num_panels(n) - p0);
      int32_t sums[kAmxRowsPerTile * kPanelsPerUnit * kInt8PanelWidth];
      for (int64_t r0 = 0; r0 < m; r0 += tile_rows) {
        const int64_t rows = std::min(tile_rows, m - r0);
        run_tile(build, xq_data + r0 * w.kp, w.kp, rows, w, p0, panels, sums);
#ifdef PYENGINE_AMX
        if (build == Build::kAmx) {
          store_amx_rows(sums, rows, w, p0, panels, n, sx + r0, s, b, c + r0 * ldc, ldc);
          continue;
        }
#endif
        for (int64_t r = 0; r < rows; ++r) {
          for (int64_t p = 0; p < panels; ++p) {
            const int64_t first = (p0 + p) * kInt8PanelWidth;
            const int64_t width = std::min(kInt8PanelWidth, n - first);
            const int32_t* dot = sums + (r * panels + p) * kInt8PanelWidth;
            float* dst = c + (r0 + r) * ldc + first;
            for (int64_t j = 0; j < width; ++j) {
              const float value = finish(dot[j], sx[r0 + r], s[first + j]);
              dst[j] = has_bias ? value + b[first + j] : value;
            }
          }
        }
      }
    }
  }
}

}  // namespace pyengine
