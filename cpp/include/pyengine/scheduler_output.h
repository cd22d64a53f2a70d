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
  StepBuffers(int max_num_batched_tokens, int max_num_seqs, int max_blocks_per_request);

  // Capacity, fixed at construction.
  int max_num_batched_tokens;
  int max_num_seqs;
  int max_blocks_per_request;

  // Sizes of the current step.
  int num_reqs = 0;
  int num_tokens = 0;
  int num_sampled = 0;

  std::vector<int32_t> input_ids;             // [max_num_batched_tokens]
  std::vector<int32_t> positions;             // [max_num_batched_tokens]
  std::vector<int64_t> slot_mapping;          // [max_num_batched_tokens] block * block_size
                                              // + offset
  std::vector<int32_t> query_start_loc;       // [max_num_seqs + 1] prefix sums of query lengths
  std::vector<int32_t> seq_lens;              // [max_num_seqs] context length after this step
  std::vector<int32_t> block_tables;          // [max_num_seqs, max_blocks_per_request]; entries
                                              // past a request's blocks are stale
  std::vector<int32_t> logits_indices;        // [max_num_seqs] token rows that need a next token
  std::vector<int32_t> num_scheduled_tokens;  // [max_num_seqs]
  std::vector<uint8_t> is_sampling;           // [max_num_seqs]
  std::vector<std::string> request_ids;       // [num_reqs] this step's requests, in row order
  std::vector<std::pair<BlockId, BlockId>> block_copies;  // copy-on-write, run before the step
};

// What update() reports, row by row in the order of StepBuffers::request_ids.
struct StepResults {
  explicit StepResults(int max_num_seqs);

  int num_reqs = 0;
  int num_finished = 0;
  std::vector<int32_t> new_token_ids;   // [max_num_seqs] kNoToken: nothing sampled
  std::vector<uint8_t> finish_reasons;  // [max_num_seqs] a FinishReason
};

}  // namespace pyengine
