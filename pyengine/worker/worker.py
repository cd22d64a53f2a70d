"""A worker: one device, its place in the tensor-parallel group and the pipeline, the
model runner (the model's shard and its shard of the KV cache) and the sampler. It runs
a step in one direction, as the engine calls it: execute_model (the forward pass, from a
SchedulerOutput), sample_tokens (with the engine's grammar masks), and redraw where a
grammar refused a checked row's token; it knows nothing of requests' text. Of the ranks,
one returns the tokens: tensor-parallel rank 0 of the last stage (the output rank); the
others return None."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from pyengine.config import EngineConfig
from pyengine.distributed import PipelineStage, TensorParallelGroup
from pyengine.loader.resolve import LoadedModel
from pyengine.outputs import PositionLogprobs
from pyengine.sample.logprobs import gather_logprobs
from pyengine.sample.sampler import Redraws, Sampler
from pyengine.spec_decode.registry import PROPOSERS
from pyengine.step_values import (
    ExecuteOutput,
    GrammarMasks,
    PromptLogprobRow,
    SampledTokens,
    SamplingRow,
    SchedulerOutput,
)
from pyengine.worker.draft_runner import DraftRunner
from pyengine.worker.model_runner import ModelRunner


class Worker:
    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        tp: TensorParallelGroup | None = None,
        pp: PipelineStage | None = None,
    ) -> None:
        self.config = config
        self.tp = tp or TensorParallelGroup()
        self.pp = pp or PipelineStage()
        self.is_output_rank = self.pp.is_last and self.tp.rank == 0
        self.model_runner = ModelRunner(loaded, config, self.tp, self.pp)
        spec = config.speculative
        self.drafter: DraftRunner | None = None
        if spec is not None and PROPOSERS[spec.method].drafts_in_step:
            self.drafter = DraftRunner(spec, self.model_runner, config)
            self.model_runner.share_kv_budget(self.drafter.block_bytes, self.drafter.weight_bytes)
        self.sampler = Sampler(config.seed, config.device)
        # By virtual engine: a step's logits between execute_model and sample_tokens, and
        # its checked rows' between sample_tokens and redraw.
        self._executed: dict[int, tuple[SchedulerOutput, torch.Tensor | None]] = {}
        self._redraws: dict[int, Redraws] = {}

    @property
    def num_blocks(self) -> int:
        """KV-cache blocks this worker's memory holds (then, once initialize_cache ran,
        those it allocated)."""
        return self.model_runner.num_blocks

    @property
    def num_host_blocks(self) -> int:
        """Blocks of the KV cache's host tier this worker's kv_offload_gb holds."""
        return self.model_runner.num_host_blocks

    def initialize_cache(
        self, num_blocks: int, num_virtual_engines: int = 1, num_host_blocks: int = 0
    ) -> None:
        self.model_runner.initialize_cache(num_blocks, num_virtual_engines, num_host_blocks)
        if self.drafter is not None:
            self.drafter.initialize_cache(num_blocks)

    def describe(self) -> dict[str, Any]:
        """This worker's layers, kv heads and memory: the weights (every form the linear
        methods keep), and the KV cache (its blocks and their bytes)."""
        runner = self.model_runner
        model = runner.model
        return {
            "layers": (model.start_layer, model.end_layer),
            "kv_heads": runner.num_kv_heads,
            "num_blocks": runner.num_blocks,
            "num_host_blocks": runner.num_host_blocks,
            "num_state_slots": runner.num_state_slots,
            "num_state_checkpoints": runner.num_state_checkpoints,
            "block_bytes": runner.block_bytes,
            "kv_groups": [list(group) for group in runner.kv_layout.groups],
            "num_parameters": model.num_parameters,
            "weight_bytes": runner.weight_bytes,
        }

    def shutdown(self) -> None:
        """Frees the model, the KV cache and the CUDA graphs; the worker runs no more
        steps."""
        device = self.model_runner.placement.device
        del self.model_runner
        if device.type == "cuda":
            torch.cuda.empty_cache()

    def execute_model(self, step: SchedulerOutput) -> ExecuteOutput | None:
        """Runs the step's forward pass (its draft model's first, where it has one); the
        output rank keeps the logits for sample_tokens and returns the step's drafts and
        prompt logprobs, the other ranks None."""
        drafts = None
        if self.drafter is not None:  # (its drafts fill the step's placeholders)
            step, drafts = self.drafter.propose(step)
        scored_rows = [r.row for r in step.prompt_logprob_rows]
        logits, hidden = self.model_runner.execute(step, scored_rows)
        if logits is None:  # a stage before the last: its output went on
            return None
        if self.model_runner.pooler is not None:
            return self._pooled(step, logits)
        prompt_logprobs = [] if hidden is None else self._score_prompts(step, hidden)
        if not self.is_output_rank:  # the logits' collectives ran; the tokens are rank 0's
            return None
        self._executed[step.virtual_engine] = (step, logits)
        return ExecuteOutput(drafts, prompt_logprobs)

    def _pooled(self, step: SchedulerOutput, pooled: torch.Tensor) -> ExecuteOutput | None:
        """A pooling runner's step: its pooled rows go back in place of logits, and its
        sampled rows each take token 0, which ends their one-token requests."""
        if not self.is_output_rank:
            return None
        self._executed[step.virtual_engine] = (step, None)
        return ExecuteOutput(None, [], pooled.cpu().numpy())

    def sample_tokens(
        self, virtual_engine: int, masks: GrammarMasks | None = None
    ) -> SampledTokens | None:
        """The tokens of the step virtual_engine executed last, its constrained rows
        masked (`masks`: the engine's), or drawn without their masks where checked (kept
        for redraw)."""
        if not self.is_output_rank:
            return None
        self._redraws.pop(virtual_engine, None)  # (the last step's, none refused)
        step, logits = self._executed.pop(virtual_engine)
        if logits is None:  # (a pooling step's)
            return SampledTokens([0] * len(step.logits_indices), None)
        if step.sampling is None:
            sampled = self.sampler.argmax(logits)
        else:
            rows = [self._row(r, step.input_ids, int(t))
                    for r, t in zip(step.sampling, step.logits_indices, strict=True)]  # fmt: skip
            checked: list[int] = []
            if masks is not None:
                for mask, i in zip(masks.masks, masks.masked, strict=True):
                    rows[i] = replace(rows[i], allowed_tokens=mask)
                checked = masks.checked
            sampled = self.sampler(logits, rows, checked)
        if sampled.redraws is not None:
            self._redraws[virtual_engine] = sampled.redraws
        return SampledTokens(sampled.token_ids, sampled.logprobs)

    def redraw(
        self, virtual_engine: int, rows: list[int], masks: np.ndarray
    ) -> SampledTokens | None:
        """The tokens of checked `rows` of the step virtual_engine sampled last, whose
        grammars refused their first draw, drawn again under their masks."""
        if not self.is_output_rank:
            return None
        sampled = self.sampler.redraw(self._redraws.pop(virtual_engine), rows, masks)
        return SampledTokens(sampled.token_ids, sampled.logprobs)

    @staticmethod
    def _row(row: SamplingRow, input_ids: np.ndarray, token: int) -> SamplingRow:
        """The row for the logits of token row `token` of the step, its drafts before it
        among its tokens."""
        if not (j := row.num_drafts_before):
            return row
        drafts = input_ids[token - j + 1 : token + 1].tolist()  # (its token is its j-th)
        return replace(row, output_token_ids=[*row.output_token_ids, *drafts], num_drafts_before=0)

    def _score_prompts(self, step: SchedulerOutput, hidden: torch.Tensor) -> list[PositionLogprobs]:
        """Prompt logprobs from the final hidden states of the scored rows, max_num_seqs
        rows at a time, so that a long prompt's logits never exist whole (8192 rows of a
        128k vocabulary would be 4 GB in float32)."""
        rows: list[PromptLogprobRow] = step.prompt_logprob_rows
        entries: list[PositionLogprobs] = []
        chunk = self.config.max_num_seqs
        for start in range(0, len(rows), chunk):
            part = rows[start : start + chunk]
            logits = self.model_runner.logits(hidden[start : start + chunk], [r.row for r in part])
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            tokens, ks = [r.token_id for r in part], [r.num_logprobs for r in part]
            entries += gather_logprobs(logprobs, tokens, ks)
        return entries
