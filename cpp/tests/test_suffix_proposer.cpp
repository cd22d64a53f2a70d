// Suffix decoding: the tree's counts against a brute-force count of runs, its proposals
// against the rule (a worked example, and the rule's parts checked on random sequences),
// remove() taking back exactly what add() put in; the proposer's global tree of earlier
// outputs, bounded to max_cached_requests; through the scheduler, proposals to decoding
// requests and every finished output cached, no aborted one, no tree left behind.
#include <algorithm>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "harness.h"
#include "pyengine/errors.h"
#include "pyengine/scheduler.h"
#include "pyengine/suffix_proposer.h"
#include "pyengine/suffix_tree.h"
#include "scheduler_testing.h"

using namespace pyengine;

namespace {

using Tokens = std::vector<TokenId>;

// Places `run` occurs in any of `sequences` (runs longer than `depth` are not held).
int brute_count(const std::vector<Tokens>& sequences, const Tokens& run, int depth) {
  if (run.empty() || static_cast<int>(run.size()) > depth) return 0;
  int count = 0;
  for (const Tokens& s : sequences) {
    for (size_t i = 0; i + run.size() <= s.size(); ++i) {
      count += std::equal(run.begin(), run.end(), s.begin() + static_cast<ptrdiff_t>(i)) ? 1 : 0;
    }
  }
  return count;
}

Tokens random_tokens(std::mt19937& rng, size_t n, int vocab) {
  std::uniform_int_distribution<int> token(0, vocab - 1);
  Tokens tokens(n);
  for (TokenId& t : tokens) t = token(rng);
  return tokens;
}

// Every run of `sequences` up to `depth` tokens, and a few that are not there.
void check_counts(const SuffixTree& tree, const std::vector<Tokens>& sequences, int depth,
                  std::mt19937& rng, int vocab) {
  for (const Tokens& s : sequences) {
    for (size_t i = 0; i < s.size(); ++i) {
      for (size_t n = 1; n <= static_cast<size_t>(depth) && i + n <= s.size(); ++n) {
        const Tokens run(s.begin() + static_cast<ptrdiff_t>(i),
                         s.begin() + static_cast<ptrdiff_t>(i + n));
        CHECK_EQ(tree.occurrences(run), brute_count(sequences, run, depth));
      }
    }
  }
  for (int k = 0; k < 50; ++k) {
    const Tokens run = random_tokens(rng, 1 + rng() % 4, vocab + 2);
    CHECK_EQ(tree.occurrences(run), brute_count(sequences, run, depth));
  }
}

}  // namespace

TEST(the_trees_counts_are_the_runs_occurrences) {
  std::mt19937 rng(7);
  for (const int depth : {1, 3, 8}) {
    SuffixTree tree(depth);
    std::vector<Tokens> held;
    for (int k = 0; k < 4; ++k) {
      held.push_back(random_tokens(rng, 30, 4));
      tree.add(held.back());
    }
    SuffixTree::Cursor cursor;  // a fifth sequence, a token at a time
    held.emplace_back();
    for (const TokenId t : random_tokens(rng, 25, 4)) {
      tree.extend(cursor, t);
      held.back().push_back(t);
    }
    check_counts(tree, held, depth, rng, 4);
  }
}

TEST(remove_takes_back_exactly_what_add_put_in) {
  std::mt19937 rng(11);
  SuffixTree tree(6);
  SuffixTree only_kept(6);
  std::vector<Tokens> kept;
  std::vector<Tokens> all;
  for (int k = 0; k < 6; ++k) {
    all.push_back(random_tokens(rng, 20 + 5 * static_cast<size_t>(k), 5));
    tree.add(all.back());
    if (k % 2 == 1) {
      kept.push_back(all.back());
      only_kept.add(all.back());
    }
  }
  for (size_t k = 0; k < all.size(); k += 2) tree.remove(all[k]);
  check_counts(tree, kept, 6, rng, 5);
  CHECK_EQ(tree.num_nodes(), only_kept.num_nodes());
  for (const Tokens& s : kept) tree.remove(s);
  CHECK_EQ(tree.num_nodes(), size_t{0});
  // Freed nodes are taken again.
  tree.add(kept[0]);
  check_counts(tree, {kept[0]}, 6, rng, 5);
  CHECK_THROWS(InvalidArgument, tree.remove(Tokens{9, 9, 9}));
  CHECK_EQ(tree.occurrences(Tokens{kept[0][0]}), brute_count({kept[0]}, {kept[0][0]}, 6));
}

TEST(a_worked_proposal) {
  // "1 2" occurs 4 times, "1 2 3 4 1 2" twice (at 0 and 8), once followed (by 3 5 1 2).
  const Tokens tokens = {1, 2, 3, 4, 1, 2, 3, 5, 1, 2, 3, 4, 1, 2};
  SuffixTree tree(24);
  tree.add(tokens);
  // m = 2 proposes 3 (3 of 4 times), then 4 (2 of 3): 0.75 + 0.5. The matches of 4, 5
  // and 6 tokens propose 3 5 1 2, each at a half: 2.0, the longest match winning the tie.
  const SuffixProposal p = tree.propose(tokens, 4, 1.0, 0.1);
  CHECK((p.tokens == Tokens{3, 5, 1, 2}));
  CHECK(std::abs(p.score - 2.0) < 1e-12);
  CHECK_EQ(p.match_length, 6);
  // A proposal is at most max_spec_factor times its match: 0.5 allows m = 2 one token.
  const SuffixProposal shorter = tree.propose(Tokens{7, 1, 2}, 4, 1.0, 0.1);
  CHECK((shorter.tokens == Tokens{3, 4}));
  CHECK(std::abs(shorter.score - 1.25) < 1e-12);
  const SuffixProposal halved = tree.propose(Tokens{7, 1, 2}, 4, 0.5, 0.1);
  CHECK((halved.tokens == Tokens{3}));
  // min_token_prob stops a proposal once its chance falls below it.
  CHECK((tree.propose(Tokens{7, 1, 2}, 4, 1.0, 0.6).tokens == Tokens{3}));
  CHECK(tree.propose(Tokens{7, 1, 2}, 4, 1.0, 0.8).tokens.empty());
  CHECK(tree.propose(Tokens{8}, 4, 1.0, 0.1).tokens.empty());  // no match
  CHECK(tree.propose(Tokens{}, 4, 1.0, 0.1).tokens.empty());
}

TEST(random_proposals_follow_the_rule) {
  std::mt19937 rng(5);
  const int depth = 10;
  for (int trial = 0; trial < 30; ++trial) {
    const Tokens seq = random_tokens(rng, 60, 3);
    SuffixTree tree(depth);
    tree.add(seq);
    const Tokens context = random_tokens(rng, 12, 3);
    const double min_prob = 0.05 * (trial % 5);
    const SuffixProposal p = tree.propose(context, 5, 1.0, min_prob);
    if (p.tokens.empty()) continue;
    const auto m = static_cast<size_t>(p.match_length);
    CHECK(m >= 1 && m < static_cast<size_t>(depth));
    CHECK(p.tokens.size() <= std::min<size_t>(5, m));
    Tokens run(context.end() - static_cast<ptrdiff_t>(m), context.end());
    double chance = 1.0;
    double score = 0.0;
    for (const TokenId t : p.tokens) {
      // The most frequent next token, its share of the run's places in the chance.
      int most = 0;
      for (TokenId other = 0; other < 3; ++other) {
        Tokens next = run;
        next.push_back(other);
        most = std::max(most, brute_count({seq}, next, depth));
      }
      Tokens next = run;
      next.push_back(t);
      const int count = brute_count({seq}, next, depth);
      CHECK_EQ(count, most);
      chance *= static_cast<double>(count) / brute_count({seq}, run, depth);
      CHECK(chance >= min_prob);
      score += chance;
      run = next;
    }
    CHECK(std::abs(score - p.score) < 1e-9);
  }
}

TEST(the_global_tree_proposes_earlier_outputs_and_keeps_the_latest) {
  SuffixConfig config;
  config.max_cached_requests = 2;
  config.max_draft = 3;
  SuffixProposer proposer(config);
  // A request whose own tokens never repeat: nothing of its own to propose.
  CHECK(proposer.propose("a", Tokens{1, 2, 3}).empty());
  CHECK_EQ(proposer.num_request_trees(), size_t{1});
  proposer.retire("a", Tokens{10, 11, 12, 13, 14});
  CHECK_EQ(proposer.num_request_trees(), size_t{0});
  // "b" ends as "a"'s output began: the global tree proposes what followed.
  CHECK((proposer.propose("b", Tokens{5, 6, 10, 11}) == Tokens{12, 13}));  // (2 = m tokens)
  CHECK((proposer.propose("b", Tokens{5, 6, 10, 11, 12}) == Tokens{13, 14}));
  proposer.retire("b", {});  // (aborted: nothing cached)
  CHECK_EQ(proposer.num_cached_outputs(), size_t{1});
  proposer.retire("c", Tokens{20, 21, 22});
  proposer.retire("d", Tokens{30, 31, 32});  // "a"'s output leaves
  CHECK_EQ(proposer.num_cached_outputs(), size_t{2});
  CHECK(proposer.propose("e", Tokens{10, 11}).empty());
  CHECK((proposer.propose("e", Tokens{10, 11, 30}) == Tokens{31}));
  SuffixTree latest(config.max_tree_depth);
  latest.add(Tokens{20, 21, 22});
  latest.add(Tokens{30, 31, 32});
  CHECK_EQ(proposer.num_global_nodes(), latest.num_nodes());
  proposer.clear_outputs();
  CHECK_EQ(proposer.num_cached_outputs(), size_t{0});
  CHECK_EQ(proposer.num_global_nodes(), size_t{0});
  CHECK(proposer.propose("e", Tokens{10, 11, 30}).empty());
}

TEST(bad_configs_are_refused) {
  const auto refused = [](auto change) {
    SuffixConfig config;
    change(config);
    CHECK_THROWS(InvalidArgument, SuffixProposer{config});
  };
  refused([](SuffixConfig& c) { c.max_tree_depth = 0; });
  refused([](SuffixConfig& c) { c.max_tree_depth = SuffixTree::kMaxDepth + 1; });
  refused([](SuffixConfig& c) { c.max_cached_requests = -1; });
  refused([](SuffixConfig& c) { c.max_spec_factor = 0.0; });
  refused([](SuffixConfig& c) { c.min_token_prob = 1.5; });
  refused([](SuffixConfig& c) { c.max_draft = 0; });
}

TEST(the_scheduler_proposes_from_its_requests_and_caches_their_outputs) {
  Scheduler s = testing::make_scheduler(32, 8);
  CHECK_THROWS(InvalidState, s.propose_suffix_drafts());
  SuffixConfig config;
  config.max_draft = 2;
  s.enable_suffix_drafts(config);
  CHECK_THROWS(InvalidState, s.enable_suffix_drafts(config));
  RequestParams params;
  params.max_tokens = 4;
  params.speculate = true;
  s.add_request("a", Tokens{3, 4, 5, 6, 3, 4}, params);
  s.schedule();
  const TokenId five[] = {5};
  s.update(five);  // 3 4 5 6 3 4 5: "3 4 5" was followed by 6 3
  CHECK_EQ(s.propose_suffix_drafts(), 1);
  s.schedule();
  CHECK_EQ(s.buffers().num_draft_tokens[0], 2);
  CHECK_EQ(s.buffers().input_ids[1], 6);
  CHECK_EQ(s.buffers().input_ids[2], 3);
  const TokenId tokens[] = {6, 3, 4};
  const int32_t counts[] = {3};  // both accepted, then 4: max_tokens
  CHECK_EQ(s.update(tokens, counts), 1);
  CHECK_EQ(s.suffix_proposer()->num_cached_outputs(), size_t{1});
  CHECK_EQ(s.suffix_proposer()->num_request_trees(), size_t{0});
  // An aborted request's output is not cached; its tree goes.
  s.add_request("b", Tokens{7, 8, 7}, params);
  s.schedule();
  const TokenId eight[] = {8};
  s.update(eight);
  CHECK_EQ(s.propose_suffix_drafts(), 1);
  s.abort_request("b");
  CHECK_EQ(s.suffix_proposer()->num_cached_outputs(), size_t{1});
  CHECK_EQ(s.suffix_proposer()->num_request_trees(), size_t{0});
  CHECK_EQ(s.kv_cache().num_free_blocks(), 32);
}

TEST_MAIN()
