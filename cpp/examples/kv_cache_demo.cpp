// Runs a few requests through pyengine's KV-cache manager and prints their block
// tables: two requests that share a system prompt (the second reuses its cached
// blocks), a forked request (copy-on-write), and the pool's statistics.
#include <cstdio>
#include <numeric>
#include <string>
#include <vector>

#include "pyengine/pyengine.h"

namespace {

void print_table(const pyengine::KVCacheManager& kv, const std::string& id) {
  std::printf("%-8s block_table = [", id.c_str());
  const char* separator = "";
  for (const pyengine::BlockId b : kv.block_table(id)) {
    std::printf("%s%d", separator, b);
    separator = ", ";
  }
  std::printf("]  num_computed_tokens = %d\n", kv.num_computed_tokens(id));
}

// Adds a request and schedules its whole prompt, reusing any cached prefix.
void start(pyengine::KVCacheManager& kv, const std::string& id,
           const std::vector<pyengine::TokenId>& prompt) {
  kv.add_request(id, prompt);
  pyengine::ComputedBlocks hit = kv.get_computed_blocks(id);
  const int num_new_tokens = static_cast<int>(prompt.size()) - hit.num_computed_tokens;
  if (!kv.allocate_slots(id, num_new_tokens, 0, &hit)) {
    std::printf("%s: not enough free blocks\n", id.c_str());
    return;
  }
  std::printf("%-8s prefix hit: %d of %zu tokens\n", id.c_str(), hit.num_computed_tokens,
              prompt.size());
}

}  // namespace

int main() {
  std::printf("pyengine %s\n", PYENGINE_VERSION);
  // Every field explicit: pyengine's C++ API has no engine defaults (Python's EngineArgs
  // holds the engine's).
  pyengine::KVCacheManager kv(
      pyengine::KVCacheConfig{.num_blocks = 32, .block_size = 16, .enable_prefix_caching = true});

  std::vector<pyengine::TokenId> system_prompt(40);
  std::iota(system_prompt.begin(), system_prompt.end(), 1000);
  auto chat_a = system_prompt;
  chat_a.insert(chat_a.end(), {1, 2, 3, 4, 5});
  auto chat_b = system_prompt;
  chat_b.insert(chat_b.end(), {6, 7, 8});

  start(kv, "chat-a", chat_a);
  start(kv, "chat-b", chat_b);
  kv.fork("chat-b", "chat-b.1");
  const pyengine::TokenId sampled[] = {42};
  kv.append_token_ids("chat-b.1", sampled);
  kv.allocate_slots("chat-b.1", 1);
  for (const auto& [src, dst] : kv.take_pending_copies()) {
    std::printf("copy-on-write: block %d -> block %d\n", src, dst);
  }
  for (const char* id : {"chat-a", "chat-b", "chat-b.1"}) print_table(kv, id);

  const pyengine::KVCacheStats s = kv.stats();
  std::printf("blocks used %d / %d, cached %d, prefix hits %lld / %lld tokens, waste %lld slots\n",
              s.num_used_blocks, s.num_blocks, s.num_cached_blocks,
              static_cast<long long>(s.prefix_cache_hits),
              static_cast<long long>(s.prefix_cache_queries),
              static_cast<long long>(s.internal_waste_tokens));
  for (const char* id : {"chat-a", "chat-b", "chat-b.1"}) kv.free(id);
  std::printf("after free: %d free blocks\n", kv.num_free_blocks());
  return 0;
}
