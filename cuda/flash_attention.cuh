// The tensor-core paged-attention kernel (launched by flash_attention.cu): mma.sync
// m16n8k16 with float16 or bfloat16 operands and float32 accumulation, flash-attention
// style. A thread block per (request, kv head, tile of the request's query tokens,
// partition of the context). A tile's rows are (query token, query head of this kv
// head's GQA group) pairs, so the group's heads share every K/V load: 128 rows over
// eight warps for prefill (each chunk of K/V copied once for that many rows), 16 rows in
// a one-warp block for decode (where a request's rows are its group's heads; small blocks
// keep many loads in flight per multiprocessor). K/V stream through shared memory a chunk
// of keys at a time, two or three chunks deep (SharedChunks), in 16-byte asynchronous
// copies issued ahead (zeros past the context, so that stale slots never reach the
// output); each warp keeps its 16 rows' scores, online softmax and output in registers,
// the scores going back into the tensor cores as the A operand of P V.
// Device code and plain C++ only, so that cpp/tests can run it on the host. Internal to
// cuda/.
#pragma once

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>

#include "cuda/attention_params.cuh"
#include "cuda/element_types.cuh"
#include "cuda/mma_primitives.cuh"

namespace pyengine::cuda::flash {

constexpr int kWarpRows = 16;  // an mma tile's M
// Prefill blocks: eight warps by default; four (64 rows, three blocks a multiprocessor)
// where flash_attention.cu is asked for them, to compare the two on a device.
constexpr int kPrefillWarps = 8;
constexpr int kMaxGroupSize = 4 * kWarpRows;  // a group's heads fit either tile
constexpr int kPad = 8;  // elements after each shared row: ldmatrix reads 8 rows in 8 banks
constexpr float kLog2e = 1.4426950408889634f;

// A block's shared memory (dynamic): kStages chunks of K and V in flight, and where the
// cache blocks of each hold this kv head. An eight-warp prefill block, alone on its
// multiprocessor, streams 64 keys a chunk (16 at head size 256) three chunks deep; the
// smaller blocks, several a multiprocessor, two chunks of up to 48 KB in all.
template <typename T, int D, int kWarps>
struct SharedChunks {
  static constexpr int kKeys = kWarps == 8 ? (D <= 128 ? 64 : 16)
                                           : (D <= 80    ? 64
                                              : D <= 128 ? 32
                                                         : 16);
  static constexpr int kStages = kWarps == 8 ? 3 : 2;
  T k[kStages][D][kKeys + kPad];  // K^T, [dim][key]
  T v[kStages][kKeys][D + kPad];  // V, [key][dim]
  // Where each chunk's groups of 8 keys start in the K and the V cache (elements from
  // the cache's start; blocks hold at least 8 keys, so a group never straddles two): the
  // copies add only their own offsets.
  int64_t k_groups[kStages][kKeys / 8];
  int64_t v_groups[kStages][kKeys / 8];
};

template <typename T, int D, int kWarps>
constexpr unsigned shared_bytes() {
  return sizeof(SharedChunks<T, D, kWarps>);
}

// A query row of the tile: (token, head) and the keys it sees.
struct Row {
  bool valid = false;
  int token = 0, head = 0;
  int first = 0, end = 0;  // its visible keys [first, end) within the partition
};

// One eight-warp prefill block per multiprocessor, which lets a thread keep its Q, scores
// and output in up to 255 registers without spilling; three four-warp blocks (two for
// head size 256); six one-warp decode blocks.
template <typename T, int D, int kWarps>
__global__ void __launch_bounds__(kWarps* kWarp, kWarps == 1   ? 6
                                                 : kWarps == 4 ? (D > 128 ? 2 : 3)
                                                               : 1)
    flash_attention_kernel(const AttentionParams p) {
  constexpr int kThreads = kWarps * kWarp;
  constexpr int kTileRows = kWarps * kWarpRows;
  using Shared = SharedChunks<T, D, kWarps>;
  constexpr int kKeys = Shared::kKeys, kStages = Shared::kStages;
  constexpr int kSteps = D / 16;        // k-steps of Q K^T
  constexpr int kKeyTiles = kKeys / 8;  // n-tiles of the scores
  constexpr int kDimTiles = D / 8;      // n-tiles of the output
  // 16-byte copies of a chunk, of K and of V alike, and the most a thread makes.
  constexpr int kChunkCopies = D * kKeys / 8;
  constexpr int kCopies = (kChunkCopies + kThreads - 1) / kThreads;
  static_assert(kThreads % (kKeys / 8) == 0);
  PYENGINE_DYNAMIC_SHARED(shared_memory);
  Shared& shared = *reinterpret_cast<Shared*>(shared_memory);

  const int r = blockIdx.x / p.tiles_per_request;
  const int kv_head = blockIdx.y, part = blockIdx.z;
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int group = lane / 4, quad = lane % 4;         // the lane's place in mma fragments
  const int matrix = lane / 8, matrix_row = lane % 8;  // its row address for ldmatrix
  const int group_size = p.num_heads / p.num_kv_heads;
  const int tokens_per_tile = kTileRows / group_size;
  const int q_start = p.query_start_loc[r];
  const int q_len = p.query_start_loc[r + 1] - q_start;
  // Positions and keys fit 32 bits (seq_lens are int32); block sizes are powers of two.
  const int seq_len = p.seq_lens[r];
  const int context_start = seq_len - q_len;  // the position of the first query token
  const int block_shift = p.block_shift, in_block = p.block_size - 1;
  const int32_t* table = p.block_tables + static_cast<int64_t>(r) * p.max_blocks;
  const int64_t kv_tile = static_cast<int64_t>(p.block_size) * D;  // one (block, kv head)
  const int64_t block_stride = kv_tile * p.num_kv_heads;
  const T* keys = static_cast<const T*>(p.key_cache);
  const T* values = static_cast<const T*>(p.value_cache);

  // Thread g < kKeys / 8 reads the cache block of group g of a chunk's keys (block 0 past
  // the context); store_group_start stores where the group starts in K and in V into a
  // stage's slots. Only the block id waits through a chunk's compute: one register.
  // Keys before `held_from`, the start of the block of the tile's first visible key, are
  // neither looked up nor copied (zeros): a window's KV-cache group may have released
  // their blocks.
  const int64_t head_tile = kv_head * kv_tile;
  int held_from = 0;
  const auto group_block = [&](int chunk) -> int32_t {
    const int key = chunk + 8 * static_cast<int>(threadIdx.x);
    if (threadIdx.x >= kKeys / 8 || key >= seq_len || key < held_from) return 0;
    return cache_block(p, table[key >> block_shift]);
  };
  const auto store_group_start = [&](int stage, int chunk, int32_t block) {
    if (threadIdx.x >= kKeys / 8) return;
    const int in_block_key = (chunk + 8 * static_cast<int>(threadIdx.x)) & in_block;
    const int64_t tile = block * block_stride + head_tile;
    shared.k_groups[stage][threadIdx.x] = tile + in_block_key;
    shared.v_groups[stage][threadIdx.x] = tile + static_cast<int64_t>(in_block_key) * D;
  };
  // A chunk's copies into `stage`, whose groups start at shared.*_groups[stage]: K, 8 keys
  // of one dim each (the thread's keys are always the same, its dims kKeyDimStep apart),
  // and V, 8 dims of one key each, neighbouring lanes along a key's row. What does not
  // change from chunk to chunk is computed once: the copies are a fair share of the
  // loop's instructions.
  constexpr int kKeyDimStep = kThreads / (kKeys / 8);
  const int k_first_key = threadIdx.x % (kKeys / 8) * 8;
  const int k_first_dim = threadIdx.x / (kKeys / 8);
  const int k_dim_step = kKeyDimStep * p.block_size;  // elements between its K copies
  const auto copy_chunk = [&](int stage, int chunk) {
    const T* k_source = keys + shared.k_groups[stage][k_first_key / 8] + k_first_dim * p.block_size;
    const int k_key = chunk + k_first_key;
    const bool k_valid = k_key < seq_len && k_key >= held_from;
    for (int i = 0; i < kCopies; ++i) {
      if (kChunkCopies % kThreads != 0 && k_first_dim + i * kKeyDimStep >= D) break;
      copy_async(&shared.k[stage][k_first_dim + i * kKeyDimStep][k_first_key],
                 k_source + i * k_dim_step, k_valid);
    }
    for (int i = 0; i < kCopies; ++i) {
      const int v = threadIdx.x + i * kThreads;  // (key, 8 dims) of the chunk's V
      if (kChunkCopies % kThreads != 0 && v >= kChunkCopies) break;
      const int index = v / (D / 8), first_dim = v % (D / 8) * 8;
      copy_async(&shared.v[stage][index][first_dim],
                 values + shared.v_groups[stage][index / 8] + (index % 8 * D + first_dim),
                 chunk + index < seq_len && chunk + index >= held_from);
    }
  };

  // Scores go into exp2 as score * score_log2; a soft cap maps them first to
  // cap * tanh(score * scale / cap), already in log2 units.
  const float cap_log2 = p.logit_soft_cap * kLog2e;
  const float scale_over_cap = p.scale / p.logit_soft_cap;
  const float score_log2 = p.logit_soft_cap > 0 ? 1.0f : p.scale * kLog2e;

  // A request's last tiles, which see the most keys, go to its first blocks: the device
  // starts blocks in order, so the long ones start first and short ones fill the end of
  // the grid (longest first). A short max_query_len hint leaves a block more than one
  // tile: never a wrong result.
  for (int tile = p.tiles_per_request - 1 - static_cast<int>(blockIdx.x) % p.tiles_per_request;
       tile * tokens_per_tile < q_len; tile += p.tiles_per_request) {
    const int first_token = tile * tokens_per_tile;
    const int last_token = min(first_token + tokens_per_tile, q_len) - 1;
    const auto window_start = [&](int position) {
      return static_cast<int>(first_visible(p, position));
    };
    const KeyRange range = partition_keys(window_start(context_start + first_token),
                                          context_start + last_token + 1, part, p.num_parts, kKeys);
    const int begin = static_cast<int>(range.begin), end = static_cast<int>(range.end);
    held_from = begin - begin % p.block_size;
    // Keys every row of the tile sees: chunks inside need no mask.
    const int all_see_from = max(begin, window_start(context_start + last_token));
    const int all_see_to = min(end, context_start + first_token + 1);
    // The rows fill the tile from its first, so a warp works where its first row does.
    const int warp_first_token = warp * kWarpRows / group_size;
    const bool warp_active =
        warp_first_token < tokens_per_tile && first_token + warp_first_token < q_len;

    Row rows[2];  // the lane's rows: group and group + 8 of the warp's 16
    uint32_t q_operand[kSteps][4];
    for (int i = 0; i < 2; ++i) {
      const int row = warp * kWarpRows + group + 8 * i;
      const int t = row / group_size;
      Row& x = rows[i];
      x.valid = t < tokens_per_tile && first_token + t < q_len;
      if (!x.valid) continue;
      const int position = context_start + first_token + t;
      x.token = q_start + first_token + t;
      x.head = kv_head * group_size + row % group_size;
      x.first = max(begin, window_start(position));
      x.end = min(end, position + 1);
    }
    // A operand: register i holds row (i % 2 ? group + 8 : group), dims 2 * quad + {0, 1}
    // (+ 8 for i >= 2) of each 16-dim step.
    for (int i = 0; i < 4; ++i) {
      const Row& x = rows[i % 2];
      const T* q = static_cast<const T*>(p.query) + x.token * p.q_token_stride +
                   x.head * p.q_head_stride + 2 * quad + (i / 2) * 8;
      for (int s = 0; s < kSteps; ++s) {
        q_operand[s][i] = x.valid ? *reinterpret_cast<const uint32_t*>(q + s * 16) : 0u;
      }
    }

    float row_max[2] = {-INFINITY, -INFINITY}, row_sum[2] = {0.0f, 0.0f};
    float acc[kDimTiles][4] = {};
    // The copies of chunk j + kStages - 1 are issued, into the stage chunk j - 1 used,
    // before chunk j is waited for: kStages chunks in flight while a warp waits,
    // kStages - 1 while it computes. Where a chunk's groups start is read one chunk before
    // its copies. A copy group is committed each time, empty past the end, so that leaving
    // kStages - 1 groups pending always means that chunk j has landed.
    const int first_chunk = begin / kKeys * kKeys;
    if (first_chunk < end) {
      for (int i = 0; i < kStages; ++i) {
        const int chunk = first_chunk + i * kKeys;
        store_group_start(i, chunk, group_block(chunk));
      }
      __syncthreads();
      for (int i = 0; i + 1 < kStages; ++i) {
        if (first_chunk + i * kKeys < end) copy_chunk(i, first_chunk + i * kKeys);
        commit_copies();
      }
    }
    int stage = 0;
    for (int chunk = first_chunk; chunk < end; chunk += kKeys) {
      const int ahead = chunk + (kStages - 1) * kKeys;
      if (ahead < end) copy_chunk(stage == 0 ? kStages - 1 : stage - 1, ahead);
      commit_copies();
      const int32_t ahead_block = group_block(chunk + kStages * kKeys);  // stored after
      wait_copies<kStages - 1>();
      __syncthreads();  // chunk j is in every thread's view
      if (warp_active) {
        // S = Q K^T: 16 rows x kKeys keys per warp.
        float s[kKeyTiles][4] = {};
        for (int step = 0; step < kSteps; ++step) {
          for (int n = 0; n < kKeyTiles; n += 2) {
            uint32_t b[4];
            load_b_operands(
                b,
                &shared.k[stage][step * 16 + matrix_row + (matrix & 1) * 8][(n + matrix / 2) * 8]);
            mma<T>(s[n], q_operand[step], b[0], b[1]);
            mma<T>(s[n + 1], q_operand[step], b[2], b[3]);
          }
        }
        // Cap and mask (C element i: row i / 2, key 2 * quad + i % 2 of the n-tile); the
        // scale goes into the exponent. Uniform branches, so that a plain chunk spends
        // nothing on either: chunks every row sees whole skip the mask.
        if (p.logit_soft_cap > 0) {
          for (int n = 0; n < kKeyTiles; ++n) {
            for (int i = 0; i < 4; ++i) s[n][i] = cap_log2 * tanhf(s[n][i] * scale_over_cap);
          }
        }
        if (chunk < all_see_from || chunk + kKeys > all_see_to) {
          for (int n = 0; n < kKeyTiles; ++n) {
            for (int i = 0; i < 4; ++i) {
              const Row& x = rows[i / 2];
              const int key = chunk + n * 8 + 2 * quad + i % 2;
              if (!(x.valid && key >= x.first && key < x.end)) s[n][i] = -INFINITY;
            }
          }
        }
        // Online softmax per row, in log2 units (exponent = score * score_log2 - base);
        // a row's four lanes (one quad group) share its maximum. The output is rescaled
        // only where a maximum of the warp grew: after the first chunks, seldom.
        float correction[2];
        bool grew = false;
        for (int i = 0; i < 2; ++i) {
          float chunk_max = -INFINITY;
          for (int n = 0; n < kKeyTiles; ++n) {
            chunk_max = fmaxf(chunk_max, fmaxf(s[n][2 * i], s[n][2 * i + 1]));
          }
          chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, 1));
          chunk_max = fmaxf(chunk_max, __shfl_xor_sync(0xffffffffu, chunk_max, 2));
          const float new_max = fmaxf(row_max[i], chunk_max);
          const float base = new_max == -INFINITY ? 0.0f : new_max * score_log2;  // none yet
          // Exactly 1 where the maximum held (a fused row_max * score_log2 - base would
          // leave its rounding error, which the sum would gather chunk after chunk).
          correction[i] =
              new_max > row_max[i] ? fast_exp2((row_max[i] - new_max) * score_log2) : 1.0f;
          grew = grew || new_max > row_max[i];
          row_max[i] = new_max;
          row_sum[i] *= correction[i];
          for (int n = 0; n < kKeyTiles; ++n) {
            for (int j = 2 * i; j < 2 * i + 2; ++j) {
              s[n][j] = fast_exp2(fmaf(s[n][j], score_log2, -base));
              row_sum[i] += s[n][j];
            }
          }
        }
        if (__any_sync(0xffffffffu, grew)) {
          for (int n = 0; n < kDimTiles; ++n) {
            for (int j = 0; j < 4; ++j) acc[n][j] *= correction[j / 2];
          }
        }
        // O += P V: the scores' C fragments of n-tiles 2k and 2k + 1 are the A operand of
        // the k-th 16-key step.
        for (int k = 0; k < kKeys / 16; ++k) {
          const uint32_t a[4] = {
              pack<T>(s[2 * k][0], s[2 * k][1]), pack<T>(s[2 * k][2], s[2 * k][3]),
              pack<T>(s[2 * k + 1][0], s[2 * k + 1][1]), pack<T>(s[2 * k + 1][2], s[2 * k + 1][3])};
          for (int n = 0; n < kDimTiles; n += 2) {
            uint32_t b[4];
            load_b_operands(
                b, &shared.v[stage][k * 16 + matrix_row + (matrix & 1) * 8][(n + matrix / 2) * 8]);
            mma<T>(acc[n], a, b[0], b[1]);
            mma<T>(acc[n + 1], a, b[2], b[3]);
          }
        }
      }
      // Chunk j's group starts are spent: chunk j + kStages's, whose copies reuse its stage, take
      // their place.
      store_group_start(stage, chunk + kStages * kKeys, ahead_block);
      __syncthreads();  // every warp is done with chunk j's stage before it is refilled
      stage = stage + 1 == kStages ? 0 : stage + 1;
    }
    if (!warp_active) continue;

    for (int i = 0; i < 2; ++i) {
      row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 1);
      row_sum[i] += __shfl_xor_sync(0xffffffffu, row_sum[i], 2);
      const Row& x = rows[i];
      if (!x.valid) continue;
      if (p.num_parts == 1) {  // every row sees at least its own position
        T* o = static_cast<T*>(p.out) + x.token * p.o_token_stride + x.head * p.o_head_stride;
        // (the max in natural-log units, as a partition's below)
        const float max = row_max[i] * score_log2 / kLog2e;
        const float inverse = 1.0f / with_sink(p, x.head, row_sum[i], max);
        for (int n = 0; n < kDimTiles; ++n) {
          *reinterpret_cast<uint32_t*>(o + n * 8 + 2 * quad) =
              pack<T>(acc[n][2 * i] * inverse, acc[n][2 * i + 1] * inverse);
        }
        continue;
      }
      // The partition's (max, sum, unnormalized output), the max in natural-log units.
      float* partial =
          p.partials +
          ((static_cast<int64_t>(x.token) * p.num_heads + x.head) * p.num_parts + part) * (D + 2);
      if (quad == 0) {
        partial[0] = row_max[i] == -INFINITY ? -INFINITY : row_max[i] * score_log2 / kLog2e;
        partial[1] = row_sum[i];
      }
      for (int n = 0; n < kDimTiles; ++n) {
        partial[2 + n * 8 + 2 * quad] = acc[n][2 * i];
        partial[3 + n * 8 + 2 * quad] = acc[n][2 * i + 1];
      }
    }
  }
}

// The launch of the kernel for `p` (its tiles_per_request and block_shift set here) and
// a largest query length of `max_query_len`: one warp where every request's rows fit its
// 16 (decode), else `prefill_warps` (4 or 8).
struct Launch {
  unsigned grid_x, grid_y, grid_z;
  int warps;
};
inline Launch plan_launch(AttentionParams& p, int64_t max_query_len,
                          int prefill_warps = kPrefillWarps) {
  const int64_t group_size = p.num_heads / p.num_kv_heads;
  const int warps = max_query_len * group_size <= kWarpRows ? 1 : prefill_warps;
  const int64_t tokens_per_tile = warps * kWarpRows / group_size;
  const int64_t tiles = (max_query_len + tokens_per_tile - 1) / tokens_per_tile;
  p.tiles_per_request =
      static_cast<int>(std::min<int64_t>(tiles, INT32_MAX / std::max(p.num_reqs, 1)));
  p.block_shift = 0;
  while ((1 << p.block_shift) < p.block_size) ++p.block_shift;
  return {static_cast<unsigned>(p.num_reqs) * static_cast<unsigned>(p.tiles_per_request),
          static_cast<unsigned>(p.num_kv_heads), static_cast<unsigned>(p.num_parts), warps};
}

}  // namespace pyengine::cuda::flash
