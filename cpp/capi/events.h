// What the engine thread hands a request (bridge.py calls deliver_event through the
// bridge table): one event of one sample, routed by the request's key to its state.
#pragma once

#include <cstddef>
#include <cstdint>

namespace pyengine::capi {

void deliver_event(std::int64_t request, std::int32_t index, const std::int32_t* tokens,
                   std::size_t n_tokens, const char* text, std::size_t text_len,
                   const float* logprobs, const std::int32_t* top_tokens,
                   const float* top_logprobs, std::size_t top_k, std::int32_t finish,
                   std::int32_t status, std::int32_t request_finished,
                   std::int32_t prompt_tokens);

}  // namespace pyengine::capi
