"""speculative_config, in vLLM's JSON form: {"method": ..., "num_speculative_tokens": k,
...}. Checked at start: an unknown method or key, or a count out of range, is a clear
error."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from pyengine.sampling_params import is_int, is_real
from pyengine.spec_decode.registry import PROPOSERS

MAX_SPECULATIVE_TOKENS = 16
MAX_SUFFIX_TREE_DEPTH = 64  # SuffixTree::kMaxDepth
# The most running requests a step proposes drafts for, by device: on the CPU each token
# row of a step costs compute already at a few requests, on a GPU only past dozens.
DEFAULT_DRAFTING_BATCH = {"cpu": 4, "cuda": 32}
# What one more token row costs a step, against a step of one request's one token: a
# request verifies only as many drafts as its acceptance pays for (_C.draft_budget). On
# the CPU a row is its share of the multiply-adds; a GPU's small steps are launch-bound.
DRAFT_ROW_COST = {"cpu": 0.2, "cuda": 0.02}


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 1  # ngram: the shortest suffix looked up
    prompt_lookup_max: int = 4  # ngram: the longest, tried first
    # suffix (vLLM's keys and defaults; cpp/include/pyengine/suffix_proposer.h): the
    # longest run a suffix tree holds, earlier requests' outputs kept, a proposal's length
    # against its match's, the least estimated chance of a proposal's tokens.
    suffix_decoding_max_tree_depth: int = 24
    suffix_decoding_max_cached_requests: int = 10000
    suffix_decoding_max_spec_factor: float = 1.0
    suffix_decoding_min_token_prob: float = 0.1
    # draft_model: a model with the target's vocabulary (a path, vLLM's key), or none and
    # draft_layers: the target's own first layers, its final norm and head (a
    # self-speculative draft that shares their KV cache).
    model: str | None = None
    draft_layers: int | None = None
    # No drafts in a step of more running requests than this (vLLM's name); None: the
    # device's default (DEFAULT_DRAFTING_BATCH), where a larger step is compute-bound.
    disable_by_batch_size: int | None = None

    def __post_init__(self) -> None:
        if self.method not in PROPOSERS:
            raise ValueError(
                f"speculative_config: unknown method {self.method!r} "
                f"(one of {', '.join(PROPOSERS)})"
            )
        k = self.num_speculative_tokens
        if not is_int(k) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                "speculative_config: num_speculative_tokens must be an integer in "
                f"[1, {MAX_SPECULATIVE_TOKENS}], got {k!r}"
            )
        low, high = self.prompt_lookup_min, self.prompt_lookup_max
        if not (is_int(low) and is_int(high) and 1 <= low <= high):
            raise ValueError(
                "speculative_config: prompt_lookup_min and prompt_lookup_max must be "
                f"integers with 1 <= prompt_lookup_min <= prompt_lookup_max, got {low!r} "
                f"and {high!r}"
            )
        self._check_suffix()
        self._check_method_keys()
        limit = self.disable_by_batch_size
        if limit is not None and (not is_int(limit) or limit < 1):
            raise ValueError(
                "speculative_config: disable_by_batch_size must be a positive integer, "
                f"got {limit!r}"
            )

    def _check_suffix(self) -> None:
        depth = self.suffix_decoding_max_tree_depth
        if not is_int(depth) or not 1 <= depth <= MAX_SUFFIX_TREE_DEPTH:
            raise ValueError(
                "speculative_config: suffix_decoding_max_tree_depth must be an integer in "
                f"[1, {MAX_SUFFIX_TREE_DEPTH}], got {depth!r}"
            )
        cached = self.suffix_decoding_max_cached_requests
        if not is_int(cached) or cached < 0:
            raise ValueError(
                "speculative_config: suffix_decoding_max_cached_requests must be a "
                f"non-negative integer, got {cached!r}"
            )
        factor = self.suffix_decoding_max_spec_factor
        if not is_real(factor) or not factor > 0:
            raise ValueError(
                "speculative_config: suffix_decoding_max_spec_factor must be a number above "
                f"0, got {factor!r}"
            )
        chance = self.suffix_decoding_min_token_prob
        if not is_real(chance) or not 0 <= chance <= 1:
            raise ValueError(
                "speculative_config: suffix_decoding_min_token_prob must be a number in "
                f"[0, 1], got {chance!r}"
            )

    def _check_method_keys(self) -> None:
        """Keys of another method are refused; the method checks its own."""
        for name, proposer in PROPOSERS.items():
            given = [key for key in proposer.own_keys if getattr(self, key) is not None]
            if name != self.method and given:
                raise ValueError(
                    f"speculative_config: {' and '.join(proposer.own_keys)} are method {name}'s"
                )
        PROPOSERS[self.method].check_config(self)

    def drafting_batch_size(self, max_num_seqs: int, device: str = "cpu") -> int:
        """The most running requests of a step that proposes drafts."""
        limit = self.disable_by_batch_size
        if limit is None:
            limit = DEFAULT_DRAFTING_BATCH.get(device, DEFAULT_DRAFTING_BATCH["cuda"])
        return min(limit, max_num_seqs)

    @staticmethod
    def draft_row_cost(device: str = "cpu") -> float:
        return DRAFT_ROW_COST.get(device, DRAFT_ROW_COST["cuda"])

    @classmethod
    def parse(
        cls, raw: Mapping[str, object] | SpeculativeConfig | None
    ) -> SpeculativeConfig | None:
        """The config of a speculative_config mapping (or one already made; None: none)."""
        if raw is None or isinstance(raw, SpeculativeConfig):
            return raw
        if not isinstance(raw, Mapping):
            raise ValueError(f"speculative_config must be a mapping, got {type(raw).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(
                f"speculative_config: unknown keys {unknown} (known: {', '.join(sorted(known))})"
            )
        if "method" not in raw or "num_speculative_tokens" not in raw:
            raise ValueError("speculative_config needs method and num_speculative_tokens")
        given = dict(raw)
        low = given.get("prompt_lookup_min")
        if "prompt_lookup_max" not in given and is_int(low):  # (as long a window at least)
            given["prompt_lookup_max"] = max(low, cls.prompt_lookup_max)  # type: ignore[call-overload]
        return cls(**given)  # type: ignore[arg-type]
