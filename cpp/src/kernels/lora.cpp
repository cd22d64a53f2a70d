// Batched LoRA on the CPU (see pyengine/lora.h). The rows with an adapter are ordered by
// slot and taken kTileRows at a time within a slot: a shrink reads each A row once for
// the tile's rows, an expand each B row once; OpenMP over the tiles.
#include "pyengine/lora.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <numeric>
#include <string>
#include <vector>

#include "float_convert.h"
#include "tensor_checks.h"
#include "vector_clones.h"
#ifdef PYENGINE_WITH_CUDA
#include "cuda/lora_launch.h"
#endif

namespace pyengine {
namespace {

using detail::arg;

constexpr int kTileRows = 4;

template <DType kDType>
inline float element(const void* base, int64_t i) {
  return detail::load<kDType>(base, i);
}

constexpr int kRankBlock = 4;  // the most ranks a shrink step takes together

// kL floats as one GCC vector, its lanes independent partial sums: 16 (a zmm) where the
// CPU has AVX-512, else 8 (a ymm; GCC lowers a vector wider than a clone's registers
// through the stack, element by element). Each loop is built for both.
template <int kL>
struct Lanes;
template <>
struct Lanes<16> {
  using Vec = float __attribute__((vector_size(64)));
  using Halves = uint16_t __attribute__((vector_size(32)));
  using Words = uint32_t __attribute__((vector_size(64)));
  static constexpr int kRanks = 4;  // ranks a shrink step takes: 16 sums of 4 x 4
};
template <>
struct Lanes<8> {
  using Vec = float __attribute__((vector_size(32)));
  using Halves = uint16_t __attribute__((vector_size(16)));
  using Words = uint32_t __attribute__((vector_size(32)));
  static constexpr int kRanks = 2;  // 8 sums, beside 4 x vectors, in AVX2's 16 registers
};

// (v by reference: a returned vector wider than the default clone's registers would
// change the ABI)
template <DType kDType, int kL, class Vec = typename Lanes<kL>::Vec>
[[gnu::always_inline]] inline void load_vec(Vec& v, const void* base, int64_t i) {
  if constexpr (kDType == DType::kFloat32) {
    std::memcpy(&v, static_cast<const float*>(base) + i, sizeof v);
  } else {  // bfloat16: the float's upper half
    typename Lanes<kL>::Halves h;
    std::memcpy(&h, static_cast<const uint16_t*>(base) + i, sizeof h);
    const auto w = __builtin_convertvector(h, typename Lanes<kL>::Words) << 16;
    std::memcpy(&v, &w, sizeof v);
  }
}

// shrunk[r][j] = x_j . a_r over k for ranks [r0, r0 + kR) and the tile's rows: each
// step of kL inputs loads kR A and kTileRows x vectors for their vector products
// (float32 sums, kL of them, added up at the end). Rows past the tile's are zeros.
template <DType kDType, int kL>
[[gnu::always_inline]] inline void shrink_block(const void* const* xs, const void* a, int64_t r0,
                                                int64_t k, float* shrunk) {
  using Vec = typename Lanes<kL>::Vec;
  constexpr int kR = Lanes<kL>::kRanks;
  Vec sums[kR][kTileRows] = {};
  int64_t i = 0;
  for (; i + kL <= k; i += kL) {
    Vec x[kTileRows];
    for (int j = 0; j < kTileRows; ++j) load_vec<kDType, kL>(x[j], xs[j], i);
    for (int r = 0; r < kR; ++r) {
      Vec w;
      load_vec<kDType, kL>(w, a, (r0 + r) * k + i);
      for (int j = 0; j < kTileRows; ++j) sums[r][j] += x[j] * w;
    }
  }
  for (int r = 0; r < kR; ++r) {
    for (int j = 0; j < kTileRows; ++j) {
      float sum = 0.0f;
      for (int l = 0; l < kL; ++l) sum += sums[r][j][l];
      for (int64_t t = i; t < k; ++t) {
        sum += element<kDType>(xs[j], t) * element<kDType>(a, (r0 + r) * k + t);
      }
      shrunk[(r0 + r) * kTileRows + j] = sum;
    }
  }
}

// out_j[c] += scale * sum over ranks [r0, r1) of shrunk[r][j] * b[r][c], for the columns
// [c0, c1) and the tile's `rows`: kL columns at a time, their sums in registers, each
// B vector loaded once for the tile's rows; each out rounded once.
template <DType kDType, int kL>
[[gnu::always_inline]] inline void expand(const float* shrunk, int rows, const void* b, int64_t n,
                                          int64_t r0, int64_t r1, int64_t c0, int64_t c1,
                                          float scale, void* const* outs) {
  using Vec = typename Lanes<kL>::Vec;
  int64_t c = c0;
  for (; c + kL <= c1; c += kL) {
    Vec sums[kTileRows] = {};
    for (int64_t r = r0; r < r1; ++r) {
      Vec w;
      load_vec<kDType, kL>(w, b, r * n + c);
      for (int j = 0; j < kTileRows; ++j) sums[j] += shrunk[r * kTileRows + j] * w;
    }
    for (int j = 0; j < rows; ++j) {
      if constexpr (kDType == DType::kFloat32) {
        Vec out;
        load_vec<kDType, kL>(out, outs[j], c);
        out += sums[j] * scale;
        std::memcpy(static_cast<float*>(outs[j]) + c, &out, sizeof out);
      } else {
        for (int l = 0; l < kL; ++l) {
          const float x = element<kDType>(outs[j], c + l);
          detail::store<kDType>(outs[j], c + l, x + sums[j][l] * scale);
        }
      }
    }
  }
  for (; c < c1; ++c) {  // the last columns, one at a time
    for (int j = 0; j < rows; ++j) {
      float sum = 0.0f;
      for (int64_t r = r0; r < r1; ++r)
        sum += shrunk[r * kTileRows + j] * element<kDType>(b, r * n + c);
      detail::store<kDType>(outs[j], c, element<kDType>(outs[j], c) + sum * scale);
    }
  }
}

// Each loop built per vector width (vector_clones.h), for each element type and lane
// count. The shrink takes the ranks [0, ranks) in whole blocks, and returns how many.
template <DType kDType, int kL>
PYENGINE_VECTOR_CLONES int64_t shrink_loop(const void* const* xs, const void* a, int64_t ranks,
                                           int64_t k, float* shrunk) {
  constexpr int kR = Lanes<kL>::kRanks;
  int64_t r = 0;
  for (; r + kR <= ranks; r += kR) shrink_block<kDType, kL>(xs, a, r, k, shrunk);
  return r;
}
template <DType kDType, int kL>
PYENGINE_VECTOR_CLONES void expand_loop(const float* shrunk, int rows, const void* b, int64_t n,
                                        int64_t r0, int64_t r1, int64_t c0, int64_t c1, float scale,
                                        void* const* outs) {
  expand<kDType, kL>(shrunk, rows, b, n, r0, r1, c0, c1, scale, outs);
}

template <DType kDType>
struct Loops {
  static int64_t shrink(const void* const* xs, const void* a, int64_t ranks, int64_t k,
                        float* shrunk) {
    return detail::wide_vectors() ? shrink_loop<kDType, 16>(xs, a, ranks, k, shrunk)
                                  : shrink_loop<kDType, 8>(xs, a, ranks, k, shrunk);
  }
  static void expand(const float* shrunk, int rows, const void* b, int64_t n, int64_t r0,
                     int64_t r1, int64_t c0, int64_t c1, float scale, void* const* outs) {
    if (detail::wide_vectors())
      return expand_loop<kDType, 16>(shrunk, rows, b, n, r0, r1, c0, c1, scale, outs);
    expand_loop<kDType, 8>(shrunk, rows, b, n, r0, r1, c0, c1, scale, outs);
  }
};

// The token rows of each slot in `slots` (int32 [tokens], -1: none) in tiles of at most
// kTileRows rows of one slot: the rows ordered by slot, token order within one.
struct SlotTiles {
  std::vector<int32_t> rows;
  std::vector<std::pair<int64_t, int>> tiles;  // (first of rows, count)

  SlotTiles(const int32_t* s, int64_t tokens) {
    for (int32_t t = 0; t < static_cast<int32_t>(tokens); ++t) {
      if (s[t] >= 0) rows.push_back(t);
    }
    std::stable_sort(rows.begin(), rows.end(), [s](int32_t u, int32_t v) { return s[u] < s[v]; });
    for (size_t i = 0; i < rows.size();) {
      size_t end = i + 1;
      while (end < rows.size() && end - i < kTileRows && s[rows[end]] == s[rows[i]]) ++end;
      tiles.emplace_back(static_cast<int64_t>(i), static_cast<int>(end - i));
      i = end;
    }
  }

  // run(tile's rows, count, shrunk) for each tile, over OpenMP's threads where the
  // tiles' `work_per_tile` (multiply-adds) is worth it; shrunk: the thread's scratch.
  template <typename Run>
  void for_each(int64_t work_per_tile, const Run& run) const {
    const auto num_tiles = static_cast<int64_t>(tiles.size());
#pragma omp parallel if (num_tiles > 1 && num_tiles * work_per_tile >= (1 << 16))
    {
      thread_local std::vector<float> shrunk;
#pragma omp for schedule(dynamic)
      for (int64_t i = 0; i < num_tiles; ++i) {
        const auto [first, count] = tiles[static_cast<size_t>(i)];
        run(rows.data() + first, count, shrunk);
      }
    }
  }
};

// Each row's out, or nullptr past the tile's rows.
template <DType kDType>
void tile_outs(char* out, int64_t stride, const int32_t* rows, int count, void** outs) {
  constexpr int64_t kSize = kDType == DType::kFloat32 ? 4 : 2;
  for (int j = 0; j < kTileRows; ++j)
    outs[j] = j < count ? out + rows[j] * stride * kSize : nullptr;
}

// slots int32 [tokens] on the CPU, each in [-1, num_slots).
void check_slot_values(const TensorView& slots, int64_t num_slots, const char* op) {
  const auto* s = static_cast<const int32_t*>(slots.data);
  for (int64_t t = 0; t < slots.shape[0]; ++t) {
    if (s[t] < -1 || s[t] >= num_slots) {
      throw InvalidArgument(std::string(op) + ": slots[" + std::to_string(t) + "] is " +
                            std::to_string(s[t]) + ", outside [-1, " + std::to_string(num_slots) +
                            ")");
    }
  }
}

struct Args {
  char* out;
  const char* x;
  const char* a;
  const char* b;
  int64_t out_stride, x_stride;  // elements
  int64_t n, k, ranks, num_parts;
  const float* scale;
  const int64_t* part_columns;
};

template <DType kDType>
void run_tile(const Args& p, const int32_t* rows, int count, int32_t slot,
              std::vector<float>& shrunk, std::vector<char>& zeros) {
  constexpr int64_t kSize = kDType == DType::kFloat32 ? 4 : 2;
  if (count < kTileRows) zeros.assign(static_cast<size_t>(p.k * kSize), 0);  // absent rows' x
  const void* xs[kTileRows];
  for (int j = 0; j < kTileRows; ++j)
    xs[j] = j < count ? p.x + rows[j] * p.x_stride * kSize : zeros.data();
  void* outs[kTileRows];
  tile_outs<kDType>(p.out, p.out_stride, rows, count, outs);
  shrunk.assign(static_cast<size_t>((p.ranks + kRankBlock) * kTileRows), 0.0f);
  const char* a = p.a + slot * p.ranks * p.k * kSize;
  const char* b = p.b + slot * p.ranks * p.n * kSize;
  // (ranks past the last whole block: a block reading past them would leave A)
  int64_t r = Loops<kDType>::shrink(xs, a, p.ranks, p.k, shrunk.data());
  for (; r < p.ranks; ++r) {
    for (int j = 0; j < kTileRows; ++j) {
      float sum = 0.0f;
      for (int64_t i = 0; i < p.k; ++i) {
        sum += element<kDType>(xs[j], i) * element<kDType>(a, r * p.k + i);
      }
      shrunk[static_cast<size_t>(r * kTileRows + j)] = sum;
    }
  }
  const int64_t rank = p.ranks / p.num_parts;
  for (int64_t part = 0; part < p.num_parts; ++part) {
    Loops<kDType>::expand(shrunk.data(), count, b, p.n, part * rank, (part + 1) * rank,
                          p.part_columns[part], p.part_columns[part + 1], p.scale[slot], outs);
  }
}

void check(const TensorView& out, const TensorView& x, const TensorView& a, const TensorView& b,
           const TensorView& slots, const TensorView& scale, const TensorView& part_columns) {
  constexpr const char* op = "lora_add";
  const Device& device = out.device;
  const bool cuda = device.kind == DeviceKind::kCUDA;
  if (out.dtype != DType::kFloat32 && out.dtype != DType::kBFloat16 &&
      !(cuda && out.dtype == DType::kFloat16)) {
    throw InvalidArgument(arg(op, "out") + " must be float32 or bfloat16 (or, on CUDA, " +
                          "float16), got " + out.describe());
  }
  detail::check_rows_on(out, device, op, "out", 2, out.dtype);
  detail::check_writable(out, op, "out");
  detail::check_rows_on(x, device, op, "x", 2, out.dtype);
  for (const auto& [t, name] : {std::pair{&a, "a"}, std::pair{&b, "b"}}) {
    detail::check_device(*t, device, op, name);
    detail::check_shape(*t, op, name, 3);
    detail::check_dtype(*t, out.dtype, op, name);
    if (!t->is_contiguous()) throw InvalidArgument(arg(op, name) + " must be dense");
  }
  const int64_t tokens = out.shape[0], n = out.shape[1], k = x.shape[1];
  const int64_t num_slots = a.shape[0], ranks = a.shape[1];
  if (x.shape[0] != tokens) {
    throw InvalidArgument(std::string(op) + ": x " + x.describe() + " and out " + out.describe() +
                          " differ in tokens");
  }
  if (a.shape[2] != k) {
    throw InvalidArgument(arg(op, "a") + " must be [slots, ranks, " + std::to_string(k) +
                          "] (x's columns), got " + a.describe());
  }
  if (b.shape[0] != num_slots || b.shape[1] != ranks || b.shape[2] != n) {
    throw InvalidArgument(arg(op, "b") + " must be [" + std::to_string(num_slots) + ", " +
                          std::to_string(ranks) + ", " + std::to_string(n) + "] (a's slots and " +
                          "ranks, out's columns), got " + b.describe());
  }
  detail::check_rows_on(slots, device, op, "slots", 1, DType::kInt32);
  if (slots.shape[0] != tokens) {
    throw InvalidArgument(arg(op, "slots") + " must be int32 [" + std::to_string(tokens) +
                          "], got " + slots.describe());
  }
  detail::check_device(scale, device, op, "scale");
  if (scale.ndim != 1 || scale.shape[0] != num_slots || scale.dtype != DType::kFloat32 ||
      (num_slots > 1 && scale.strides[0] != 1)) {
    throw InvalidArgument(arg(op, "scale") + " must be dense float32 [" +
                          std::to_string(num_slots) + "], got " + scale.describe());
  }
  detail::check_rows(part_columns, op, "part_columns", 1, DType::kInt64);  // (on the CPU)
  const int64_t parts = part_columns.shape[0] - 1;
  const auto* columns = static_cast<const int64_t*>(part_columns.data);
  bool ascending = parts >= 1 && columns[0] == 0 && columns[parts] == n;
  for (int64_t p = 0; ascending && p < parts; ++p) ascending = columns[p] <= columns[p + 1];
  if (!ascending || ranks % parts != 0) {
    throw InvalidArgument(arg(op, "part_columns") + " must be int64 [num_parts + 1] from 0, " +
                          "ascending, to " + std::to_string(n) + ", num_parts dividing ranks (" +
                          std::to_string(ranks) + "), got " + part_columns.describe());
  }
#ifdef PYENGINE_WITH_CUDA
  if (cuda && (parts > cuda::kLoRAMaxParts || ranks > cuda::kLoRAMaxRanks)) {
    throw InvalidArgument(std::string(op) + " (CUDA): at most " +
                          std::to_string(cuda::kLoRAMaxParts) + " parts and " +
                          std::to_string(cuda::kLoRAMaxRanks) + " ranks, got " +
                          std::to_string(parts) + " and " + std::to_string(ranks));
  }
#endif
  if (cuda) return;  // (slots stay on the device: see cuda/lora_launch.h)
  check_slot_values(slots, num_slots, op);
}

struct EmbeddingArgs {
  char* out;
  const TensorView* ids;
  const char* a;
  const char* b;
  int64_t out_stride, n, vocab, ranks;
  const float* scale;
};

// The shrink of a one-hot row is a lookup: A's row of the token, for each of the tile's.
template <DType kDType>
void run_embedding_tile(const EmbeddingArgs& p, const int32_t* rows, int count, int32_t slot,
                        std::vector<float>& shrunk) {
  constexpr int64_t kSize = kDType == DType::kFloat32 ? 4 : 2;
  shrunk.assign(static_cast<size_t>(p.ranks * kTileRows), 0.0f);
  const char* a = p.a + slot * p.vocab * p.ranks * kSize;
  for (int j = 0; j < count; ++j) {
    const int64_t id = detail::index_at(*p.ids, rows[j]);
    for (int64_t r = 0; r < p.ranks; ++r) {
      shrunk[static_cast<size_t>(r * kTileRows + j)] = element<kDType>(a, id * p.ranks + r);
    }
  }
  void* outs[kTileRows];
  tile_outs<kDType>(p.out, p.out_stride, rows, count, outs);
  Loops<kDType>::expand(shrunk.data(), count, p.b + slot * p.ranks * p.n * kSize, p.n, 0, p.ranks,
                        0, p.n, p.scale[slot], outs);
}

void check_embedding(const TensorView& out, const TensorView& ids, const TensorView& a,
                     const TensorView& b, const TensorView& slots, const TensorView& scale) {
  constexpr const char* op = "lora_embedding_add";
  detail::check_cpu(out, op, "out");
  if (out.dtype != DType::kFloat32 && out.dtype != DType::kBFloat16) {
    throw InvalidArgument(arg(op, "out") + " must be float32 or bfloat16, got " + out.describe());
  }
  detail::check_rows(out, op, "out", 2, out.dtype);
  detail::check_writable(out, op, "out");
  for (const auto& [t, name] : {std::pair{&a, "a"}, std::pair{&b, "b"}}) {
    detail::check_cpu(*t, op, name);
    detail::check_shape(*t, op, name, 3);
    detail::check_dtype(*t, out.dtype, op, name);
    if (!t->is_contiguous()) throw InvalidArgument(arg(op, name) + " must be dense");
  }
  const int64_t tokens = out.shape[0], n = out.shape[1];
  const int64_t num_slots = a.shape[0], vocab = a.shape[1], ranks = a.shape[2];
  if (b.shape[0] != num_slots || b.shape[1] != ranks || b.shape[2] != n) {
    throw InvalidArgument(arg(op, "b") + " must be [" + std::to_string(num_slots) + ", " +
                          std::to_string(ranks) + ", " + std::to_string(n) + "] (a's slots and " +
                          "ranks, out's columns), got " + b.describe());
  }
  detail::check_cpu(ids, op, "ids");
  if ((ids.dtype != DType::kInt32 && ids.dtype != DType::kInt64) || ids.ndim != 1 ||
      ids.shape[0] != tokens) {
    throw InvalidArgument(arg(op, "ids") + " must be int32 or int64 [" + std::to_string(tokens) +
                          "], got " + ids.describe());
  }
  detail::check_indices(ids, vocab, op, "ids");
  detail::check_rows(slots, op, "slots", 1, DType::kInt32);
  if (slots.shape[0] != tokens) {
    throw InvalidArgument(arg(op, "slots") + " must be int32 [" + std::to_string(tokens) +
                          "], got " + slots.describe());
  }
  detail::check_vector(scale, op, "scale", num_slots);
  check_slot_values(slots, num_slots, op);
}

}  // namespace

void lora_add(const TensorView& out, const TensorView& x, const TensorView& a, const TensorView& b,
              const TensorView& slots, const TensorView& scale, const TensorView& part_columns,
              void* stream) {
  check(out, x, a, b, slots, scale, part_columns);
  if (detail::on_cuda(out.device, "lora_add")) {
#ifdef PYENGINE_WITH_CUDA
    return cuda::lora_add(out, x, a, b, slots, scale, part_columns, stream);
#endif
  }
  (void)stream;
  const auto* s = static_cast<const int32_t*>(slots.data);
  const SlotTiles tiles(s, out.shape[0]);
  const Args p{static_cast<char*>(out.data),
               static_cast<const char*>(x.data),
               static_cast<const char*>(a.data),
               static_cast<const char*>(b.data),
               out.strides[0],
               x.strides[0],
               out.shape[1],
               x.shape[1],
               a.shape[1],
               part_columns.shape[0] - 1,
               static_cast<const float*>(scale.data),
               static_cast<const int64_t*>(part_columns.data)};
  const bool bf16 = out.dtype == DType::kBFloat16;
  tiles.for_each(p.ranks * (p.k + p.n), [&](const int32_t* rows, int count, auto& shrunk) {
    thread_local std::vector<char> zeros;
    if (bf16) {
      run_tile<DType::kBFloat16>(p, rows, count, s[rows[0]], shrunk, zeros);
    } else {
      run_tile<DType::kFloat32>(p, rows, count, s[rows[0]], shrunk, zeros);
    }
  });
}

void lora_embedding_add(const TensorView& out, const TensorView& ids, const TensorView& a,
                        const TensorView& b, const TensorView& slots, const TensorView& scale) {
  check_embedding(out, ids, a, b, slots, scale);
  const auto* s = static_cast<const int32_t*>(slots.data);
  const SlotTiles tiles(s, out.shape[0]);
  const EmbeddingArgs p{static_cast<char*>(out.data),
                        &ids,
                        static_cast<const char*>(a.data),
                        static_cast<const char*>(b.data),
                        out.strides[0],
                        out.shape[1],
                        a.shape[1],
                        a.shape[2],
                        static_cast<const float*>(scale.data)};
  const bool bf16 = out.dtype == DType::kBFloat16;
  tiles.for_each(p.ranks * p.n, [&](const int32_t* rows, int count, auto& shrunk) {
    if (bf16) {
      run_embedding_tile<DType::kBFloat16>(p, rows, count, s[rows[0]], shrunk);
    } else {
      run_embedding_tile<DType::kFloat32>(p, rows, count, s[rows[0]], shrunk);
    }
  });
}

}  // namespace pyengine
