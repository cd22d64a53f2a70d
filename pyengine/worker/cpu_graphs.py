"""Decode steps replayed from recorded kernel calls on the CPU, as CUDA graphs are on a GPU.

The model's forward for each size of a short ladder runs once while ops records its
kernel calls (ops.recording: each call's arguments converted once, its tensors kept
alive), and a step of up to that many tokens fills the step inputs in place (StepInputs,
padded to as many rows as tokens) and replays the calls in C++ (KernelProgram.run): no
Python, module calls, views or DLPack conversions between the kernels, which cost a
small model's decode step as much as its kernels do. With speculative decoding a step
verifies each request's token and its drafts: every request of at most 1 + k tokens,
the same programs at more sizes (the CPU's attention reads each request's query length
from the step inputs at run time).

Only the pyengine kernels are recorded: a forward that computes anything with torch
itself (GPT-2's layer norms, Qwen3's per-head norms) would replay stale values. So
each program is checked once, replayed on other inputs than it was recorded on against
an eager forward on those inputs; a model whose replay differs runs eagerly."""

from __future__ import annotations

import logging
from types import SimpleNamespace
from typing import TYPE_CHECKING

import numpy as np
import torch

from pyengine import _C, ops
from pyengine.layers.attention import AttentionMetadata, KVCache
from pyengine.utils import host_memory

if TYPE_CHECKING:
    from pyengine import StepBuffers
    from pyengine.models.interface import CausalLM
    from pyengine.step_values import SchedulerOutput
    from pyengine.worker.step_inputs import DeviceStep, StepInputs

logger = logging.getLogger(__name__)

# Token counts recorded for decode steps, up to max_num_seqs (each program keeps its own
# activations): every count up to 8, where a padded row still costs compute (on the
# default model on 2 AMX cores, 5 rows padded to 8 took 11.2 ms a step, recorded as 5
# 9.4 ms; 3, 6 and 7 rows 8-12% less), then a coarser ladder.
CPU_CAPTURE_SIZES = (1, 2, 3, 4, 5, 6, 7, 8, 16, 32)
# With draft tokens to verify: every count up to 8 (a row costs compute on the CPU, so a
# few requests' verifying steps are not padded), then a coarser ladder.
VERIFY_CAPTURE_SIZES = (*range(1, 9), 10, 12, 16, 20, 24, 32, 40, 48, 64)
# Up to this many rows a step streams its weights whatever its rows: padding is cheap.
# Past it each row costs compute, and a program of `size` runs a step of n tokens only
# where its padding is at most a quarter of it.
FREE_PADDING_ROWS = 8


def cpu_capture_sizes(max_num_seqs: int, max_verify_tokens: int = 0) -> list[int]:
    """Decode steps' sizes up to max_num_seqs, and verifying steps' up to
    max_verify_tokens (0: no speculation)."""
    sizes = {s for s in CPU_CAPTURE_SIZES if s <= max_num_seqs}
    sizes |= {s for s in VERIFY_CAPTURE_SIZES if s <= max_verify_tokens}
    return sorted(sizes)


class UnrecordedForward(Exception):
    """A model's forward computes outside the recorded kernels: it runs eagerly."""


class KernelGraphs:
    """The recorded step of each token count in `sizes` (as many request rows), over
    `inputs`' buffer (the first rows of each array, which every step's upload fills at the
    same addresses), for steps of at most `max_query_len` tokens a request."""

    def __init__(
        self,
        model: CausalLM,
        caches: list[KVCache],
        inputs: StepInputs,
        sizes: list[int],
        max_query_len: int = 1,
    ) -> None:
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"capture sizes must be distinct, ascending and positive: {sizes}")
        if sizes[-1] > min(inputs.max_num_seqs, inputs.max_num_batched_tokens):
            raise ValueError(f"a program of {sizes[-1]} rows is larger than the step inputs")
        if max_query_len < 1:
            raise ValueError(f"max_query_len must be positive, got {max_query_len}")
        self.model, self.caches, self.inputs, self.sizes = model, caches, inputs, sizes
        self.max_query_len = max_query_len
        self.programs: dict[int, _C.KernelProgram] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each program's output
        try:
            for size in sizes:
                program = _C.KernelProgram()
                with ops.recording(program):
                    self.hidden[size] = self._forward(self.inputs.views(size, size, 0))
                self.programs[size] = program
                self._check(size)
        finally:
            inputs.reset()
            # What the checks wrote committed a huge page of each layer's cache: back to
            # the OS, as zeros (no request has written the cache yet).
            pools = {t.untyped_storage().data_ptr(): t for pair in caches for t in pair}
            for pool in pools.values():
                host_memory.decommit(pool)

    @torch.inference_mode()
    def _forward(self, step: DeviceStep) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=step.slot_mapping,
            block_tables=step.block_tables,
            seq_lens=step.seq_lens,
            query_start_loc=step.query_start_loc,
            max_query_len=self.max_query_len,
        )
        hidden = self.model(step.input_ids, step.positions, self.caches, meta)
        assert isinstance(hidden, torch.Tensor)  # one whole model (no pipeline)
        return hidden

    def _check(self, size: int) -> None:
        """Raises UnrecordedForward where the replay of `size` on other tokens and
        positions than it was recorded on differs from an eager forward on them. The
        step holds requests of max_query_len tokens (the last fewer) and, past one
        token, one padding token: each request writes its keys from position 1 on into
        blocks of its own and attends to them and to slot 0, which no check writes
        (zeros, as allocated: a check at start, before any request holds the blocks),
        so that its queries, keys and values all count; the rows go back to their safe
        values after, the blocks to the OS at the end of __init__."""
        vocab = self.model.config.vocab_size
        num_blocks, block_size = self.caches[0][1].shape[0], self.caches[0][1].shape[2]
        per_request = min(self.max_query_len, self.inputs.max_blocks * block_size - 1)
        blocks_each = -(-(per_request + 1) // block_size)
        tokens = size - 1 if size > 1 else 1
        full, rest = divmod(tokens, per_request)
        lens = [per_request] * full + ([rest] if rest else [])
        tables = np.zeros((len(lens), self.inputs.max_blocks), dtype=np.int32)
        tables[:, :blocks_each] = (
            np.arange(len(lens))[:, None] * blocks_each + np.arange(blocks_each)
        ) % num_blocks
        positions = np.concatenate([np.arange(1, n + 1) for n in lens])
        request_of = np.repeat(np.arange(len(lens)), lens)
        slots = tables[request_of, positions // block_size].astype(np.int64) * block_size
        groups = self.inputs.num_kv_groups  # (every group the same blocks here)
        step = SimpleNamespace(
            input_ids=((np.arange(tokens) + 1) * 7919 % vocab).astype(np.int32),
            positions=positions.astype(np.int32),
            slot_mapping=np.tile(slots + positions % block_size, (groups, 1)),
            query_start_loc=np.concatenate([[0], np.cumsum(lens)]).astype(np.int32),
            seq_lens=np.asarray(lens, dtype=np.int32) + 1,
            logits_indices=np.zeros(0, dtype=np.int32),
            block_tables=np.tile(tables, (groups, 1, 1)),
        )
        views = self.inputs.upload(step, size)  # type: ignore[arg-type]
        expected = self._forward(views).clone()
        self.programs[size].run()
        if not torch.equal(self.hidden[size], expected):
            raise UnrecordedForward(
                f"the recorded step of {size} tokens differs from the eager one: the "
                "model computes outside pyengine's kernels"
            )

    def size_for(self, step: StepBuffers | SchedulerOutput) -> int | None:
        """The program that runs `step`: the smallest that holds its tokens, for
        a step whose every request has 1 to max_query_len of them; None for another
        step (a prefill), or where padding it would cost more compute than the Python it
        saves."""
        n, tokens = len(step.seq_lens), len(step.input_ids)
        if n == 0 or tokens > self.sizes[-1]:
            return None
        query_lens = np.diff(step.query_start_loc)
        if query_lens.min() < 1 or query_lens.max() > self.max_query_len:
            return None
        size = next(s for s in self.sizes if s >= tokens)
        if size <= FREE_PADDING_ROWS or 4 * (size - tokens) <= size:
            return size
        return None

    def replay(self, size: int) -> torch.Tensor:
        """Runs the program of `size` on what the last upload, padded to it, filled; its
        hidden states [size, hidden]."""
        self.programs[size].run()
        return self.hidden[size]


def record_decode_steps(
    model: CausalLM,
    caches: list[KVCache],
    inputs: StepInputs,
    sizes: list[int],
    max_query_len: int = 1,
) -> KernelGraphs | None:
    """The recorded decode steps, or None (logged) where the model's forward does not
    replay."""
    try:
        graphs = KernelGraphs(model, caches, inputs, sizes, max_query_len)
    except UnrecordedForward as e:
        logger.info("decode steps run eagerly: %s", e)
        return None
    logger.info("recorded decode steps of %d batch sizes (1 to %d)", len(sizes), sizes[-1])
    return graphs
