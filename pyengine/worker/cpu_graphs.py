"""Decode steps replayed from recorded kernel calls on the CPU, as CUDA graphs are on a GPU.

The model's forward for each batch size of a short ladder runs once while ops records
its kernel calls (ops.recording: each call's arguments converted once, its tensors kept
alive), and a decode step of up to that many requests fills the step inputs in place
(StepInputs, padded as for CUDA graphs) and replays the calls in C++
(KernelProgram.run): no Python, module calls, views or DLPack conversions between the
kernels, which cost a small model's decode step as much as its kernels do.

Only the pyengine kernels are recorded: a forward that computes anything with torch
itself (GPT-2's layer norms, Qwen3's per-head norms) would replay stale values. So
each program is checked once, replayed on other inputs than it was recorded on against
an eager forward on those inputs; a model whose replay differs runs eagerly."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch

from pyengine import _C, ops
from pyengine.layers.attention import AttentionMetadata, KVCache
from pyengine.utils import host_memory
from pyengine.worker.cuda_graphs import graph_size_for

if TYPE_CHECKING:
    from pyengine import StepBuffers
    from pyengine.models.interface import CausalLM
    from pyengine.worker.scheduler_output import SchedulerOutput
    from pyengine.worker.step_inputs import DeviceStep, StepInputs

logger = logging.getLogger(__name__)

# Batch sizes recorded, up to max_num_seqs (each program keeps its own activations).
CPU_CAPTURE_SIZES = (1, 2, 4, 8, 16, 32)
# Up to this many rows a step streams its weights whatever its rows: padding is free.
# Past it each row costs compute, and a program of `size` runs a step of n rows only
# where its padding is at most a quarter of it.
FREE_PADDING_ROWS = 8


def cpu_capture_sizes(max_num_seqs: int) -> list[int]:
    return [s for s in CPU_CAPTURE_SIZES if s <= max_num_seqs]


class UnrecordedForward(Exception):
    """A model's forward computes outside the recorded kernels: it runs eagerly."""


class KernelGraphs:
    """The recorded decode step of each batch size in `sizes`, over `inputs`' buffer (the
    first rows of each array, which every step's upload fills at the same addresses)."""

    def __init__(
        self, model: CausalLM, caches: list[KVCache], inputs: StepInputs, sizes: list[int]
    ) -> None:
        if not sizes or sizes != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"capture sizes must be distinct, ascending and positive: {sizes}")
        if sizes[-1] > min(inputs.max_num_seqs, inputs.max_num_batched_tokens):
            raise ValueError(f"a program of {sizes[-1]} rows is larger than the step inputs")
        self.model, self.caches, self.inputs, self.sizes = model, caches, inputs, sizes
        self.programs: dict[int, _C.KernelProgram] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each program's output
        try:
            for size in sizes:
                program = _C.KernelProgram()
                with ops.recording(program):
                    self.hidden[size] = self._forward(self.inputs.views(size, size, size))
                self.programs[size] = program
                self._check(size)
        finally:
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
            max_query_len=1,
        )
        hidden = self.model(step.input_ids, step.positions, self.caches, meta)
        assert isinstance(hidden, torch.Tensor)  # one whole model (no pipeline)
        return hidden

    def _check(self, size: int) -> None:
        """Raises UnrecordedForward where the replay of `size` on other tokens and
        positions than it was recorded on differs from an eager forward on them. Each row
        writes its key into slot 1 of a block of its own and attends to it and to slot 0,
        which no check writes (zeros, as allocated: a check at start, before any request
        holds the blocks), so that its queries, keys and values all count; the rows go
        back to the safe values after, the blocks to the OS at the end of __init__."""
        step = self.inputs.views(size, size, size)
        vocab = self.model.config.vocab_size
        num_blocks, block_size = self.caches[0][1].shape[0], self.caches[0][1].shape[2]
        rows = torch.arange(size)
        blocks = rows % num_blocks
        step.input_ids.copy_((rows + 1) * 7919 % vocab)
        step.positions.fill_(1)
        step.slot_mapping.copy_(blocks * block_size + 1)
        step.seq_lens.fill_(2)
        step.block_tables[:, 0] = blocks
        try:
            expected = self._forward(step).clone()
            self.programs[size].run()
            same = torch.equal(self.hidden[size], expected)
        finally:
            step.input_ids.zero_()
            step.positions.zero_()
            step.slot_mapping.fill_(-1)
            step.seq_lens.fill_(1)
            step.block_tables[:, 0] = 0
        if not same:
            raise UnrecordedForward(
                f"the recorded decode step of {size} rows differs from the eager one: the "
                "model computes outside pyengine's kernels"
            )

    def size_for(self, b: StepBuffers | SchedulerOutput) -> int | None:
        """The program that runs the step in `b`, or None (see graph_size_for; and where
        padding it would cost more compute than the Python it saves)."""
        size = graph_size_for(b, self.sizes)
        if size is None or size <= FREE_PADDING_ROWS:
            return size
        return size if 4 * (size - len(b.seq_lens)) <= size else None

    def replay(self, size: int) -> torch.Tensor:
        """Runs the program of `size` on what the last upload, padded to it, filled; its
        hidden states [size, hidden]."""
        self.programs[size].run()
        return self.hidden[size]


def record_decode_steps(
    model: CausalLM, caches: list[KVCache], inputs: StepInputs, sizes: list[int]
) -> KernelGraphs | None:
    """The recorded decode steps, or None (logged) where the model's forward does not
    replay."""
    try:
        graphs = KernelGraphs(model, caches, inputs, sizes)
    except UnrecordedForward as e:
        logger.info("decode steps run eagerly: %s", e)
        return None
    logger.info("recorded decode steps of %d batch sizes (1 to %d)", len(sizes), sizes[-1])
    return graphs
