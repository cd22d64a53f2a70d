// The flat inputs of one engine step, written by Scheduler::schedule() into buffers
// allocated once, so that Python can view them as numpy arrays without a copy.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "pyengine/block_pool.h"
#include "pyengine/request.h"

namespace pyengine {

struct StepBuffers {
  StepBuffers(int max_num_batched_tokens, int max_num_seqs, int max_blocks_per_request,
              int num_kv_groups = 1);

  // Capacity, fixed at construction.
  int max_num_batched_tokens;
  int max_num_seqs;
  int max_blocks_per_request;
  int num_kv_groups;  // slot_mapping and block_tables hold one array per group, group 0 first

  // Sizes of the current step.
  int num_reqs = 0;
  int num_tokens = 0;
  int num_sampled = 0;

  std::vector<int32_t> input_ids;             // [max_num_batched_tokens]
  std::vector<int32_t> positions;             // [max_num_batched_tokens]
  std::vector<int64_t> slot_mapping;          // [num_kv_groups, max_num_batched_tokens]
                                              // block * block_size + offset
  std::vector<int32_t> query_start_loc;       // [max_num_seqs + 1] prefix sums of query lengths
  std::vector<int32_t> seq_lens;              // [max_num_seqs] context length after this step
  std::vector<int32_t> block_tables;          // [num_kv_groups, max_num_seqs,
                                              // max_blocks_per_request]; entries past a
                                              // request's blocks are stale, kNoBlock where
                                              // a window released one
  std::vector<int32_t> logits_indices;        // [max_num_batched_tokens + max_num_seqs] token
                                              // rows that need a next token (a request's
                                              // last, then one per draft token)
  std::vector<int32_t> num_scheduled_tokens;  // [max_num_seqs] draft tokens included
  std::vector<uint8_t> is_sampling;           // [max_num_seqs]
  std::vector<int32_t> num_draft_tokens;      // [max_num_seqs] scheduled after its last token
  // A hybrid model's recurrent states (KVCacheConfig::num_state_slots > 0): each
  // request's slot (-1 without states), and whether the slot holds the state of the
  // tokens before the step's (1) or is new, read as zeros (0).
  std::vector<int32_t> state_slots;           // [max_num_seqs]
  std::vector<int32_t> has_state;             // [max_num_seqs]
  std::vector<std::string> request_ids;       // [num_reqs] this step's requests, in row order
  // Run before the step, in this order: the copies between the KV tiers (all of
  // to_host, then all of to_device), then copy-on-write.
  KVTransfers kv_transfers;
  std::vector<std::pair<BlockId, BlockId>> block_copies;  // copy-on-write
  // State-slot copies (src, dst) to run after the step's forward pass, before the next
  // step's: a sample forked in this step starts from its parent's state, which this
  // step's last prompt tokens complete (unlike KV blocks, a state is not shared).
  std::vector<std::pair<int, int>> state_copies;
  // State-slot copies (src, dst) to run before the step's forward pass: a prefix hit's
  // recurrent state, from the checkpoint it resumes from (KVCacheConfig::
  // num_state_checkpoints).
  std::vector<std::pair<int, int>> state_loads;
};

// What update() reports, row by row in the order of StepBuffers::request_ids.
struct StepResults {
  StepResults(int max_num_seqs, int max_num_batched_tokens);

  int num_reqs = 0;
  int num_finished = 0;
  std::vector<int32_t> new_token_ids;   // [max_num_seqs] the first new token; kNoToken: none
  std::vector<uint8_t> finish_reasons;  // [max_num_seqs] a FinishReason
  // Every row's new tokens (more than one where draft tokens were accepted): row i's are
  // tokens[token_offsets[i] .. token_offsets[i + 1]).
  std::vector<int32_t> token_offsets;  // [max_num_seqs + 1]
  std::vector<TokenId> tokens;         // [max_num_batched_tokens + max_num_seqs]
};

}  // namespace pyengine
