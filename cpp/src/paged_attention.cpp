// CPU paged attention: online softmax over the request's KV blocks, one block at a time,
// for a tile of query tokens times the query heads of one kv head's GQA group. K/V are
// read once per tile; no score matrix beyond one block is ever held.
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "attention_checks.h"
#include "float_convert.h"
#include "pyengine/attention.h"

namespace pyengine {
namespace {

using detail::arg;

constexpr int kQueryTile = 8;  // query tokens per work item
constexpr float kMinusInf = -std::numeric_limits<float>::infinity();

struct Problem {
  void* out;
  const void* query;
  const void* key_cache;
  const void* value_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const int32_t* query_start_loc;
  int64_t q_token_stride, q_head_stride;  // elements
  int64_t o_token_stride, o_head_stride;
  int64_t max_blocks;  // block_tables row length
  int64_t num_kv_heads, group, block_size, head_size;
  AttentionOptions options;
};

struct WorkItem {
  int32_t request;
  int32_t kv_head;
  int32_t first_query;  // within the request
  int32_t num_queries;
};

// Dot product of two float vectors of a length divisible by 8; eight partial sums let
// the compiler keep them in one SIMD register.
inline float dot(const float* a, const float* b, int64_t n) {
  float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  for (int64_t i = 0; i < n; i += 8) {
    for (int j = 0; j < 8; ++j) s[j] += a[i + j] * b[i + j];
  }
  return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

// Per-thread buffers, sized once per call.
struct Scratch {
  std::vector<float> query;   // [rows, head_size], pre-scaled
  std::vector<float> acc;     // [rows, head_size]
  std::vector<float> max;     // [rows]
  std::vector<float> sum;     // [rows]
  std::vector<int64_t> pos;   // [rows] position of each row's query token
  std::vector<float> scores;  // [rows, block_size]
  std::vector<float> keys;    // [block_size, head_size] one block as float
  std::vector<float> values;  // [block_size, head_size]

  Scratch(int64_t rows, int64_t block_size, int64_t head_size)
      : query(static_cast<size_t>(rows * head_size)),
        acc(static_cast<size_t>(rows * head_size)),
        max(static_cast<size_t>(rows)),
        sum(static_cast<size_t>(rows)),
        pos(static_cast<size_t>(rows)),
        scores(static_cast<size_t>(rows * block_size)),
        keys(static_cast<size_t>(block_size * head_size)),
        values(static_cast<size_t>(block_size * head_size)) {}
};

// Block rows [first, first + count) of one kv head of `cache` as float: a view for
// float32 caches, else converted into `buffer`.
template <DType kDType>
const float* block_rows(const void* cache, int64_t offset, int64_t count, int64_t head_size,
                        std::vector<float>& buffer) {
  if constexpr (kDType == DType::kFloat32) {
    (void)count;
    (void)head_size;
    (void)buffer;
    return static_cast<const float*>(cache) + offset;
  } else {
    for (int64_t i = 0; i < count * head_size; ++i) {
      buffer[static_cast<size_t>(i)] = detail::load<kDType>(cache, offset + i);
    }
    return buffer.data();
  }
}

template <DType kDType>
void attend(const Problem& p, const WorkItem& w, Scratch& s) {
  const int64_t d = p.head_size;
  const int64_t bs = p.block_size;
  const int64_t seq_len = p.seq_lens[w.request];
  const int64_t first_token = p.query_start_loc[w.request];
  const int64_t q_len = p.query_start_loc[w.request + 1] - first_token;
  const int64_t rows = w.num_queries * p.group;
  const AttentionOptions& o = p.options;

  // Load and scale the tile's queries; row r = (query j, head g in the group).
  int64_t lowest_pos = std::numeric_limits<int64_t>::max();
  int64_t highest_pos = 0;
  for (int64_t j = 0; j < w.num_queries; ++j) {
    const int64_t token = first_token + w.first_query + j;
    const int64_t position = seq_len - q_len + w.first_query + j;
    lowest_pos = std::min(lowest_pos, position);
    highest_pos = std::max(highest_pos, position);
    for (int64_t g = 0; g < p.group; ++g) {
      const int64_t r = j * p.group + g;
      const int64_t head = w.kv_head * p.group + g;
      const int64_t src = token * p.q_token_stride + head * p.q_head_stride;
      for (int64_t i = 0; i < d; ++i) {
        s.query[static_cast<size_t>(r * d + i)] = detail::load<kDType>(p.query, src + i) * o.scale;
      }
      s.pos[static_cast<size_t>(r)] = position;
      s.max[static_cast<size_t>(r)] = kMinusInf;
      s.sum[static_cast<size_t>(r)] = 0.0f;
    }
  }
  std::fill(s.acc.begin(), s.acc.begin() + rows * d, 0.0f);

  const int64_t first_key =
      o.sliding_window > 0 ? std::max<int64_t>(0, lowest_pos - o.sliding_window + 1) : 0;
  const int32_t* table = p.block_tables + static_cast<int64_t>(w.request) * p.max_blocks;
  for (int64_t b = first_key / bs; b * bs <= highest_pos; ++b) {
    const int64_t block_first = b * bs;
    const int64_t count = std::min(bs, highest_pos + 1 - block_first);
    const int64_t offset = (static_cast<int64_t>(table[b]) * p.num_kv_heads + w.kv_head) * bs * d;
    const float* keys = block_rows<kDType>(p.key_cache, offset, count, d, s.keys);
    const float* values = block_rows<kDType>(p.value_cache, offset, count, d, s.values);
    for (int64_t r = 0; r < rows; ++r) {
      float* scores = s.scores.data() + r * bs;
      const float* q = s.query.data() + r * d;
      const int64_t position = s.pos[static_cast<size_t>(r)];
      float block_max = kMinusInf;
      for (int64_t k = 0; k < count; ++k) {
        const int64_t key_pos = block_first + k;
        const bool visible =
            key_pos <= position && (o.sliding_window <= 0 || key_pos > position - o.sliding_window);
        float score = kMinusInf;
        if (visible) {
          score = dot(q, keys + k * d, d);
          if (o.logit_soft_cap > 0) score = o.logit_soft_cap * std::tanh(score / o.logit_soft_cap);
        }
        scores[k] = score;
        block_max = std::max(block_max, score);
      }
      if (block_max == kMinusInf) continue;  // nothing visible to this row here
      float& row_max = s.max[static_cast<size_t>(r)];
      float& row_sum = s.sum[static_cast<size_t>(r)];
      float* acc = s.acc.data() + r * d;
      if (block_max > row_max) {
        const float correction = std::exp(row_max - block_max);  // 0 on the first block
        row_sum *= correction;
        for (int64_t i = 0; i < d; ++i) acc[i] *= correction;
        row_max = block_max;
      }
      for (int64_t k = 0; k < count; ++k) {
        if (scores[k] == kMinusInf) continue;
        const float weight = std::exp(scores[k] - row_max);
        row_sum += weight;
        const float* v = values + k * d;
        for (int64_t i = 0; i < d; ++i) acc[i] += weight * v[i];
      }
    }
  }

  for (int64_t j = 0; j < w.num_queries; ++j) {
    const int64_t token = first_token + w.first_query + j;
    for (int64_t g = 0; g < p.group; ++g) {
      const int64_t r = j * p.group + g;
      const int64_t head = w.kv_head * p.group + g;
      const int64_t dst = token * p.o_token_stride + head * p.o_head_stride;
      const float inverse = 1.0f / s.sum[static_cast<size_t>(r)];
      for (int64_t i = 0; i < d; ++i) {
        detail::store<kDType>(p.out, dst + i, s.acc[static_cast<size_t>(r * d + i)] * inverse);
      }
    }
  }
}

template <DType kDType>
void run(const Problem& p, const std::vector<WorkItem>& items) {
  const auto n = static_cast<int64_t>(items.size());
#pragma omp parallel if (n > 1)
  {
    Scratch scratch(kQueryTile * p.group, p.block_size, p.head_size);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) attend<kDType>(p, items[static_cast<size_t>(i)], scratch);
  }
}

void check_int_array(const TensorView& t, const char* name, int ndim) {
  constexpr const char* op = "paged_attention";
  detail::check_cpu(t, op, name);
  detail::check_dtype(t, DType::kInt32, op, name);
  detail::check_shape(t, op, name, ndim);
  if (!t.is_contiguous()) throw InvalidArgument(arg(op, name) + " must be contiguous");
}

}  // namespace

void paged_attention(const TensorView& out, const TensorView& query, const TensorView& key_cache,
                     const TensorView& value_cache, const TensorView& block_tables,
                     const TensorView& seq_lens, const TensorView& query_start_loc,
                     const AttentionOptions& options) {
  constexpr const char* op = "paged_attention";
  detail::check_cache(key_cache, op, "key_cache");
  detail::check_cache(value_cache, op, "value_cache");
  detail::check_same_cache(key_cache, value_cache, op);
  const int64_t num_blocks = key_cache.shape[0];
  const int64_t num_kv_heads = key_cache.shape[1];
  const int64_t block_size = key_cache.shape[2];
  const int64_t head_size = key_cache.shape[3];
  if (std::find(kSupportedHeadSizes.begin(), kSupportedHeadSizes.end(), head_size) ==
      kSupportedHeadSizes.end()) {
    throw InvalidArgument(std::string(op) + ": head_size " + std::to_string(head_size) +
                          " is not supported (32, 64, 80, 96, 112, 128, 192, 256)");
  }
  for (const auto& [t, name] : {std::pair{&query, "query"}, std::pair{&out, "out"}}) {
    detail::check_cpu(*t, op, name);
    detail::check_shape(*t, op, name, 3);
    detail::check_dtype(*t, key_cache.dtype, op, name);
    if (t->shape[2] != head_size || t->strides[2] != 1) {
      throw InvalidArgument(arg(op, name) + " must be [num_tokens, num_q_heads, " +
                            std::to_string(head_size) + "] with a dense last dim, got " +
                            t->describe());
    }
  }
  if (out.shape[0] != query.shape[0] || out.shape[1] != query.shape[1]) {
    throw InvalidArgument(std::string(op) + ": out " + out.describe() + " differs from query " +
                          query.describe());
  }
  const int64_t num_tokens = query.shape[0];
  const int64_t num_q_heads = query.shape[1];
  if (num_q_heads % num_kv_heads != 0) {
    throw InvalidArgument(std::string(op) + ": num_q_heads (" + std::to_string(num_q_heads) +
                          ") must be a multiple of num_kv_heads (" + std::to_string(num_kv_heads) +
                          ")");
  }
  check_int_array(block_tables, "block_tables", 2);
  check_int_array(seq_lens, "seq_lens", 1);
  check_int_array(query_start_loc, "query_start_loc", 1);
  const int64_t num_reqs = seq_lens.shape[0];
  if (query_start_loc.shape[0] != num_reqs + 1 || block_tables.shape[0] != num_reqs) {
    throw InvalidArgument(std::string(op) +
                          ": need seq_lens [num_reqs], query_start_loc [num_reqs + 1] and "
                          "block_tables [num_reqs, max_blocks]");
  }
  if (!std::isfinite(options.scale) || options.sliding_window < 0 ||
      !(options.logit_soft_cap >= 0)) {
    throw InvalidArgument(std::string(op) +
                          ": scale must be finite, sliding_window and logit_soft_cap >= 0");
  }
  const auto* qsl = static_cast<const int32_t*>(query_start_loc.data);
  const auto* lens = static_cast<const int32_t*>(seq_lens.data);
  const auto* tables = static_cast<const int32_t*>(block_tables.data);
  const int64_t max_blocks = block_tables.shape[1];
  if (qsl[0] != 0 || qsl[num_reqs] != num_tokens) {
    throw InvalidArgument(std::string(op) + ": query_start_loc must start at 0 and end at " +
                          std::to_string(num_tokens));
  }
  const int64_t group = num_q_heads / num_kv_heads;
  std::vector<WorkItem> items;
  for (int64_t i = 0; i < num_reqs; ++i) {
    const int64_t q_len = qsl[i + 1] - qsl[i];
    const std::string request = "request " + std::to_string(i);
    if (q_len < 1 || lens[i] < q_len) {
      throw InvalidArgument(std::string(op) + ": " + request + " has " + std::to_string(q_len) +
                            " query tokens and seq_len " + std::to_string(lens[i]) +
                            " (need 1 <= q_len <= seq_len)");
    }
    const int64_t num_used = (lens[i] + block_size - 1) / block_size;
    if (num_used > max_blocks) {
      throw InvalidArgument(std::string(op) + ": " + request + " needs " +
                            std::to_string(num_used) + " blocks, block_tables has " +
                            std::to_string(max_blocks) + " per request");
    }
    for (int64_t b = 0; b < num_used; ++b) {
      const int32_t block = tables[i * max_blocks + b];
      if (block < 0 || block >= num_blocks) {
        throw InvalidArgument(std::string(op) + ": block_tables[" + std::to_string(i) + ", " +
                              std::to_string(b) + "] = " + std::to_string(block) +
                              " is outside [0, " + std::to_string(num_blocks) + ")");
      }
    }
    for (int64_t first = 0; first < q_len; first += kQueryTile) {
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        items.push_back({static_cast<int32_t>(i), static_cast<int32_t>(h),
                         static_cast<int32_t>(first),
                         static_cast<int32_t>(std::min<int64_t>(kQueryTile, q_len - first))});
      }
    }
  }

  const Problem p{out.data,
                  query.data,
                  key_cache.data,
                  value_cache.data,
                  tables,
                  lens,
                  qsl,
                  query.strides[0],
                  query.strides[1],
                  out.strides[0],
                  out.strides[1],
                  max_blocks,
                  num_kv_heads,
                  group,
                  block_size,
                  head_size,
                  options};
  switch (key_cache.dtype) {
    case DType::kFloat32: return run<DType::kFloat32>(p, items);
    case DType::kFloat16: return run<DType::kFloat16>(p, items);
    case DType::kBFloat16: return run<DType::kBFloat16>(p, items);
    default: throw InvalidArgument(std::string(op) + ": unsupported cache dtype");
  }
}

}  // namespace pyengine
