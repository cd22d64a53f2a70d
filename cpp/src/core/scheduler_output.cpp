#include "pyengine/scheduler_output.h"

namespace pyengine {

const char* finish_reason_name(FinishReason reason) {
  switch (reason) {
    case FinishReason::kNone: return "";
    case FinishReason::kStop: return "stop";
    case FinishReason::kLength: return "length";
    case FinishReason::kAbort: return "abort";
  }
  return "";
}

StepBuffers::StepBuffers(int max_num_batched_tokens, int max_num_seqs, int max_blocks,
                         int num_kv_groups)
    : max_num_batched_tokens(max_num_batched_tokens),
      max_num_seqs(max_num_seqs),
      max_blocks_per_request(max_blocks),
      num_kv_groups(num_kv_groups),
      input_ids(static_cast<size_t>(max_num_batched_tokens)),
      positions(static_cast<size_t>(max_num_batched_tokens)),
      slot_mapping(static_cast<size_t>(num_kv_groups) * static_cast<size_t>(max_num_batched_tokens)),
      query_start_loc(static_cast<size_t>(max_num_seqs) + 1),
      seq_lens(static_cast<size_t>(max_num_seqs)),
      block_tables(static_cast<size_t>(num_kv_groups) * static_cast<size_t>(max_num_seqs) *
                   static_cast<size_t>(max_blocks)),
      logits_indices(static_cast<size_t>(max_num_batched_tokens) +
                     static_cast<size_t>(max_num_seqs)),
      num_scheduled_tokens(static_cast<size_t>(max_num_seqs)),
      is_sampling(static_cast<size_t>(max_num_seqs)),
      num_draft_tokens(static_cast<size_t>(max_num_seqs)),
      state_slots(static_cast<size_t>(max_num_seqs)),
      has_state(static_cast<size_t>(max_num_seqs)) {
  request_ids.reserve(static_cast<size_t>(max_num_seqs));
}

StepResults::StepResults(int max_num_seqs, int max_num_batched_tokens)
    : new_token_ids(static_cast<size_t>(max_num_seqs), kNoToken),
      finish_reasons(static_cast<size_t>(max_num_seqs), 0),
      token_offsets(static_cast<size_t>(max_num_seqs) + 1, 0),
      tokens(static_cast<size_t>(max_num_batched_tokens) + static_cast<size_t>(max_num_seqs)) {}

}  // namespace pyengine
