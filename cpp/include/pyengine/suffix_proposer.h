// Suffix decoding's proposals (speculative decoding without a model): each request's own
// tokens (prompt and output) in a suffix tree of its own, and the outputs of the requests
// that finished before it in one global tree, bounded to the most recent
// max_cached_requests. A request is proposed the better of the two trees' proposals to
// follow its tokens (SuffixTree::propose): its own tree finds what its prompt repeats,
// the global one what earlier answers to like prompts said (agents' loops, templates).
#pragma once

#include <deque>
#include <span>
#include <string>
#include <unordered_map>
#include <vector>

#include "pyengine/suffix_tree.h"

namespace pyengine {

// vLLM's suffix_decoding_* keys, and its defaults.
struct SuffixConfig {
  int max_tree_depth = 24;          // the longest run a tree holds: match and proposal
  int max_cached_requests = 10000;  // finished outputs the global tree holds (0: none)
  double max_spec_factor = 1.0;     // a proposal of at most this times its match's length
  double min_token_prob = 0.1;      // the least estimated chance of a proposal's tokens
  int max_draft = 4;                // tokens proposed at most (num_speculative_tokens)
};

// Throws InvalidArgument on a depth outside [1, SuffixTree::kMaxDepth], a negative cache
// size, a factor not above 0, a probability outside [0, 1] or max_draft below 1.
void check_suffix_config(const SuffixConfig& config);

class SuffixProposer {
 public:
  explicit SuffixProposer(const SuffixConfig& config);

  const SuffixConfig& config() const { return config_; }

  // The proposal to follow request `id`'s tokens (prompt, then output); its tree takes
  // the tokens it gained since the last call first (a request seen first is indexed
  // whole). Empty where neither tree matches.
  std::vector<TokenId> propose(const std::string& id, std::span<const TokenId> tokens);
  // Request `id` ended: its tree goes, and where `output` is not empty it joins the
  // global tree (the oldest output leaving it past max_cached_requests).
  void retire(const std::string& id, std::span<const TokenId> output);
  // Empties the global tree (what the requests running now index stays).
  void clear_outputs();

  size_t num_request_trees() const { return requests_.size(); }
  size_t num_cached_outputs() const { return cached_.size(); }
  size_t num_global_nodes() const { return global_.num_nodes(); }

 private:
  struct RequestTree {
    SuffixTree tree;
    SuffixTree::Cursor cursor;
    size_t num_indexed = 0;  // of its tokens, those the tree holds
  };

  SuffixConfig config_;
  std::unordered_map<std::string, RequestTree> requests_;
  SuffixTree global_;
  std::deque<std::vector<TokenId>> cached_;  // the global tree's outputs, oldest first
};

}  // namespace pyengine
