// Small-m GEMM over panel-packed weights (see pyengine/small_gemm.h). One micro-kernel:
// 8 rows x 48 columns (24 accumulators of 16 floats, as GCC vector extensions, which the
// AVX2 and generic clones split into narrower registers), over the whole k; threads take
// panels.
#include "pyengine/small_gemm.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "attention_checks.h"
#include "vector_clones.h"

namespace pyengine {
namespace {

using detail::arg;
using detail::check_rows;

constexpr int kRows = 8;
constexpr int kLanes = 16;
constexpr int kVectors = kPanelWidth / kLanes;
constexpr int64_t kPrefetchRows = 24;
constexpr int64_t kBlockFloats = 96 * 1024;  // rows of x per block: 384 KiB of them
using Vec = float __attribute__((vector_size(kLanes * sizeof(float))));
using UnalignedVec =
    float __attribute__((vector_size(kLanes * sizeof(float)), aligned(4), may_alias));

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

// c[r][0, 48) = sum over i < k of a[r][i] * panel[i][0, 48), for 8 rows of a (lda apart),
// while asking for kPerStep lines of `fetch` per k step (fetch_plan). (Into L2: each
// weight byte is used once per step, by the few tiles of one block; L1 holds their
// working set.)
template <int kPerStep>
PYENGINE_VECTOR_CLONES void tile(const float* a, int64_t lda, const float* panel, int64_t k,
                                 float* c, const float* fetch) {
  Vec acc[kRows][kVectors] = {};
  for (int64_t i = 0; i < k; ++i) {
    for (int j = 0; j < kPerStep; ++j) __builtin_prefetch(fetch + (i * kPerStep + j) * 16, 0, 1);
    const auto* row = reinterpret_cast<const UnalignedVec*>(panel + i * kPanelWidth);
    const Vec b0 = row[0], b1 = row[1], b2 = row[2];
    for (int r = 0; r < kRows; ++r) {
      const float x = a[r * lda + i];
      acc[r][0] += x * b0;
      acc[r][1] += x * b1;
      acc[r][2] += x * b2;
    }
  }
  for (int r = 0; r < kRows; ++r) {
    for (int v = 0; v < kVectors; ++v) {
      reinterpret_cast<UnalignedVec*>(c + r * kPanelWidth)[v] = acc[r][v];
    }
  }
}

void run_tile(const float* a, int64_t lda, const float* panel, int64_t k, float* c,
              const Fetch& fetch) {
  switch (fetch.per_step) {
    case 0: return tile<0>(a, lda, panel, k, c, fetch.start);
    case 1: return tile<1>(a, lda, panel, k, c, fetch.start);
    case 2: return tile<2>(a, lda, panel, k, c, fetch.start);
    default: return tile<3>(a, lda, panel, k, c, fetch.start);
  }
}

// The same for one row (a single request's decode): six chains hide the multiply-add
// latency, and no compute goes to padding rows.
PYENGINE_VECTOR_CLONES
void row_tile(const float* a, const float* panel, int64_t k, float* c) {
  Vec even[kVectors] = {}, odd[kVectors] = {};
  int64_t i = 0;
  for (; i + 1 < k; i += 2) {
    const auto* row = reinterpret_cast<const UnalignedVec*>(panel + i * kPanelWidth);
    const float x0 = a[i], x1 = a[i + 1];
    for (int v = 0; v < kVectors; ++v) {
      even[v] += x0 * row[v];
      odd[v] += x1 * row[kVectors + v];
    }
  }
  if (i < k) {
    const auto* row = reinterpret_cast<const UnalignedVec*>(panel + i * kPanelWidth);
    for (int v = 0; v < kVectors; ++v) even[v] += a[i] * row[v];
  }
  for (int v = 0; v < kVectors; ++v) {
    reinterpret_cast<UnalignedVec*>(c)[v] = even[v] + odd[v];
  }
}

}  // namespace

int64_t packed_weight_size(int64_t k, int64_t n) {
  return (n + kPanelWidth - 1) / kPanelWidth * kPanelWidth * k;
}

void pack_weight(const TensorView& packed, const TensorView& w_t) {
  check_rows(w_t, "pack_weight", "w_t", 2, DType::kFloat32);
  const int64_t k = w_t.shape[0], n = w_t.shape[1];
  detail::check_cpu(packed, "pack_weight", "packed");
  detail::check_dtype(packed, DType::kFloat32, "pack_weight", "packed");
  if (packed.ndim != 1 || packed.shape[0] != packed_weight_size(k, n) || packed.strides[0] != 1) {
    throw InvalidArgument("pack_weight: packed must be dense float32 [" +
                          std::to_string(packed_weight_size(k, n)) + "], got " + packed.describe());
  }
  const auto* src = static_cast<const float*>(w_t.data);
  auto* dst = static_cast<float*>(packed.data);
  for (int64_t p = 0; p * kPanelWidth < n; ++p) {
    const int64_t first = p * kPanelWidth, width = std::min(kPanelWidth, n - first);
    for (int64_t i = 0; i < k; ++i) {
      float* out = dst + (p * k + i) * kPanelWidth;
      std::memcpy(out, src + i * w_t.strides[0] + first,
                  static_cast<size_t>(width) * sizeof(float));
      std::fill(out + width, out + kPanelWidth, 0.0f);
    }
  }
}

void small_gemm(const TensorView& out, const TensorView& x, const TensorView& packed,
                const TensorView& bias, int64_t n) {
  constexpr const char* op = "small_gemm";
  check_rows(x, op, "x", 2, DType::kFloat32);
  check_rows(out, op, "out", 2, DType::kFloat32);
  const int64_t m = x.shape[0], k = x.shape[1];
  if (out.shape[0] != m || out.shape[1] != n) {
    throw InvalidArgument(std::string(op) + ": out must be [" + std::to_string(m) + ", " +
                          std::to_string(n) + "], got " + out.describe());
  }
  if (packed.ndim != 1 || packed.dtype != DType::kFloat32 || packed.strides[0] != 1 ||
      packed.shape[0] != packed_weight_size(k, n)) {
    throw InvalidArgument(std::string(op) + ": packed must be a packed [" + std::to_string(k) +
                          ", " + std::to_string(n) + "] float32 weight (pack_weight), got " +
                          packed.describe());
  }
  const bool has_bias = bias.data != nullptr;
  if (has_bias && (bias.ndim != 1 || bias.shape[0] != n || bias.dtype != DType::kFloat32 ||
                   bias.strides[0] != 1)) {
    throw InvalidArgument(arg(op, "bias") + " must be dense float32 [" + std::to_string(n) +
                          "], got " + bias.describe());
  }
  const auto* a = static_cast<const float*>(x.data);
  const auto* panels = static_cast<const float*>(packed.data);
  const auto* b = static_cast<const float*>(bias.data);
  auto* c = static_cast<float*>(out.data);
  const int64_t lda = x.strides[0], ldc = out.strides[0];
  const int64_t num_panels = (n + kPanelWidth - 1) / kPanelWidth;
  // A last tile of 2-7 rows runs as a full one: its rows, then zeros, copied once here.
  const int64_t tail_first = m / kRows * kRows;
  thread_local std::vector<float> tail;
  if (const int64_t rows = m - tail_first; rows > 1) {
    tail.assign(static_cast<size_t>(kRows * k), 0.0f);
    for (int64_t r = 0; r < rows; ++r) {
      std::memcpy(tail.data() + r * k, a + (tail_first + r) * lda,
                  static_cast<size_t>(k) * sizeof(float));
    }
  }
  const float* padded_tail = tail.data();
  // Many rows (a prefill) go in blocks whose rows of x stay in L2 while every panel
  // passes over them; a decode step's few rows are one block.
  const int64_t block_rows = std::max<int64_t>(kRows, kBlockFloats / k / kRows * kRows);
  // One parallel region, no barrier between blocks: with the same static split every
  // block, a thread moves on to its panels of the next block as soon as it is done.
#pragma omp parallel if (num_panels > 1 && std::min(m, block_rows) * k * n >= (1 << 16))
  for (int64_t m0 = 0; m0 < m; m0 += block_rows) {
    const int64_t m1 = std::min(m, m0 + block_rows);
#pragma omp for schedule(static) nowait
    for (int64_t p = 0; p < num_panels; ++p) {
      thread_local std::vector<float> tile_out;
      tile_out.resize(kRows * kPanelWidth);
      const float* panel = panels + p * k * kPanelWidth;
      const int64_t first = p * kPanelWidth, width = std::min(kPanelWidth, n - first);
      for (int64_t r0 = m0; r0 < m1; r0 += kRows) {
        const int64_t rows = std::min<int64_t>(kRows, m1 - r0);
        const bool padded = rows > 1 && rows < kRows;
        const float* tile_a = padded ? padded_tail : a + r0 * lda;
        const int64_t tile_lda = padded ? k : lda;
        if (rows == 1) {
          row_tile(tile_a, panel, k, tile_out.data());
        } else {
          // (A prefetch past the last panel is harmless: prefetches never fault.)
          const int64_t index = (r0 - m0) / kRows;
          run_tile(tile_a, tile_lda, panel, k, tile_out.data(),
                   fetch_plan(index, (m1 - m0 + kRows - 1) / kRows, panel, k));
        }
        for (int64_t r = 0; r < rows; ++r) {
          float* dst = c + (r0 + r) * ldc + first;
          const float* src = tile_out.data() + r * kPanelWidth;
          for (int64_t j = 0; j < width; ++j) dst[j] = has_bias ? src[j] + b[first + j] : src[j];
        }
      }
    }
  }
}

}  // namespace pyengine
