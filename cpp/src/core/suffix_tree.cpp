#include "pyengine/suffix_tree.h"

#include <algorithm>
#include <cmath>
#include <string>

#include "pyengine/errors.h"

namespace pyengine {

SuffixTree::SuffixTree(int max_depth) : max_depth_(max_depth), nodes_(1) {
  if (max_depth < 1 || max_depth > kMaxDepth) {
    throw InvalidArgument("suffix tree: max_depth must be in [1, " + std::to_string(kMaxDepth) +
                          "], got " + std::to_string(max_depth));
  }
}

int32_t SuffixTree::child(int32_t node, TokenId token) const {
  const auto it = edges_.find(edge_key(node, token));
  return it == edges_.end() ? -1 : it->second;
}

int32_t SuffixTree::count_child(int32_t node, TokenId token) {
  const auto [edge, made] = edges_.try_emplace(edge_key(node, token), -1);
  if (made) {
    int32_t index;
    if (free_.empty()) {
      index = static_cast<int32_t>(nodes_.size());
      nodes_.emplace_back();
    } else {
      index = free_.back();
      free_.pop_back();
    }
    Node& made_node = nodes_[static_cast<size_t>(index)];
    made_node = Node{};
    made_node.parent = node;
    made_node.token = token;
    made_node.depth = nodes_[static_cast<size_t>(node)].depth + 1;
    made_node.next_sibling = nodes_[static_cast<size_t>(node)].first_child;
    nodes_[static_cast<size_t>(node)].first_child = index;
    edge->second = index;
  }
  const int32_t c = edge->second;
  const int32_t count = ++nodes_[static_cast<size_t>(c)].count;
  int32_t& best = nodes_[static_cast<size_t>(node)].best_child;
  if (best < 0 || count > nodes_[static_cast<size_t>(best)].count) best = c;
  return c;
}

void SuffixTree::extend(Cursor& cursor, TokenId token) {
  std::vector<int32_t> open;
  open.reserve(cursor.open.size() + 1);
  // The run of this token alone, then each open run one longer (shortest first).
  const int32_t alone = count_child(0, token);
  if (max_depth_ > 1) open.push_back(alone);
  for (const int32_t node : cursor.open) {
    const int32_t longer = count_child(node, token);
    if (nodes_[static_cast<size_t>(longer)].depth < max_depth_) open.push_back(longer);
  }
  cursor.open = std::move(open);
}

void SuffixTree::add(std::span<const TokenId> tokens) {
  Cursor cursor;
  for (const TokenId t : tokens) extend(cursor, t);
}

void SuffixTree::refresh_best_child(int32_t node) {
  int32_t best = -1;
  for (int32_t c = nodes_[static_cast<size_t>(node)].first_child; c >= 0;
       c = nodes_[static_cast<size_t>(c)].next_sibling) {
    if (best < 0 ||
        nodes_[static_cast<size_t>(c)].count > nodes_[static_cast<size_t>(best)].count) {
      best = c;
    }
  }
  nodes_[static_cast<size_t>(node)].best_child = best;
}

void SuffixTree::unlink(int32_t node) {
  const Node gone = nodes_[static_cast<size_t>(node)];
  Node& parent = nodes_[static_cast<size_t>(gone.parent)];
  if (parent.first_child == node) {
    parent.first_child = gone.next_sibling;
  } else {
    int32_t c = parent.first_child;
    while (nodes_[static_cast<size_t>(c)].next_sibling != node) {
      c = nodes_[static_cast<size_t>(c)].next_sibling;
    }
    nodes_[static_cast<size_t>(c)].next_sibling = gone.next_sibling;
  }
  edges_.erase(edge_key(gone.parent, gone.token));
  nodes_[static_cast<size_t>(node)] = Node{};
  free_.push_back(node);
}

void SuffixTree::uncount(int32_t node) {
  const int32_t parent = nodes_[static_cast<size_t>(node)].parent;
  const bool was_best = nodes_[static_cast<size_t>(parent)].best_child == node;
  const bool gone = --nodes_[static_cast<size_t>(node)].count == 0;
  if (gone) unlink(node);
  if (!was_best) return;
  // The root's best child is never read (a proposal follows a match of one token at
  // least), and the root may have a child for every token: it is not searched again.
  if (parent != 0) {
    refresh_best_child(parent);
  } else if (gone) {
    nodes_[0].best_child = -1;
  }
}

void SuffixTree::remove(std::span<const TokenId> tokens) {
  // Every run must be here before anything changes.
  const size_t depth = static_cast<size_t>(max_depth_);
  std::vector<std::vector<int32_t>> paths(tokens.size());
  for (size_t start = 0; start < tokens.size(); ++start) {
    int32_t node = 0;
    for (size_t i = start; i < std::min(tokens.size(), start + depth); ++i) {
      node = child(node, tokens[i]);
      if (node < 0 || nodes_[static_cast<size_t>(node)].count < 1) {
        throw InvalidArgument("suffix tree: remove() of tokens the tree does not hold");
      }
      paths[start].push_back(node);
    }
  }
  // Deepest first, so that a run's node goes after the runs that extend it.
  for (auto& path : paths) {
    for (auto it = path.rbegin(); it != path.rend(); ++it) uncount(*it);
  }
}

int SuffixTree::occurrences(std::span<const TokenId> run) const {
  if (run.empty() || static_cast<int>(run.size()) > max_depth_) return 0;
  int32_t node = 0;
  for (const TokenId t : run) {
    node = child(node, t);
    if (node < 0) return 0;
  }
  return nodes_[static_cast<size_t>(node)].count;
}

SuffixProposal SuffixTree::propose(std::span<const TokenId> context, int max_tokens,
                                   double max_spec_factor, double min_token_prob) const {
  SuffixProposal best;
  const int longest = std::min(static_cast<int>(context.size()), max_depth_ - 1);
  for (int m = 1; m <= longest; ++m) {
    int32_t node = 0;
    for (size_t i = context.size() - static_cast<size_t>(m); i < context.size() && node >= 0; ++i) {
      node = child(node, context[i]);
    }
    // A run not held means no longer run ending the same way is held either.
    if (node < 0) break;
    const int limit =
        std::min(max_tokens, static_cast<int>(std::floor(max_spec_factor * m + 1e-9)));
    SuffixProposal here;
    here.match_length = m;
    double chance = 1.0;
    while (static_cast<int>(here.tokens.size()) < limit) {
      const Node& at = nodes_[static_cast<size_t>(node)];
      if (at.best_child < 0) break;
      const Node& next = nodes_[static_cast<size_t>(at.best_child)];
      chance *= static_cast<double>(next.count) / at.count;
      if (chance < min_token_prob) break;
      here.tokens.push_back(next.token);
      here.score += chance;
      node = at.best_child;
    }
    if (!here.tokens.empty() && here.score >= best.score) best = std::move(here);
  }
  return best;
}

}  // namespace pyengine
