"""The values of one engine step, as the engine hands them to the executor and gets them
back: plain data (numpy arrays, lists, dataclasses) that pickle, so that workers in other
processes or on other machines take the same calls as the in-process one. The engine
builds them and the worker and sampler read them; neither side defines them, so both
import this module."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np

from pyengine.outputs import PositionLogprobs
from pyengine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pyengine.lora.request import LoRARequest


@dataclass(frozen=True)
class SamplingRow:
    """A logits row that is not the plain argmax of the model: how to choose its token
    (its request's, or one of its n samples', parameters and tokens so far)."""

    params: SamplingParams
    prompt_token_ids: Sequence[int] | np.ndarray  # the engine's: its int array, made once
    output_token_ids: Sequence[int]  # the tokens it has so far
    # A seeded request's draw for its i-th output token is seeded_uniform(seed, i), on the
    # host wherever the logits are: the same numbers on either, and the same token at each
    # place however many rows a step drew before it (speculative decoding's drafts).
    seed: int | None
    # EOS and stop tokens while under min_tokens (the engine's: an int64 array, made once)
    blocked_token_ids: Sequence[int] | np.ndarray = ()
    # A structured output's tokens allowed next: a bitmask (int32 words, bit t % 32 of
    # word t // 32 for token t); None: all. The worker sets it from the step's masks.
    allowed_tokens: np.ndarray | None = None
    # 1: the row's token drawn again, under its grammar's mask (Sampler.redraw): a seeded
    # row then takes another number of its sequence than its first draw's.
    draw: int = 0
    # The logits row follows this many of the request's drafts in the step: they count as
    # its tokens (the step's input_ids before the row's token, included, hold them; the
    # worker adds them to output_token_ids before it samples).
    num_drafts_before: int = 0
    # params.logit_bias as (token ids int64, biases float32), made once per request by the
    # engine: a step adds it in one indexed operation, whatever its size. None: from
    # params (bias_arrays).
    logit_bias: tuple[np.ndarray, np.ndarray] | None = None

    def bias_arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return self.logit_bias or logit_bias_arrays(self.params.logit_bias)


def logit_bias_arrays(bias: dict[int, float] | None) -> tuple[np.ndarray, np.ndarray]:
    """A logit_bias as (token ids, biases) arrays."""
    bias = bias or {}
    return (np.fromiter(bias.keys(), np.int64, len(bias)),
            np.fromiter(bias.values(), np.float32, len(bias)))  # fmt: skip


@dataclass(frozen=True)
class PromptLogprobRow:
    """A token row of the step whose next prompt token is scored."""

    row: int  # index into the step's tokens
    token_id: int  # the prompt token that follows it
    num_logprobs: int  # how many of the most likely tokens besides


@dataclass(frozen=True)
class SchedulerOutput:
    """One step, as Scheduler::schedule() planned it (the arrays are its StepBuffers'
    views: valid until the next schedule(); pickling copies them)."""

    input_ids: np.ndarray  # int32 [num_tokens]
    positions: np.ndarray  # int32 [num_tokens]
    # Per KV-cache group (one for a model of one attention kind; worker/kv_layout.py):
    slot_mapping: np.ndarray  # int64 [num_kv_groups, num_tokens]: block * block_size + offset
    query_start_loc: np.ndarray  # int32 [num_reqs + 1]
    seq_lens: np.ndarray  # int32 [num_reqs]: context length after this step
    block_tables: np.ndarray  # int32 [num_kv_groups, num_reqs, max_num_blocks_per_req]
    logits_indices: np.ndarray  # int32 [num_sampled]: the token rows that sample
    block_copies: list[tuple[int, int]]  # (source, destination) blocks, before the step
    # Per sampled row; None: every row is the plain argmax (the common batch).
    sampling: list[SamplingRow] | None
    prompt_logprob_rows: list[PromptLogprobRow]
    # Rows finished since the last step: workers drop what they keep for them.
    finished_row_ids: list[str]
    # Whose scheduler planned it, and so whose range of KV blocks it reads: with a
    # pipeline, each of the steps in flight has its own (vLLM's virtual engines).
    virtual_engine: int
    # The KV host tier's copies, run before block_copies: (device, host) blocks out, then
    # (host, device) blocks in.
    kv_to_host: list[tuple[int, int]] = field(default_factory=list)
    kv_to_device: list[tuple[int, int]] = field(default_factory=list)
    # With enable_lora: each request's adapter id (int64 [num_reqs], 0: the base model),
    # and the step's adapters by id (what a worker loads them from).
    adapter_ids: np.ndarray | None = None
    adapters: dict[int, LoRARequest] = field(default_factory=dict)
    # With a draft model: each request's drafts (int32 [num_reqs]), whose tokens in
    # input_ids are placeholders the worker's draft model replaces.
    num_draft_tokens: np.ndarray | None = None
    # With a draft model: a constrained request's (by index) bitmask of the tokens its
    # first draft may be (its grammar stays in the engine: its later drafts are the
    # draft's argmax, and the target's token after one its grammar refuses is never kept).
    draft_masks: dict[int, np.ndarray] = field(default_factory=dict)
    # A hybrid model's recurrent states (StepBuffers'): each request's slot and whether
    # it holds the state of its tokens before the step (int32 [num_reqs]; None: a model
    # without them), and the (source, destination) slot copies to run after the step.
    state_slots: np.ndarray | None = None
    has_state: np.ndarray | None = None
    state_copies: list[tuple[int, int]] = field(default_factory=list)
    # ... and the copies to run before it: a prefix hit's state, from its checkpoint.
    state_loads: list[tuple[int, int]] = field(default_factory=list)


@dataclass(frozen=True)
class GrammarMasks:
    """A step's structured-output masks, as sample_tokens takes them: the bitmasks of
    `masked` rows (int32 [len(masked), words]), and the `checked` rows, drawn without
    theirs (the engine asks their grammars about the tokens drawn, and has those refused
    drawn again: Executor.redraw). Rows are indices among the step's sampled rows."""

    masked: list[int]
    masks: np.ndarray
    checked: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class ExecuteOutput:
    """What the forward pass of a step gives before its tokens are sampled: the drafts
    a draft model made in the step (row after row; None: none made), and the prompt
    logprobs of its PromptLogprobRows, in order."""

    draft_token_ids: list[int] | None
    prompt_logprobs: list[PositionLogprobs]
    # The pooling runner's output, a float32 row per sampled row (None: a generating
    # runner's step)
    pooled: np.ndarray | None = None


@dataclass(frozen=True)
class SampledTokens:
    """Tokens drawn for some of a step's sampled rows (sample_tokens: all of them), and
    their logprobs where their requests asked (None where no row did)."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None] | None


@dataclass(frozen=True)
class ModelRunnerOutput:
    """A step's result as the engine core hands it on: its ExecuteOutput and its
    SampledTokens (redrawn rows' in place)."""

    sampled_token_ids: list[int]  # per sampled row
    # Per sampled row where its request asked for them; None where no row did.
    logprobs: list[PositionLogprobs | None] | None
    prompt_logprobs: list[PositionLogprobs]  # per PromptLogprobRow, in order
    pooled: np.ndarray | None = None  # the pooling runner's, a row per sampled row
