// The table through which libpyengine and pyengine/capi/bridge.py call each other, and
// its operations. The layout is mirrored by bridge.py's ctypes Structure: change both,
// and kBridgeAbi, together.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace pyengine::capi {

inline constexpr std::uint32_t kBridgeAbi = 1;

// What the C side asks of Python (bridge.py's OPS, by the same numbers).
enum class Op : std::int32_t {
  kCreate = 1,      // in: {"model", "options"}; out: the engine's key, decimal
  kShutdown = 2,    // out: nothing
  kInfo = 3,        // out: int32 x 6 (pyengine_engine_info's fields, in order)
  kStats = 4,       // out: float64 x 8 (pyengine_stats's fields, in order)
  kTokenize = 5,    // in: {"text", "add_special_tokens"}; out: int32 token ids
  kDetokenize = 6,  // in: {"tokens", "skip_special_tokens"}; out: UTF-8 text
  kChatTemplate = 7,  // in: {"messages", "add_generation_prompt"}; out: UTF-8 text
  kSubmit = 8,      // in: the request (c_api.cpp's request_json); out: nothing
  kAbort = 9,       // in: the request's key, decimal; out: nothing
  kEmbed = 10,      // in: {"texts", "normalize", "dimensions"}; out: int32 dim, float32s
};

// bridge.py calls put_result once with an operation's result (or, where the operation
// fails, its error text); `result` is the std::string the caller passed.
using PutResult = void (*)(void* result, const char* data, std::size_t size);

// The engine thread calls deliver with each event of a request (events.cpp).
using Deliver = void (*)(std::int64_t request, std::int32_t index, const std::int32_t* tokens,
                         std::size_t n_tokens, const char* text, std::size_t text_len,
                         const float* logprobs, const std::int32_t* top_tokens,
                         const float* top_logprobs, std::size_t top_k, std::int32_t finish,
                         std::int32_t status, std::int32_t request_finished,
                         std::int32_t prompt_tokens);

// Set by bridge.py: runs an operation on an engine (0 before kCreate), under the GIL
// (ctypes takes it); returns a pyengine_status.
using OpFunction = std::int32_t (*)(std::int64_t engine, std::int32_t op, const char* in,
                                    std::size_t in_size, void* result);

struct BridgeTable {
  std::uint32_t abi = kBridgeAbi;
  PutResult put_result = nullptr;
  Deliver deliver = nullptr;
  OpFunction op = nullptr;
};

}  // namespace pyengine::capi
