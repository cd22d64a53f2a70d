// What the KV-cache manager's tests share: prompts, and a request started whole.
#pragma once

#include <numeric>
#include <utility>
#include <vector>

#include "harness.h"
#include "pyengine/kv_cache_manager.h"

namespace pyengine::testing {

inline std::vector<TokenId> iota_tokens(int n, TokenId first = 0) {
  std::vector<TokenId> tokens(static_cast<size_t>(n));
  std::iota(tokens.begin(), tokens.end(), first);
  return tokens;
}

// Adds a request and computes its whole prompt, taking any prefix hit.
inline ComputedBlocks start(KVCacheManager& kv, const RequestId& id,
                            const std::vector<TokenId>& prompt, BlockExtras extras = {}) {
  kv.add_request(id, prompt, std::move(extras));
  ComputedBlocks hit = kv.get_computed_blocks(id);
  const int rest = static_cast<int>(prompt.size()) - hit.num_computed_tokens;
  CHECK(kv.allocate_slots(id, rest, 0, &hit).has_value());
  return hit;
}

}  // namespace pyengine::testing
