#include "pyengine/ngram_proposer.h"

#include <algorithm>
#include <cstddef>

#include "pyengine/errors.h"

namespace pyengine {

void check_ngram_config(const NgramConfig& config) {
  check_argument(config.min_n >= 1, "ngram: prompt_lookup_min must be at least 1");
  check_argument(config.max_n >= config.min_n,
                 "ngram: prompt_lookup_max must be at least prompt_lookup_min");
  check_argument(config.max_draft >= 1, "ngram: num_speculative_tokens must be at least 1");
}

std::vector<TokenId> propose_ngram(std::span<const TokenId> tokens, const NgramConfig& config) {
  check_ngram_config(config);
  const auto size = static_cast<ptrdiff_t>(tokens.size());
  // From the longest suffix down; the most recent occurrence of each, scanned backwards
  // from the position before the suffix itself starts to repeat.
  for (ptrdiff_t n = std::min<ptrdiff_t>(config.max_n, size - 1); n >= config.min_n; --n) {
    const auto suffix = tokens.subspan(static_cast<size_t>(size - n));
    for (ptrdiff_t start = size - n - 1; start >= 0; --start) {
      if (!std::equal(suffix.begin(), suffix.end(), tokens.begin() + start)) continue;
      const ptrdiff_t from = start + n;
      const ptrdiff_t count = std::min<ptrdiff_t>(config.max_draft, size - from);
      return {tokens.begin() + from, tokens.begin() + from + count};
    }
  }
  return {};
}

}  // namespace pyengine
