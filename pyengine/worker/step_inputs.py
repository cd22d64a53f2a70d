"""A step's scheduler arrays on a GPU, in one host-to-device copy per step.

The arrays lie at fixed offsets of one int32 buffer sized to the scheduler's capacity:
a pinned host copy is filled from the StepBuffers, then copied to its device mirror in
one asynchronous copy, of which the device tensors of the step are views. Fixed offsets
let CUDA graphs capture reads of the same addresses that every step's copy fills.

    [slot_mapping (int64, a row of max tokens per KV-cache group) | input_ids |
     positions | query_start_loc | seq_lens | logits_indices |
     block_tables (per KV-cache group, max_num_seqs rows of max_blocks)]

The block tables come last, so a step copies the buffer up to the end of its last
group's rows.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from pyengine import _C

if TYPE_CHECKING:
    from pyengine import StepBuffers
    from pyengine.step_values import SchedulerOutput

ALIGN_WORDS = 16  # int32 words: 64 bytes


@dataclass
class DeviceStep:
    """Views of the device buffer: a step's arrays, or a CUDA graph's padded ones."""

    input_ids: torch.Tensor  # int32 [num_tokens]
    positions: torch.Tensor  # int32 [num_tokens]
    slot_mapping: torch.Tensor  # int64 [num_kv_groups, num_tokens]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    logits_indices: torch.Tensor  # int32 [num_sampled]
    block_tables: torch.Tensor  # int32 [num_kv_groups, num_reqs, max_blocks]


def kv_arrays(step: StepBuffers | SchedulerOutput) -> tuple[np.ndarray, np.ndarray]:
    """Every KV-cache group's slots [groups, tokens] and block tables [groups, reqs,
    blocks] of a step (a StepBuffers' own slot_mapping and block_tables are group 0's)."""
    if isinstance(step, _C.StepBuffers):
        return step.group_slot_mapping, step.group_block_tables
    return np.asarray(step.slot_mapping), np.asarray(step.block_tables)


class StepInputs:
    """The buffer pair (pinned host, device) and the views of one step.

    Rows a step does not fill keep values that are safe to run a graph's padding on:
    slot -1 (write no K/V), token 0 at position 0, seq_len 1, query_start_loc counting
    one token per row, and block table entries that were valid ids (0 at first; a
    padding row's first entry, the one its query reads, is 0 again at each upload).
    """

    def __init__(
        self,
        device: torch.device,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_blocks: int,
        max_num_sampled: int | None = None,
        num_kv_groups: int = 1,
    ) -> None:
        """max_num_sampled: the most logits rows of a step (None: max_num_seqs, one a
        request; with draft tokens, one for each of them too)."""
        if min(max_num_batched_tokens, max_num_seqs, max_blocks, num_kv_groups) < 1:
            raise ValueError(
                "StepInputs needs positive capacities, got max_num_batched_tokens="
                f"{max_num_batched_tokens}, max_num_seqs={max_num_seqs}, max_blocks={max_blocks}"
                f", num_kv_groups={num_kv_groups}"
            )
        self.num_kv_groups = num_kv_groups
        self.device = device
        # A decode step padded to max_num_seqs rows has a token row for each.
        max_num_batched_tokens = max(max_num_batched_tokens, max_num_seqs)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs, self.max_blocks = max_num_seqs, max_blocks
        self.max_num_sampled = max_num_seqs if max_num_sampled is None else max_num_sampled
        self.sizes = {  # in int32 words
            "slot_mapping": 2 * num_kv_groups * max_num_batched_tokens,  # first: 8-byte aligned
            "input_ids": max_num_batched_tokens,
            "positions": max_num_batched_tokens,
            "query_start_loc": max_num_seqs + 1,
            "seq_lens": max_num_seqs,
            "logits_indices": self.max_num_sampled,
            "block_tables": num_kv_groups * max_num_seqs * max_blocks,
        }
        self.offsets: dict[str, int] = {}
        total = 0
        for name, size in self.sizes.items():  # each on a 64-byte boundary, as if alone
            self.offsets[name] = total
            total += -(-size // ALIGN_WORDS) * ALIGN_WORDS
        # Two host buffers in turn: a step fills one while the last step's copy from the
        # other may still wait on the device behind work the host did not wait for (a
        # prefill chunk that samples nothing).
        on_gpu = device.type == "cuda"
        self._hosts = [torch.zeros(total, dtype=torch.int32, pin_memory=on_gpu) for _ in range(2)]
        self._fields = [
            {name: self._field(host.numpy(), name) for name in self.sizes} for host in self._hosts
        ]
        for f in self._fields:
            self._make_safe(f)
        self.buffer = self._hosts[0].to(device, copy=True)
        # Recorded after each copy from a host buffer (on the stream of the device buffer,
        # which runs it): an upload waits for its host buffer's last copy before
        # overwriting it.
        self._copied = [torch.cuda.Event() if on_gpu else None for _ in range(2)]  # type: ignore[no-untyped-call]
        self._turn = 0  # the host buffer the next upload fills

    def _field(self, words: np.ndarray, name: str) -> np.ndarray:
        start = self.offsets[name]
        field = words[start : start + self.sizes[name]]
        if name == "slot_mapping":
            return field.view(np.int64).reshape(self.num_kv_groups, -1)
        if name == "block_tables":
            return field.reshape(self.num_kv_groups, self.max_num_seqs, self.max_blocks)
        return field

    def upload(self, step: StepBuffers | SchedulerOutput, padded_reqs: int = 0) -> DeviceStep:
        """Copies `step` to the device; its views. A step padded to `padded_reqs`
        rows (a graph's or program's size) has as many tokens as rows: the padding rows
        past its own take one token each while its tokens are fewer than the rows, zero
        after (a decode step's padding: one token a row), all at their safe values."""
        num_reqs, num_tokens = len(step.seq_lens), len(step.input_ids)
        slot_mapping, block_tables = kv_arrays(step)
        if num_tokens > self.max_num_batched_tokens or num_reqs > self.max_num_seqs:
            raise ValueError(
                f"a step of {num_tokens} tokens and {num_reqs} requests is larger than the "
                f"inputs' capacity ({self.max_num_batched_tokens} tokens, {self.max_num_seqs} "
                "requests)"
            )
        groups = self.num_kv_groups
        if (
            block_tables.ndim != 3
            or block_tables.shape[0] != groups
            or (block_tables.shape[2] > self.max_blocks)
            or slot_mapping.shape != (groups, num_tokens)
        ):
            raise ValueError(
                f"block tables of shape {block_tables.shape} and slots of shape "
                f"{slot_mapping.shape}: expected {groups} KV-cache groups' of at most "
                f"{self.max_blocks} blocks per request and {num_tokens} tokens"
            )
        rows = max(num_reqs, padded_reqs)
        if rows > self.max_num_seqs or (padded_reqs > num_reqs and num_tokens > padded_reqs):
            raise ValueError(
                f"cannot pad a step of {num_tokens} tokens and {num_reqs} requests to "
                f"{padded_reqs} rows: a padded step has as many tokens as rows, up to "
                f"{self.max_num_seqs}"
            )
        turn, self._turn = self._turn, 1 - self._turn
        copied = self._copied[turn]
        if copied is not None:
            copied.synchronize()  # at once where no copy is pending
        f = self._fields[turn]
        f["input_ids"][:num_tokens] = step.input_ids
        f["positions"][:num_tokens] = step.positions
        f["slot_mapping"][:, :num_tokens] = slot_mapping
        f["query_start_loc"][: num_reqs + 1] = step.query_start_loc
        f["seq_lens"][:num_reqs] = step.seq_lens
        f["logits_indices"][: len(step.logits_indices)] = step.logits_indices
        f["block_tables"][:, :num_reqs, : block_tables.shape[2]] = block_tables
        tokens = num_tokens
        if rows > num_reqs:  # padding rows, and the padding tokens they hold
            tokens = rows
            f["input_ids"][num_tokens:tokens] = 0
            f["positions"][num_tokens:tokens] = 0
            f["slot_mapping"][:, num_tokens:tokens] = -1
            f["block_tables"][:, num_reqs:rows, 0] = 0  # (a window's table may hold -1)
            f["seq_lens"][num_reqs:rows] = 1
            holding = np.minimum(np.arange(1, rows - num_reqs + 1), tokens - num_tokens)
            f["query_start_loc"][num_reqs + 1 : rows + 1] = num_tokens + holding
        end = self.offsets["block_tables"] + ((groups - 1) * self.max_num_seqs + rows) * (
            self.max_blocks
        )
        self.buffer[:end].copy_(self._hosts[turn][:end], non_blocking=True)
        if copied is not None:
            copied.record(torch.cuda.current_stream(self.device))
        return self.views(tokens, rows, len(step.logits_indices))

    def reset(self) -> None:
        """Every row back to its safe value (after a check that filled them)."""
        for f in self._fields:
            self._make_safe(f)
        self.buffer.copy_(self._hosts[0])

    def _make_safe(self, f: dict[str, np.ndarray]) -> None:
        for field in f.values():
            field[...] = 0
        f["slot_mapping"][...] = -1
        f["seq_lens"][:] = 1
        f["query_start_loc"][:] = np.arange(self.max_num_seqs + 1)

    def views(self, num_tokens: int, num_reqs: int, num_sampled: int) -> DeviceStep:
        """The device buffer's first rows of each array (what the last upload filled, or
        the safe values)."""
        if not (
            0 <= num_tokens <= self.max_num_batched_tokens
            and 0 <= num_reqs <= self.max_num_seqs
            and 0 <= num_sampled <= self.max_num_sampled
        ):
            raise ValueError(
                f"views of {num_tokens} tokens, {num_reqs} requests and {num_sampled} "
                f"sampled rows: the capacity is {self.max_num_batched_tokens} tokens and "
                f"{self.max_num_seqs} requests"
            )

        def first(name: str, count: int) -> torch.Tensor:
            start = self.offsets[name]
            return self.buffer[start : start + count]

        groups = self.num_kv_groups
        slots = first("slot_mapping", self.sizes["slot_mapping"]).view(torch.int64)
        tables = first("block_tables", self.sizes["block_tables"])
        return DeviceStep(
            input_ids=first("input_ids", num_tokens),
            positions=first("positions", num_tokens),
            slot_mapping=slots.view(groups, -1)[:, :num_tokens],
            query_start_loc=first("query_start_loc", num_reqs + 1),
            seq_lens=first("seq_lens", num_reqs),
            logits_indices=first("logits_indices", num_sampled),
            block_tables=tables.view(groups, self.max_num_seqs, self.max_blocks)[:, :num_reqs],
        )
