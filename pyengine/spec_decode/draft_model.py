"""A draft model (method draft_model): a smaller model of the target's vocabulary (model,
a path), or the target's own first layers (draft_layers), proposes each decoding
request's drafts greedily in the worker, in the very step that verifies them
(worker/draft_runner.py); the scheduler only reserves their places."""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyengine.sampling_params import is_int
from pyengine.spec_decode.proposer import Proposer, ReadModelConfig

if TYPE_CHECKING:
    from pyengine import Scheduler
    from pyengine.config import ModelConfig
    from pyengine.spec_decode.config import SpeculativeConfig


class DraftModelProposer(Proposer):
    name = "draft_model"
    own_keys = ("model", "draft_layers")
    drafts_in_step = True

    @classmethod
    def check_config(cls, spec: SpeculativeConfig) -> None:
        model, layers = spec.model, spec.draft_layers
        if (model is None) == (layers is None):
            raise ValueError(
                "speculative_config: method draft_model needs a draft, either model (a "
                "path) or draft_layers (the target's first layers), not both"
            )
        if model is not None and (not isinstance(model, str) or not model):
            raise ValueError(f"speculative_config: model must be a path, got {model!r}")
        if layers is not None and (not is_int(layers) or layers < 1):
            raise ValueError(
                f"speculative_config: draft_layers must be a positive integer, got {layers!r}"
            )

    def check_engine(self, world_size: int, kv_offload: bool) -> None:
        if kv_offload:
            raise ValueError(
                "kv_offload_gb: the host tier does not hold a draft model's KV cache "
                "(speculative method draft_model); use another method, or no tier"
            )
        if world_size > 1:
            raise ValueError(
                "speculative_config: method draft_model runs with one worker "
                "(tensor_parallel_size and pipeline_parallel_size 1)"
            )

    def draft_token_cost(
        self, target: ModelConfig, max_model_len: int, read_config: ReadModelConfig
    ) -> float:
        """A separate draft of the target's vocabulary with max_model_len positions at
        least; its token's cost is the ratio of the models' multiply-adds a token."""
        spec = self.spec
        if spec.model is None:
            check_no_states(target, "draft_layers: the target's first layers")
            return draft_token_cost(target, target, spec.draft_layers)
        draft = read_config(spec.model)
        check_no_states(draft, f"the draft model {spec.model}")
        check_draft_vocabulary(spec.model, draft.vocab_size, target.vocab_size)
        positions = draft.max_position_embeddings
        if positions < max_model_len:
            raise ValueError(
                f"speculative_config: the draft model {spec.model} has {positions} positions, "
                f"fewer than max_model_len {max_model_len}"
            )
        return draft_token_cost(draft, target)

    def propose(self, scheduler: Scheduler) -> None:
        scheduler.reserve_draft_tokens(self.spec.num_speculative_tokens)


def check_no_states(draft: ModelConfig, what: str) -> None:
    """The draft runner keeps KV caches only: a draft with recurrent-state layers (a
    hybrid model's) is refused by name."""
    if draft.has_recurrent_layers():
        raise ValueError(
            f"speculative_config: {what} ({draft.architecture}) hold recurrent-state layers, "
            "which a draft may not have; use an attention model, or the ngram or suffix "
            "method"
        )


def check_draft_vocabulary(model: str, draft_vocab: int, target_vocab: int) -> None:
    if draft_vocab != target_vocab:
        raise ValueError(
            f"speculative_config: the draft model {model} has a vocabulary of {draft_vocab} "
            f"tokens, the target {target_vocab}: a draft needs the target's vocabulary"
        )


def draft_token_cost(draft: ModelConfig, target: ModelConfig, layers: int | None = None) -> float:
    """What a draft model's token costs it, against a one-token step of the target: the
    ratio of their multiply-adds a token (the layers' matrices and the LM head). layers:
    the draft is the first `layers` of `draft`'s."""
    return _token_macs(draft, layers) / _token_macs(target)


def _token_macs(c: ModelConfig, layers: int | None = None) -> float:
    attention = c.hidden_size * (2 * c.num_heads + 2 * c.num_kv_heads) * c.head_size
    mlp = (3 if c.hidden_act == "silu" else 2) * c.hidden_size * c.intermediate_size
    return (c.num_layers if layers is None else layers) * (attention + mlp) + (
        c.vocab_size * c.hidden_size
    )
