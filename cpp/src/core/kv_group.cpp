#include "pyengine/kv_group.h"

#include "pyengine/errors.h"

namespace pyengine {

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
