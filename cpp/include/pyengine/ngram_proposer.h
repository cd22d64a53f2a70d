// Prompt lookup (n-gram) proposals for speculative decoding: where a request's last n
// tokens (n from max_n down to min_n) occurred before in its tokens, prompt and output
// alike, the tokens that followed that earlier occurrence are proposed to follow again.
// Input-grounded outputs (a rewrite, a summary, an edit of given code) repeat long spans
// of their prompt, which this finds with no model at all.
#pragma once

#include <span>
#include <vector>

#include "pyengine/prefix_hash.h"

namespace pyengine {

struct NgramConfig {
  int min_n = 1;      // the shortest suffix looked up (prompt_lookup_min)
  int max_n = 4;      // the longest (prompt_lookup_max), tried first
  int max_draft = 4;  // tokens proposed at most (num_speculative_tokens)
};

// Throws InvalidArgument unless 1 <= min_n <= max_n and max_draft >= 1.
void check_ngram_config(const NgramConfig& config);

// The tokens that followed the most recent earlier occurrence of the longest suffix of
// `tokens` (max_n down to min_n tokens long) that occurred earlier, up to max_draft of
// them (fewer where the tokens end first); none where no suffix occurred before.
std::vector<TokenId> propose_ngram(std::span<const TokenId> tokens, const NgramConfig& config);

}  // namespace pyengine
