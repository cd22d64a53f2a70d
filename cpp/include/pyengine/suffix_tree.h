// A suffix tree of bounded depth over token sequences, with counts (suffix decoding,
// Arctic Inference): every path from the root is a run of tokens, at most max_depth long,
// that occurred in the sequences it holds, and each node counts the places it occurred.
// A proposal follows the longest runs that end the way a request's tokens end: from the
// node of such a match, the most frequent next token while the frequencies' product, an
// estimate of the chance that all are right, stays above a floor.
//
// Each token a sequence gains adds at most max_depth nodes (the runs that end with it),
// so a tree is bounded by max_depth nodes a token it holds; removing a sequence takes its
// nodes back.
#pragma once

#include <cstdint>
#include <span>
#include <unordered_map>
#include <vector>

#include "pyengine/prefix_hash.h"

namespace pyengine {

struct SuffixProposal {
  std::vector<TokenId> tokens;
  double score = 0.0;  // the tokens' expected number accepted: their chances' partial products
  int match_length = 0;
};

class SuffixTree {
 public:
  // A sequence that grows a token at a time (extend): the nodes of its runs that end at
  // its last token and are shorter than max_depth, shortest first.
  struct Cursor {
    std::vector<int32_t> open;
  };

  // Throws InvalidArgument unless 1 <= max_depth <= kMaxDepth.
  explicit SuffixTree(int max_depth);
  static constexpr int kMaxDepth = 64;

  int max_depth() const { return max_depth_; }
  // Nodes besides the root.
  size_t num_nodes() const { return nodes_.size() - 1 - free_.size(); }

  // Adds one token to the end of the cursor's sequence: each of its runs that ends with
  // that token occurred once more.
  void extend(Cursor& cursor, TokenId token);
  // Adds a whole sequence (its runs, from every place), as extend() token by token.
  void add(std::span<const TokenId> tokens);
  // Takes back a sequence add() put in (the same tokens); nodes left with no occurrence go.
  void remove(std::span<const TokenId> tokens);

  // The places `run` occurred in the sequences held (0 where it is longer than max_depth).
  int occurrences(std::span<const TokenId> run) const;

  // The best proposal to follow `context` of at most max_tokens tokens: for each match of
  // context's last m tokens (m < max_depth), the most frequent continuation, at most
  // max_spec_factor * m tokens long, each next token's share of its node's occurrences
  // multiplied into a chance that stops it below min_token_prob; the proposal with the
  // highest score wins (the longer match on a tie). Empty where nothing matches.
  SuffixProposal propose(std::span<const TokenId> context, int max_tokens, double max_spec_factor,
                         double min_token_prob) const;

 private:
  struct Node {
    int32_t count = 0;  // places the run occurred
    int32_t parent = -1;
    int32_t best_child = -1;  // the most frequent child (one of them)
    int32_t first_child = -1;
    int32_t next_sibling = -1;
    TokenId token = 0;
    int32_t depth = 0;
  };

  static uint64_t edge_key(int32_t node, TokenId token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(node)) << 32) |
           static_cast<uint32_t>(token);
  }
  int32_t child(int32_t node, TokenId token) const;
  // The child for `token`, made where there is none, its count one more.
  int32_t count_child(int32_t node, TokenId token);
  void uncount(int32_t node);
  void unlink(int32_t node);
  void refresh_best_child(int32_t node);

  int max_depth_;
  std::vector<Node> nodes_;  // [0]: the root
  std::vector<int32_t> free_;
  std::unordered_map<uint64_t, int32_t> edges_;  // (node, token) -> child
};

}  // namespace pyengine
