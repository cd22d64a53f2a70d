#include "pyengine/suffix_proposer.h"

#include <string>

#include "pyengine/errors.h"

namespace pyengine {

void check_suffix_config(const SuffixConfig& config) {
  if (config.max_tree_depth < 1 || config.max_tree_depth > SuffixTree::kMaxDepth) {
    throw InvalidArgument("suffix: suffix_decoding_max_tree_depth must be in [1, " +
                          std::to_string(SuffixTree::kMaxDepth) + "], got " +
                          std::to_string(config.max_tree_depth));
  }
  check_argument(config.max_cached_requests >= 0,
                 "suffix: suffix_decoding_max_cached_requests must not be negative");
  check_argument(config.max_spec_factor > 0.0,
                 "suffix: suffix_decoding_max_spec_factor must be above 0");
  check_argument(config.min_token_prob >= 0.0 && config.min_token_prob <= 1.0,
                 "suffix: suffix_decoding_min_token_prob must be in [0, 1]");
  check_argument(config.max_draft >= 1, "suffix: num_speculative_tokens must be at least 1");
}

SuffixProposer::SuffixProposer(const SuffixConfig& config)
    : config_(config), global_((check_suffix_config(config), config.max_tree_depth)) {}

std::vector<TokenId> SuffixProposer::propose(const std::string& id,
                                             std::span<const TokenId> tokens) {
  auto it = requests_.find(id);
  if (it == requests_.end() || tokens.size() < it->second.num_indexed) {
    // (a request's tokens only grow: fewer is another request under the same id)
    requests_.erase(id);
    it = requests_.emplace(id, RequestTree{SuffixTree(config_.max_tree_depth), {}, 0}).first;
  }
  RequestTree& own = it->second;
  for (size_t i = own.num_indexed; i < tokens.size(); ++i) own.tree.extend(own.cursor, tokens[i]);
  own.num_indexed = tokens.size();
  const SuffixConfig& c = config_;
  SuffixProposal best = own.tree.propose(tokens, c.max_draft, c.max_spec_factor, c.min_token_prob);
  if (!cached_.empty()) {
    SuffixProposal earlier =
        global_.propose(tokens, c.max_draft, c.max_spec_factor, c.min_token_prob);
    if (earlier.score > best.score) best = std::move(earlier);
  }
  return std::move(best.tokens);
}

void SuffixProposer::retire(const std::string& id, std::span<const TokenId> output) {
  requests_.erase(id);
  if (output.empty() || config_.max_cached_requests == 0) return;
  global_.add(output);
  cached_.emplace_back(output.begin(), output.end());
  while (cached_.size() > static_cast<size_t>(config_.max_cached_requests)) {
    global_.remove(cached_.front());
    cached_.pop_front();
  }
}

void SuffixProposer::clear_outputs() {
  global_ = SuffixTree(config_.max_tree_depth);
  cached_.clear();
}

}  // namespace pyengine
