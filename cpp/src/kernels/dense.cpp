// Small-m GEMM over panel-packed weights (see pyengine/dense.h). One micro-kernel:
// 8 rows x 48 columns (24 accumulators of 16 floats, as GCC vector extensions, which the
// AVX2 and generic clones split into narrower registers, and take in passes of 2 rows),
// over the whole k; threads take panels.
#include "pyengine/dense.h"

#include <algorithm>
#include <cstring>
#include <optional>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <string>
#include <vector>

#include "activation.h"
#include "amx_tiles.h"
#include "bf16_panel.h"
#include "quantized_panel.h"
#include "split_bf16_gemm.h"
#include "tensor_checks.h"
#include "vector_clones.h"

namespace pyengine {
namespace {

using detail::arg;
using detail::check_rows;
using detail::check_x_out;

constexpr int kRows = 8;
constexpr int64_t kPrefetchRows = 24;
constexpr int64_t kBlockFloats = 96 * 1024;  // rows of x per block: 384 KiB of them
// bfloat16 rows on the tile unit: 1 MiB of them, and at least 256 rows. A block re-reads
// every panel from memory (or L3), so the float32 block's 384 KiB (only 16 rows at k =
// 8192) read a whole weight per 16 rows; the tile unit's chunks of k (bf16_panel.cpp) read
// x's rows from L2 a chunk at a time, so a block may outgrow it where k is long. Against
// the float32 block, a Llama-3.2-1B shape's 2048-row matmuls ran 1.3x (k = 2048) to 2.1x
// (k = 8192) faster (best of 5 each, one process; 512 rows at k = 8192 were slower).
constexpr int64_t kBf16AmxBlockElements = 512 * 1024;
constexpr int64_t kBf16AmxMinBlockRows = 256;
// A zmm's floats, and a ymm's: the loops below are built for either and run in the one
// the CPU holds in its registers (detail::wide_vectors); an 8-row tile's 24 sums of 16
// fill AVX-512's 32 registers, and 8-float tiles go in passes of 2 rows (12 sums in
// AVX2's 16), the same products in the same order.
using Vec16 = float __attribute__((vector_size(64)));
using Vec8 = float __attribute__((vector_size(32)));
template <class V>
constexpr int kVectorsOf = kPanelWidth / static_cast<int>(sizeof(V) / sizeof(float));

// (v by reference: a returned vector wider than the default clone's registers would
// change the ABI)
template <class V>
[[gnu::always_inline]] inline void load_vec(V& v, const float* p) {
  std::memcpy(&v, p, sizeof v);
}
template <class V>
[[gnu::always_inline]] inline void store_vec(float* p, const V& v) {
  std::memcpy(p, &v, sizeof v);
}
constexpr int lanes_of(int64_t bytes) { return static_cast<int>(bytes / sizeof(float)); }

// What a tile asks memory for as it goes: `per_step` cache lines per k step, in order
// from `start`, into L2. The first tile of a block asks for its own panel some rows
// ahead; tiles 1-3 each take a contiguous share of the next panel, so that its stream
// from memory runs in order over the block's compute rather than in one burst past what
// memory delivers; the later tiles ask for nothing.
struct Fetch {
  const float* start;
  int per_step;
};

Fetch fetch_plan(int64_t index, int64_t num_tiles, const float* panel, int64_t k) {
  constexpr int kLinesPerRow = kPanelWidth / 16;
  if (index == 0) return {panel + kPrefetchRows * kPanelWidth, kLinesPerRow};
  const int64_t followers = std::min<int64_t>(3, num_tiles - 1);
  if (index > followers) return {nullptr, 0};
  const int per_step = static_cast<int>((kLinesPerRow + followers - 1) / followers);
  const int64_t share = (k * kLinesPerRow + followers - 1) / followers * 16;  // floats
  return {panel + k * kPanelWidth + (index - 1) * share, per_step};
}

// c[r][0, 48) (+)= sum over i < k of a[r][i] * panel[i][0, 48), for kGroup rows of a
// (lda apart), in vectors V, adding to c's sums where kAccumulate, while asking for
// kPerStep lines of `fetch` per k step (fetch_plan). (Into L2: each weight byte is used
// once per step, by the few tiles of one block; L1 holds their working set.) The sums'
// loops are unrolled early, so that the compiler keeps the sums in registers: with a
// runtime `accumulate` and the loops left to it, they went through a stack copy on the
// way in and out of every tile call; a quantized chunk's 128-row tiles paid most.
template <int kPerStep, bool kAccumulate, class V, int kGroup>
PYENGINE_VECTOR_CLONES void tile(const float* a, int64_t lda, const float* panel, int64_t k,
                                 float* c, const float* fetch) {
  constexpr int kV = kVectorsOf<V>, kL = lanes_of(sizeof(V));
  V acc[kGroup][kV];
#pragma GCC unroll 8
  for (int r = 0; r < kGroup; ++r) {
#pragma GCC unroll 6
    for (int v = 0; v < kV; ++v) {
      acc[r][v] = V{};
      if constexpr (kAccumulate) load_vec(acc[r][v], c + r * kPanelWidth + v * kL);
    }
  }
  for (int64_t i = 0; i < k; ++i) {
    for (int j = 0; j < kPerStep; ++j) __builtin_prefetch(fetch + (i * kPerStep + j) * 16, 0, 1);
    V b[kV];
#pragma GCC unroll 6
    for (int v = 0; v < kV; ++v) load_vec(b[v], panel + i * kPanelWidth + v * kL);
#pragma GCC unroll 8
    for (int r = 0; r < kGroup; ++r) {
      const float x = a[r * lda + i];
#pragma GCC unroll 6
      for (int v = 0; v < kV; ++v) acc[r][v] += x * b[v];
    }
  }
#pragma GCC unroll 8
  for (int r = 0; r < kGroup; ++r) {
#pragma GCC unroll 6
    for (int v = 0; v < kV; ++v) store_vec(c + r * kPanelWidth + v * kL, acc[r][v]);
  }
}

template <int kPerStep, bool kAccumulate>
void grouped_tile(const float* a, int64_t lda, const float* panel, int64_t k, float* c,
                  const float* fetch) {
  if (detail::wide_vectors())
    return tile<kPerStep, kAccumulate, Vec16, kRows>(a, lda, panel, k, c, fetch);
  tile<kPerStep, kAccumulate, Vec8, 2>(a, lda, panel, k, c, fetch);
  for (int r = 2; r < kRows; r += 2) {  // (the first pass alone asks for the next panel)
    tile<0, kAccumulate, Vec8, 2>(a + r * lda, lda, panel, k, c + r * kPanelWidth, nullptr);
  }
}

// (Only the quantized path's tiles accumulate, and they ask for nothing: its widening
// reads ahead.)
void run_tile(const float* a, int64_t lda, const float* panel, int64_t k, float* c, bool accumulate,
              const Fetch& fetch) {
  if (accumulate) return grouped_tile<0, true>(a, lda, panel, k, c, nullptr);
  switch (fetch.per_step) {
    case 0: return grouped_tile<0, false>(a, lda, panel, k, c, fetch.start);
    case 1: return grouped_tile<1, false>(a, lda, panel, k, c, fetch.start);
    case 2: return grouped_tile<2, false>(a, lda, panel, k, c, fetch.start);
    default: return grouped_tile<3, false>(a, lda, panel, k, c, fetch.start);
  }
}

// The same for one row (a single request's decode): two chains per vector hide the
// multiply-add latency, and no compute goes to padding rows.
template <class V>
PYENGINE_VECTOR_CLONES void row_tile_of(const float* a, const float* panel, int64_t k, float* c,
                                        bool accumulate) {
  constexpr int kV = kVectorsOf<V>, kL = lanes_of(sizeof(V));
  V even[kV] = {}, odd[kV] = {};
  if (accumulate) {
    for (int v = 0; v < kV; ++v) load_vec(even[v], c + v * kL);
  }
  int64_t i = 0;
  for (; i + 1 < k; i += 2) {
    const float* row = panel + i * kPanelWidth;
    const float x0 = a[i], x1 = a[i + 1];
#pragma GCC unroll 6
    for (int v = 0; v < kV; ++v) {
      V w0, w1;
      load_vec(w0, row + v * kL);
      load_vec(w1, row + kPanelWidth + v * kL);
      even[v] += x0 * w0;
      odd[v] += x1 * w1;
    }
  }
  if (i < k) {
    const float* row = panel + i * kPanelWidth;
    for (int v = 0; v < kV; ++v) {
      V w;
      load_vec(w, row + v * kL);
      even[v] += a[i] * w;
    }
  }
  for (int v = 0; v < kV; ++v) store_vec(c + v * kL, even[v] + odd[v]);
}

void row_tile(const float* a, const float* panel, int64_t k, float* c, bool accumulate) {
  if (detail::wide_vectors()) return row_tile_of<Vec16>(a, panel, k, c, accumulate);
  row_tile_of<Vec8>(a, panel, k, c, accumulate);
}

// x [m, k] as the tiles read it: full tiles of 8 rows from x itself, a last tile of 2-7
// rows from a copy padded with zero rows.
struct Rows8 {
  const float* a;
  int64_t lda;
  int64_t m;
  int64_t k;
  const float* padded_tail;                // rows m / 8 * 8 .. m, then zeros (when there are 2-7)
  const detail::Int8Rows* int8 = nullptr;  // the rows quantized, where they multiply so
};

Rows8 tile_rows(const TensorView& x) {
  const auto* a = static_cast<const float*>(x.data);
  const int64_t m = x.shape[0], k = x.shape[1], lda = x.strides[0];
  const int64_t tail_first = m / kRows * kRows;
  thread_local std::vector<float> tail;
  if (const int64_t rows = m - tail_first; rows > 1) {
    tail.assign(static_cast<size_t>(kRows * k), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(tail.data() + r * k, a + (tail_first + r) * lda,
                  static_cast<size_t>(k) * sizeof(float));
    }
  }
  return {a, lda, m, k, tail.data()};
}

int64_t n_panels(int64_t n) { return (n + kPanelWidth - 1) / kPanelWidth; }

// A packed weight's panels, float32 or block-quantized (quantized_panel.h).
struct Panels {
  const uint8_t* data;
  detail::QuantForm form;  // code kNone: float32 panels
  int64_t panel_bytes;

  const uint8_t* panel(int64_t p) const { return data + p * panel_bytes; }
};

// x as the tiles read it, with its rows quantized to int8 where `int8_activations` asks
// for it and the weight's integers take them.
Rows8 multiplied_rows(const TensorView& x, const Panels& w, bool int8_activations) {
  Rows8 rows = tile_rows(x);
  if (int8_activations && detail::int8_rows_multiply(w.form.code) && rows.m > 0) {
    thread_local detail::Int8Rows quantized;
    quantized.quantize(rows.a, rows.lda, rows.m, rows.k);
    rows.int8 = &quantized;
  }
  return rows;
}

// Rows of a quantized panel widened at a time: 12 KiB of float32, in L1, beside the
// tiles' slices of x, while every tile of the block passes over them. (Widening a whole
// panel, 110-300 KiB, went through L2 and cost as much as the bytes it saved. Against
// 128-row chunks, which L1 held less well, whole-model matmuls from the 4-bit blocks took
// 1-4% less time for 1-32 rows, 16 alternations in one process; the tiles' sums, kept in
// registers, cost little to reload.)
constexpr int64_t kChunkRows = 2 * kQuantBlock;

// Floats of a thread's tile scratch for a block of `rows` rows: a tile's sums each.
int64_t tile_scratch_floats(int64_t rows) {
  constexpr int64_t kTile = detail::kAmxTileRows;  // (the tile unit's blocks: 16 rows a tile)
  return (rows + kTile - 1) / kTile * kTile * kPanelWidth;
}

// Rows [m0, m1) of x times panel p, 8 rows at a time: sink(r0, rows, tile) receives each
// [rows, kPanelWidth] result (rows kPanelWidth apart). `sums` is the calling thread's
// scratch, tile_scratch_floats(m1 - m0). A float32 panel goes tile by tile over the whole
// k; a quantized one chunk by chunk of kChunkRows widened rows, every tile's sums kept in
// `sums` between chunks.
template <class Sink>
void multiply_panel(const Rows8& x, const Panels& w, int64_t p, int64_t m0, int64_t m1, float* sums,
                    Sink&& sink) {
  const bool quantized = w.form.code != detail::QuantCode::kNone;
  if (x.int8 != nullptr) {  // (a few rows at a time, the panel staying in cache)
    for (int64_t r0 = m0; r0 < m1; r0 += detail::kRegisterRows) {
      const int rows = static_cast<int>(std::min<int64_t>(detail::kRegisterRows, m1 - r0));
      detail::multiply_int8_rows(*x.int8, r0, rows, w.panel(p), w.form, sums);
      sink(r0, rows, static_cast<const float*>(sums));
    }
    return;
  }
  if (quantized && m1 - m0 <= detail::quantized_register_rows()) {
    detail::multiply_quantized_rows(x.a + m0 * x.lda, x.lda, static_cast<int>(m1 - m0), w.panel(p),
                                    x.k, w.form, sums);
    sink(m0, m1 - m0, static_cast<const float*>(sums));
    return;
  }
  thread_local std::vector<float> chunk;
  if (quantized) chunk.resize(static_cast<size_t>(kChunkRows * kPanelWidth));
  const int64_t step = quantized ? kChunkRows : std::max<int64_t>(x.k, 1);
  const int64_t num_tiles = (m1 - m0 + kRows - 1) / kRows;
  for (int64_t i0 = 0; i0 == 0 || i0 < x.k; i0 += step) {  // (once where k is 0: zero sums)
    const int64_t depth = std::min(step, x.k - i0);
    const float* panel = reinterpret_cast<const float*>(w.panel(p));
    if (quantized) {
      const uint8_t* src = w.panel(p) + i0 / kQuantBlock * detail::quantized_block_bytes(w.form);
      detail::widen_quantized_panel(src, depth, w.form, chunk.data());
      panel = chunk.data();
    }
    for (int64_t r0 = m0; r0 < m1; r0 += kRows) {
      const int64_t rows = std::min<int64_t>(kRows, m1 - r0);
      const bool padded = rows > 1 && rows < kRows;
      const float* tile_a = (padded ? x.padded_tail : x.a + r0 * x.lda) + i0;
      const int64_t tile_lda = padded ? x.k : x.lda;
      const int64_t index = (r0 - m0) / kRows;
      // Over the whole k, a tile is done at once: its sums go out from one slot.
      float* c = quantized ? sums + index * kRows * kPanelWidth : sums;
      if (rows == 1) {
        row_tile(tile_a, panel, depth, c, i0 > 0);
      } else if (!quantized) {
        // (A prefetch past the last panel is harmless: prefetches never fault.)
        run_tile(tile_a, tile_lda, panel, depth, c, false,
                 fetch_plan(index, num_tiles, panel, depth));
      } else {  // (the widening asks for the quantized rows ahead)
        run_tile(tile_a, tile_lda, panel, depth, c, i0 > 0, Fetch{nullptr, 0});
      }
      if (!quantized) sink(r0, rows, static_cast<const float*>(c));
    }
  }
  if (!quantized) return;
  for (int64_t r0 = m0; r0 < m1; r0 += kRows) {
    const float* tile_sums = sums + (r0 - m0) * kPanelWidth;
    sink(r0, std::min<int64_t>(kRows, m1 - r0), tile_sums);
  }
}

// body(m0, m1, unit, scratch) for every block of rows and every unit (a panel, or a pair of
// them). Many rows (a prefill) go in blocks whose rows of x stay in L2 while every panel
// passes over them; a decode step's few rows are one block. One parallel region, no
// barrier between blocks: a thread moves on to the next block as soon as it is done.
// Units are handed out guided: runs of consecutive panels (what the fetch plan streams
// ahead into), shrinking towards the end, so that a thread the machine slows down for a
// while (a shared host's vCPUs) does not leave the other waiting at the end of the call.
// (Against the even static split, a run's decode matmuls took 9% less time, its prefill
// matmuls 4% less: medians of 4 alternating runs in one process, same tokens.) Blocks
// start at multiples of 16 rows, where the tile unit's row tiles do. amx: each thread's
// tiles configured once for the region (AmxTiles), for bodies that multiply on them.
// block_elements: of x in a block of rows.
template <class Body>
void for_blocks_and_units(int64_t m, int64_t k, int64_t num_units, int64_t unit_columns, bool amx,
                          Body&& body, int64_t block_elements = kBlockFloats) {
  constexpr int64_t kStep = detail::kAmxTileRows;
  const int64_t block_rows =
      std::max<int64_t>(kStep, block_elements / std::max<int64_t>(k, 1) / kStep * kStep);
#pragma omp parallel if (num_units > 1 && \
                         std::min(m, block_rows) * k * unit_columns * num_units >= (1 << 16))
  {
    std::optional<detail::AmxTiles> tiles;
    if (amx) tiles.emplace();
    for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
      const int64_t m1 = std::min(m, m0 + block_rows);
#pragma omp for schedule(guided, 2) nowait
      for (int64_t u = 0; u < num_units; ++u) {
        thread_local std::vector<float> scratch;  // the tiles' sums, then a unit's gates
        const int64_t rows = std::min(m, block_rows);
        scratch.resize(static_cast<size_t>(tile_scratch_floats(rows) + rows * kPanelWidth));
        body(m0, m1, u, scratch.data());
      }
    }
  }
}

// The panels of a packed [k, n] weight (`pairs`: gate/up panel pairs of n columns each),
// checked: float32 from `how`, or uint8/int8 from pack_quantized_weight.
Panels check_packed(const char* op, const TensorView& packed, int64_t k, int64_t n, bool pairs,
                    const char* how) {
  detail::check_cpu(packed, op, "packed");
  detail::QuantForm form{detail::quant_code(packed.dtype)};
  const bool quantized = form.code != detail::QuantCode::kNone;
  if (quantized && k % kQuantBlock != 0) {
    throw InvalidArgument(std::string(op) + ": a quantized weight needs k (x's columns) a " +
                          "multiple of " + std::to_string(kQuantBlock) + ", got " +
                          std::to_string(k));
  }
  if (quantized && packed.ndim == 1) {  // (a buffer's size tells its groups and params)
    const detail::QuantForm sized =
        detail::quantized_panel_form(packed.dtype, packed.shape[0] / (pairs ? 2 : 1), k, n);
    if (sized.code != detail::QuantCode::kNone) form = sized;
  }
  const int64_t panel_bytes =
      quantized ? detail::quantized_panel_bytes(form, k) : k * kPanelWidth * int64_t{sizeof(float)};
  // (elements: a quantized buffer's are bytes)
  const int64_t size =
      (pairs ? 2 : 1) * (quantized ? n_panels(n) * panel_bytes : packed_weight_size(k, n));
  if (packed.ndim != 1 || packed.strides[0] != 1 || packed.shape[0] != size ||
      !(quantized || packed.dtype == DType::kFloat32)) {
    throw InvalidArgument(std::string(op) + ": packed must be a packed [" + std::to_string(k) +
                          ", " + std::to_string(pairs ? 2 * n : n) + "] weight: float32 (" + how +
                          ") or uint8/int8/float8_e4m3fn (pack_quantized_weight), got " +
                          packed.describe());
  }
  return {static_cast<const uint8_t*>(packed.data), form, panel_bytes};
}

// Columns [first, first + width) of w_t [k, n] as one panel at dst, zero-padded.
void pack_panel(float* dst, const TensorView& w_t, int64_t first, int64_t width) {
  const auto* src = static_cast<const float*>(w_t.data);
  for (int64_t i = 0; i < w_t.shape[0]; ++i) {
    float* out = dst + i * kPanelWidth;
    std::memcpy(out, src + i * w_t.strides[0] + first, static_cast<size_t>(width) * sizeof(float));
    std::fill(out + width, out + kPanelWidth, 0.0f);
  }
}

// w_t float32 rows; packed a dense [size] of `packed_dtype` on the CPU.
void check_pack_args(const char* op, const TensorView& packed, const TensorView& w_t, int64_t size,
                     DType packed_dtype = DType::kFloat32) {
  check_rows(w_t, op, "w_t", 2, DType::kFloat32);
  detail::check_cpu(packed, op, "packed");
  detail::check_dtype(packed, packed_dtype, op, "packed");
  if (packed.ndim != 1 || packed.shape[0] != size || packed.strides[0] != 1) {
    throw InvalidArgument(std::string(op) + ": packed must be dense " + dtype_name(packed_dtype) +
                          " [" + std::to_string(size) + "], got " + packed.describe());
  }
}

// A split-bfloat16 weight (pack_split_weight) for x [m, k] and n columns, checked.
const uint16_t* check_split(const char* op, const TensorView& packed, int64_t k, int64_t n,
                            bool gate_up) {
  detail::check_cpu(packed, op, "packed");
  const int64_t size = packed_split_weight_size(k, n, gate_up);
  if (packed.ndim != 1 || packed.strides[0] != 1 || packed.shape[0] != size) {
    throw InvalidArgument(std::string(op) + ": with float32 x, a bfloat16 packed must be a " +
                          "split [" + std::to_string(k) + ", " +
                          std::to_string(gate_up ? 2 * n : n) + "] weight: bfloat16 [" +
                          std::to_string(size) + "] (pack_split_weight; bfloat16 panels, " +
                          "pack_bf16_weight, take bfloat16 x), got " + packed.describe());
  }
  if (!detail::amx_usable()) {
    throw InvalidArgument(
        std::string(op) + ": a split-bfloat16 weight needs a CPU with AMX " +
        "(amx-bf16) that the OS lets this process use; see split_gemm_supported()");
  }
  return static_cast<const uint16_t*>(packed.data);
}

// A bfloat16-panel weight (pack_bf16_weight) of k x n (`pairs`: gate/up pairs of n
// columns each), checked: what a bfloat16 x (or out, for packed_columns) takes.
const uint16_t* bf16_panels(const char* op, const TensorView& packed, int64_t k, int64_t n,
                            bool pairs) {
  detail::check_cpu(packed, op, "packed");
  const int64_t size = (pairs ? 2 : 1) * packed_bf16_weight_size(k, n);
  if (packed.dtype != DType::kBFloat16 || packed.ndim != 1 || packed.strides[0] != 1 ||
      packed.shape[0] != size) {
    throw InvalidArgument(std::string(op) + ": with bfloat16 x, packed must be bfloat16 [" +
                          std::to_string(size) + "] panels of a [" + std::to_string(k) + ", " +
                          std::to_string(pairs ? 2 * n : n) + "] weight (pack_bf16_weight; " +
                          "a split weight, pack_split_weight, takes float32 x), got " +
                          packed.describe());
  }
  return static_cast<const uint16_t*>(packed.data);
}

// x [m, k] and out [m, n], bfloat16 rows, for bfloat16 panels.
void check_bf16_x_out(const char* op, const TensorView& out, const TensorView& x, int64_t n) {
  check_rows(x, op, "x", 2, DType::kBFloat16);
  check_rows(out, op, "out", 2, DType::kBFloat16);
  detail::check_writable(out, op, "out");
  if (out.shape[0] != x.shape[0] || out.shape[1] != n) {
    throw InvalidArgument(std::string(op) + ": out must be [" + std::to_string(x.shape[0]) + ", " +
                          std::to_string(n) + "], got " + out.describe());
  }
}

// x's bfloat16 rows as the tiles read them, in pairs: x itself where k is even, else a
// copy with a zero column past k (the panel's row past k is zero too). On the tile unit
// (amx), rows come 16 at a time: x itself where m is a multiple of 16, else a copy with
// zero rows past m.
struct Bf16Rows {
  const uint16_t* a;
  int64_t lda;
  int64_t m;
  int64_t k;  // even
  bool amx;
};

// From this many rows on, bfloat16 panels multiply on the tile unit where it takes k.
constexpr int64_t kBf16AmxMinRows = 8;

Bf16Rows bf16_rows(const TensorView& x) {
  const auto* a = static_cast<const uint16_t*>(x.data);
  const int64_t m = x.shape[0], k = x.shape[1];
  const bool amx = m >= kBf16AmxMinRows && detail::bf16_amx_takes(k);
  const int64_t m_pad =
      amx ? (m + detail::kBf16AmxRows - 1) / detail::kBf16AmxRows * detail::kBf16AmxRows : m;
  if (k % 2 == 0 && m_pad == m) return {a, x.strides[0], m, k, amx};
  const int64_t lda = k + k % 2;
  thread_local std::vector<uint16_t> padded;
  padded.assign(static_cast<size_t>(m_pad * lda), uint16_t{0});
  for (int64_t r = 0; r < m; ++r) {
    std::memcpy(padded.data() + r * lda, a + r * x.strides[0],
                static_cast<size_t>(k) * sizeof(uint16_t));
  }
  return {padded.data(), lda, m, lda, amx};
}

// Elements of x in a block of rows: more on the tile unit (kBf16AmxBlockElements).
int64_t bf16_block_elements(const Bf16Rows& x) {
  return x.amx ? std::max(kBf16AmxBlockElements, kBf16AmxMinBlockRows * x.k) : kBlockFloats;
}

// Rows [m0, m1) of x times a bfloat16 panel, as multiply_panel's: on the tile unit (whose
// tiles for_blocks_and_units configured) the whole block at once, chunk by chunk of k,
// then sunk 16 rows at a time; else 8 rows at a time.
template <class Sink>
void multiply_bf16_panel(const Bf16Rows& x, const uint16_t* panel, int64_t m0, int64_t m1,
                         float* sums, Sink&& sink) {
  if (x.amx) {  // (x's rows padded to a multiple of 16: bf16_rows)
    constexpr int64_t kTile = detail::kBf16AmxRows;
    detail::multiply_bf16_block_amx(x.a + m0 * x.lda, x.lda, (m1 - m0 + kTile - 1) / kTile * kTile,
                                    panel, x.k, sums);
    for (int64_t r0 = m0; r0 < m1; r0 += kTile) {
      sink(r0, std::min(kTile, m1 - r0), static_cast<const float*>(sums + (r0 - m0) * kPanelWidth));
    }
    return;
  }
  for (int64_t r0 = m0; r0 < m1; r0 += detail::kBf16TileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(detail::kBf16TileRows, m1 - r0));
    detail::multiply_bf16_rows(x.a + r0 * x.lda, x.lda, rows, panel, x.k, sums);
    sink(r0, rows, static_cast<const float*>(sums));
  }
}

void dense_bf16(const TensorView& out, const TensorView& x, const uint16_t* panels,
                const TensorView& bias, int64_t n) {
  check_bf16_x_out("dense", out, x, n);
  const uint16_t* b = nullptr;
  if (bias.data != nullptr) {
    check_rows(bias, "dense", "bias", 1, DType::kBFloat16);
    if (bias.shape[0] != n) {
      throw InvalidArgument("dense: bias must be bfloat16 [" + std::to_string(n) + "], got " +
                            bias.describe());
    }
    b = static_cast<const uint16_t*>(bias.data);
  }
  const Bf16Rows rows = bf16_rows(x);
  const int64_t panel_size = detail::bf16_panel_size(rows.k);
  auto* c = static_cast<uint16_t*>(out.data);
  const int64_t ldc = out.strides[0];
  for_blocks_and_units(rows.m, rows.k, n_panels(n), kPanelWidth, rows.amx,
                       [&](int64_t m0, int64_t m1, int64_t p, float* scratch) {
                         const int64_t first = p * kPanelWidth;
                         const int64_t width = std::min(kPanelWidth, n - first);
                         multiply_bf16_panel(rows, panels + p * panel_size, m0, m1, scratch,
                                             [&](int64_t r0, int64_t tile_rows, const float* tile) {
                                               for (int64_t r = 0; r < tile_rows; ++r) {
                                                 detail::store_bf16_row(
                                                     tile + r * kPanelWidth,
                                                     b != nullptr ? b + first : nullptr,
                                                     c + (r0 + r) * ldc + first, width);
                                               }
                                             });
                       },
                       bf16_block_elements(rows));
}

void dense_bf16_silu_and_mul(const TensorView& out, const TensorView& x, const uint16_t* panels,
                             int64_t n) {
  check_bf16_x_out("dense_silu_and_mul", out, x, n);
  const Bf16Rows rows = bf16_rows(x);
  const int64_t panel_size = detail::bf16_panel_size(rows.k);
  auto* c = static_cast<uint16_t*>(out.data);
  const int64_t ldc = out.strides[0];
  for_blocks_and_units(
      rows.m, rows.k, n_panels(n), 2 * kPanelWidth, rows.amx,
      [&](int64_t m0, int64_t m1, int64_t p, float* scratch) {
        float* gates = scratch + tile_scratch_floats(m1 - m0);  // [m1 - m0, kPanelWidth]
        multiply_bf16_panel(rows, panels + 2 * p * panel_size, m0, m1, scratch,
                            [&](int64_t r0, int64_t tile_rows, const float* tile) {
                              std::memcpy(
                                  gates + (r0 - m0) * kPanelWidth, tile,
                                  static_cast<size_t>(tile_rows * kPanelWidth) * sizeof(float));
                            });
        const int64_t first = p * kPanelWidth, width = std::min(kPanelWidth, n - first);
        multiply_bf16_panel(rows, panels + (2 * p + 1) * panel_size, m0, m1, scratch,
                            [&](int64_t r0, int64_t tile_rows, const float* tile) {
                              detail::store_bf16_silu_and_mul_rows(
                                  gates + (r0 - m0) * kPanelWidth, tile, tile_rows,
                                  c + r0 * ldc + first, ldc, width);
                            });
      },
      bf16_block_elements(rows));
}

// out [t, k] = columns ids of the bfloat16 panels, exactly (out and ids checked).
void bf16_columns(const TensorView& out, const uint16_t* panels, const TensorView& ids) {
  const int64_t k = out.shape[1], panel_size = detail::bf16_panel_size(k);
  auto* dst = static_cast<uint16_t*>(out.data);
  for (int64_t r = 0; r < out.shape[0]; ++r) {
    const int64_t v = detail::index_at(ids, r), column = v % kPanelWidth;
    const uint16_t* panel = panels + v / kPanelWidth * panel_size;
    uint16_t* row = dst + r * out.strides[0];
    for (int64_t i = 0; i < k; ++i) row[i] = panel[(i / 2 * kPanelWidth + column) * 2 + i % 2];
  }
}

}  // namespace

bool split_gemm_supported() { return detail::amx_usable(); }

int64_t packed_split_weight_size(int64_t k, int64_t n, bool gate_up) {
  if (k < 0 || n < 0) {
    throw InvalidArgument("packed_split_weight_size: k and n must be >= 0, got " +
                          std::to_string(k) + " and " + std::to_string(n));
  }
  return detail::split_units(n, gate_up) * detail::split_unit_size(k);
}

void pack_split_weight(const TensorView& packed, const TensorView& w_t, bool gate_up) {
  constexpr const char* op = "pack_split_weight";
  check_rows(w_t, op, "w_t", 2, DType::kFloat32);
  if (gate_up && w_t.shape[1] % 2 != 0) {
    throw InvalidArgument(std::string(op) + ": w_t must be [k, 2n] (gate columns, then up), got " +
                          w_t.describe());
  }
  const int64_t k = w_t.shape[0], n = gate_up ? w_t.shape[1] / 2 : w_t.shape[1];
  check_pack_args(op, packed, w_t, packed_split_weight_size(k, n, gate_up), DType::kBFloat16);
  detail::pack_split_bf16(static_cast<uint16_t*>(packed.data), static_cast<const float*>(w_t.data),
                          w_t.strides[0], k, n, gate_up);
}

int64_t packed_bf16_weight_size(int64_t k, int64_t n) {
  if (k < 0 || n < 0) {
    throw InvalidArgument("packed_bf16_weight_size: k and n must be >= 0, got " +
                          std::to_string(k) + " and " + std::to_string(n));
  }
  return n_panels(n) * detail::bf16_panel_size(k);
}

void pack_bf16_weight(const TensorView& packed, const TensorView& w_t, bool gate_up) {
  constexpr const char* op = "pack_bf16_weight";
  check_rows(w_t, op, "w_t", 2, DType::kFloat32);
  if (gate_up && w_t.shape[1] % 2 != 0) {
    throw InvalidArgument(std::string(op) + ": w_t must be [k, 2n] (gate columns, then up), got " +
                          w_t.describe());
  }
  const int64_t k = w_t.shape[0], n = gate_up ? w_t.shape[1] / 2 : w_t.shape[1];
  check_pack_args(op, packed, w_t, (gate_up ? 2 : 1) * packed_bf16_weight_size(k, n),
                  DType::kBFloat16);
  auto* dst = static_cast<uint16_t*>(packed.data);
  const int64_t panel_size = detail::bf16_panel_size(k);
  detail::for_each_packed_panel(n, gate_up, [&](int64_t slot, int64_t first, int64_t width) {
    detail::pack_bf16_panel(dst + slot * panel_size, static_cast<const float*>(w_t.data),
                            w_t.strides[0], k, first, width);
  });
}

int64_t packed_weight_size(int64_t k, int64_t n) { return n_panels(n) * kPanelWidth * k; }

void pack_weight(const TensorView& packed, const TensorView& w_t) {
  check_pack_args("pack_weight", packed, w_t, packed_weight_size(w_t.shape[0], w_t.shape[1]));
  const int64_t k = w_t.shape[0], n = w_t.shape[1];
  auto* dst = static_cast<float*>(packed.data);
  detail::for_each_packed_panel(n, false, [&](int64_t slot, int64_t first, int64_t width) {
    pack_panel(dst + slot * k * kPanelWidth, w_t, first, width);
  });
}

void pack_gate_up_weight(const TensorView& packed, const TensorView& w_t) {
  constexpr const char* op = "pack_gate_up_weight";
  check_rows(w_t, op, "w_t", 2, DType::kFloat32);
  if (w_t.shape[1] % 2 != 0) {
    throw InvalidArgument(std::string(op) + ": w_t must be [k, 2n] (gate columns, then up), got " +
                          w_t.describe());
  }
  const int64_t k = w_t.shape[0], n = w_t.shape[1] / 2;
  check_pack_args(op, packed, w_t, 2 * packed_weight_size(k, n));
  auto* dst = static_cast<float*>(packed.data);
  detail::for_each_packed_panel(n, true, [&](int64_t slot, int64_t first, int64_t width) {
    pack_panel(dst + slot * k * kPanelWidth, w_t, first, width);
  });
}

void dense(const TensorView& out, const TensorView& x, const TensorView& packed,
           const TensorView& bias, int64_t n, bool int8_activations) {
  constexpr const char* op = "dense";
  if (x.ndim == 2 && x.dtype == DType::kBFloat16) {
    return dense_bf16(out, x, bf16_panels(op, packed, x.shape[1], n, false), bias, n);
  }
  check_x_out(op, out, x, n);
  const int64_t k = x.shape[1];
  const bool split = packed.dtype == DType::kBFloat16;
  const Panels panels = split ? Panels{} : check_packed(op, packed, k, n, false, "pack_weight");
  const bool has_bias = bias.data != nullptr;
  if (has_bias) detail::check_vector(bias, op, "bias", n);
  const auto* b = static_cast<const float*>(bias.data);
  auto* c = static_cast<float*>(out.data);
  const int64_t ldc = out.strides[0];
  if (split) {
    detail::split_bf16_gemm(c, ldc, static_cast<const float*>(x.data), x.strides[0], x.shape[0], k,
                            check_split(op, packed, k, n, false), n, b);
    return;
  }
  const Rows8 rows8 = multiplied_rows(x, panels, int8_activations);
  for_blocks_and_units(rows8.m, rows8.k, n_panels(n), kPanelWidth, false,
                       [&](int64_t m0, int64_t m1, int64_t p, float* scratch) {
                         const int64_t first = p * kPanelWidth;
                         const int64_t width = std::min(kPanelWidth, n - first);
                         multiply_panel(rows8, panels, p, m0, m1, scratch,
                                        [&](int64_t r0, int64_t rows, const float* tile) {
                                          for (int64_t r = 0; r < rows; ++r) {
                                            float* dst = c + (r0 + r) * ldc + first;
                                            const float* src = tile + r * kPanelWidth;
                                            for (int64_t j = 0; j < width; ++j) {
                                              dst[j] = has_bias ? src[j] + b[first + j] : src[j];
                                            }
                                          }
                                        });
                       });
}

void dense_silu_and_mul(const TensorView& out, const TensorView& x, const TensorView& packed,
                        int64_t n, bool int8_activations) {
  constexpr const char* op = "dense_silu_and_mul";
  if (x.ndim == 2 && x.dtype == DType::kBFloat16) {
    return dense_bf16_silu_and_mul(out, x, bf16_panels(op, packed, x.shape[1], n, true), n);
  }
  check_x_out(op, out, x, n);
  const int64_t k = x.shape[1];
  auto* c = static_cast<float*>(out.data);
  const int64_t ldc = out.strides[0];
  if (packed.dtype == DType::kBFloat16) {
    detail::split_bf16_gemm_silu_and_mul(c, ldc, static_cast<const float*>(x.data), x.strides[0],
                                         x.shape[0], k, check_split(op, packed, k, n, true), n);
    return;
  }
  const Panels panels = check_packed(op, packed, k, n, true, "pack_gate_up_weight");
  const Rows8 rows8 = multiplied_rows(x, panels, int8_activations);
  // A pair's gate panel first, its tiles kept in scratch, then its up panel, so that the
  // weights stream in memory order, as in dense.
  for_blocks_and_units(
      rows8.m, rows8.k, n_panels(n), 2 * kPanelWidth, false,
      [&](int64_t m0, int64_t m1, int64_t p, float* scratch) {
        float* gates = scratch + tile_scratch_floats(m1 - m0);  // [m1 - m0, kPanelWidth]
        multiply_panel(rows8, panels, 2 * p, m0, m1, scratch,
                       [&](int64_t r0, int64_t rows, const float* tile) {
                         std::memcpy(gates + (r0 - m0) * kPanelWidth, tile,
                                     static_cast<size_t>(rows * kPanelWidth) * sizeof(float));
                       });
        const int64_t first = p * kPanelWidth, width = std::min(kPanelWidth, n - first);
        multiply_panel(rows8, panels, 2 * p + 1, m0, m1, scratch,
                       [&](int64_t r0, int64_t rows, const float* tile) {
                         for (int64_t r = 0; r < rows; ++r) {
                           detail::silu_and_mul_row(gates + (r0 - m0 + r) * kPanelWidth,
                                                    tile + r * kPanelWidth,
                                                    c + (r0 + r) * ldc + first, width);
                         }
                       });
      });
}

void release_thread_pool() {
#ifdef _OPENMP                             // (in GCC from 9, though its _OPENMP still says 4.5)
  omp_pause_resource_all(omp_pause_hard);  // the host's part: this thread's pool
#endif
}

void packed_columns(const TensorView& out, const TensorView& packed, const TensorView& ids,
                    int64_t n) {
  constexpr const char* op = "packed_columns";
  const bool bf16_out = out.ndim == 2 && out.dtype == DType::kBFloat16;
  const uint16_t* bf16 = bf16_out ? bf16_panels(op, packed, out.shape[1], n, false) : nullptr;
  check_rows(out, op, "out", 2, bf16_out ? DType::kBFloat16 : DType::kFloat32);
  detail::check_writable(out, op, "out");
  detail::check_cpu(ids, op, "ids");
  const int64_t t = out.shape[0], k = out.shape[1];
  if ((ids.dtype != DType::kInt32 && ids.dtype != DType::kInt64) || ids.ndim != 1 ||
      ids.shape[0] != t) {
    throw InvalidArgument(arg(op, "ids") + " must be int32 or int64 [" + std::to_string(t) +
                          "] (a row of out each), got " + ids.describe());
  }
  detail::check_indices(ids, n, op, "ids");
  if (bf16 != nullptr) return bf16_columns(out, bf16, ids);
  const Panels panels = check_packed(op, packed, k, n, false, "pack_weight");
  auto* dst = static_cast<float*>(out.data);
  for (int64_t r = 0; r < t; ++r) {
    const int64_t v = detail::index_at(ids, r), column = v % kPanelWidth;
    const uint8_t* panel = panels.panel(v / kPanelWidth);
    float* row = dst + r * out.strides[0];
    if (panels.form.code == detail::QuantCode::kNone) {
      const auto* w = reinterpret_cast<const float*>(panel);
      for (int64_t i = 0; i < k; ++i) row[i] = w[i * kPanelWidth + column];
      continue;
    }
    const detail::QuantForm form = panels.form;
    const int64_t block_bytes = detail::quantized_block_bytes(form);
    for (int64_t b = 0; b < k / kQuantBlock; ++b) {
      const uint8_t* block = panel + b * block_bytes;
      const uint8_t* ints = block + detail::quantized_param_bytes(form);
      for (int64_t i = 0; i < kQuantBlock; ++i) {
        const float q = detail::quantized_value(ints, i, column, form.code);
        // q * scale is exact, or the offset zero (pack_quantized_weight checks), so this
        // rounds as the widening's multiply-add.
        row[b * kQuantBlock + i] = q * detail::quantized_scale(block, i, column, form) +
                                   detail::quantized_offset(block, i, column, form);
      }
    }
  }
}

}  // namespace pyengine
