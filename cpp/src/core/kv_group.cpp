#include "pyengine/kv_group.h"

#include "pyengine/errors.h"

namespace pyengine {

int64_t max_blocks_held(std::span<const KVGroupSpec> groups, int block_size, int64_t num_tokens,
                        int64_t max_step_tokens) {
  const int64_t size = block_size;
  const int64_t all = (num_tokens + size - 1) / size;
  int64_t total = 0;
  for (const KVGroupSpec& spec : groups) {
    // A step's queries from F on need the blocks from first_visible(F), which is at
    // most spec.size - 1 positions back, up to F + max_step_tokens.
    const int64_t bounded = (spec.size + max_step_tokens + size - 1) / size + 1;
    total += spec.kind == KVGroupKind::kFull ? all : std::min(all, bounded);
  }
  return total;
}

KVGroupKind parse_kv_group_kind(const std::string& name) {
  if (name == "full") return KVGroupKind::kFull;
  if (name == "sliding") return KVGroupKind::kSliding;
  if (name == "chunked") return KVGroupKind::kChunked;
  throw InvalidArgument("unknown KV-cache group kind '" + name +
                        "' (expected 'full', 'sliding' or 'chunked')");
}

const char* kv_group_kind_name(KVGroupKind kind) {
  switch (kind) {
    case KVGroupKind::kSliding:
      return "sliding";
    case KVGroupKind::kChunked:
      return "chunked";
    case KVGroupKind::kFull:
      break;
  }
  return "full";
}

}  // namespace pyengine
