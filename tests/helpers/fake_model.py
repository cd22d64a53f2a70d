"""A deterministic stand-in for a model, reading its context through the paged KV cache.

The "KV cache" stores, per slot, the (token, position) written there. Each step the
fake model writes the step's tokens at buffers.slot_mapping, then, for every request
that samples, reads its whole context back through its block table and checks it is
exactly the request's tokens: wrong block tables, slot mappings or prefix-cache hits
show up as a mismatch. The next token is a function of the last three tokens and of
the sample index (parallel samples diverge, so a missed copy-on-write shows), so a
request's output does not depend on what else runs beside it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from pyengine import Scheduler

VOCAB = 1000


def next_token(tokens: list[int], sample: int = 0) -> int:
    return (sum(tokens[-3:]) * 31 + 7 + 13 * sample) % VOCAB


def sample_index(request_id: str) -> int:
    """k for the id of sample k > 0 ("<id>#<k>"), else 0."""
    head, _, tail = request_id.rpartition("#")
    return int(tail) if head and tail.isdigit() else 0


@dataclass
class Limits:
    max_tokens: int = 16
    min_tokens: int = 0
    eos_token_id: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


def run_alone(
    prompt: list[int], limits: Limits, max_model_len: int, sample: int = 0
) -> tuple[list[int], str]:
    """The tokens a request (or its sample `sample`) generates alone, and why it stops."""
    tokens = list(prompt)
    output: list[int] = []
    while True:
        token = next_token(tokens, sample)
        tokens.append(token)
        output.append(token)
        if len(output) >= limits.min_tokens:
            if not limits.ignore_eos and token == limits.eos_token_id:
                return output, "stop"
            if token in limits.stop_token_ids:
                return output, "stop"
        if len(output) >= limits.max_tokens or len(tokens) >= max_model_len:
            return output, "length"


@dataclass
class FakeModel:
    block_size: int
    slots: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (token, pos)
    host_slots: dict[int, tuple[int, int]] = field(default_factory=dict)  # the host tier's

    def step(self, scheduler: Scheduler, tokens_of: dict[str, list[int]]) -> np.ndarray:
        """Runs one scheduled step; `tokens_of` holds every request's known tokens."""
        b = scheduler.buffers
        self.write(scheduler)
        sampled = []
        for row in np.flatnonzero(b.is_sampling):
            request_id = b.request_ids[row]
            context = self.read_context(b.block_tables[row], int(b.seq_lens[row]))
            assert context == tokens_of[request_id][: len(context)], (
                f"{request_id}: the KV cache holds another context"
            )
            assert len(context) == len(tokens_of[request_id])
            sampled.append(next_token(context, sample_index(request_id)))
        return np.array(sampled, dtype=np.int32)

    def step_with_drafts(
        self, scheduler: Scheduler, tokens_of: dict[str, list[int]]
    ) -> tuple[np.ndarray, np.ndarray]:
        """Runs one scheduled step that may verify draft tokens, greedily: each sampling
        row's context read back (its known tokens, then its drafts) and its new tokens,
        the drafts that match the model's own next tokens and one token more; (the rows'
        new tokens, flat, and their counts)."""
        b = scheduler.buffers
        self.write(scheduler)
        tokens, counts = [], []
        for row, request_id in enumerate(b.request_ids):
            if not b.is_sampling[row]:
                counts.append(0)
                continue
            drafts_in = int(b.num_draft_tokens[row])
            end = int(b.query_start_loc[row + 1])
            drafts = b.input_ids[end - drafts_in : end].tolist()
            known = tokens_of[request_id]
            context = self.read_context(b.block_tables[row], int(b.seq_lens[row]))
            assert context == known + drafts, f"{request_id}: the KV cache holds another context"
            new: list[int] = []
            for j in range(drafts_in + 1):
                new.append(next_token(known + drafts[:j], sample_index(request_id)))
                if j == drafts_in or drafts[j] != new[-1]:
                    break
            tokens += new
            counts.append(len(new))
        return np.array(tokens, dtype=np.int32), np.array(counts, dtype=np.int32)

    def write(self, scheduler: Scheduler) -> None:
        """The step's copies between the tiers, its block copies, then its tokens at
        their slots."""
        b = scheduler.buffers
        self.copy(b.kv_to_host, self.slots, self.host_slots)
        self.copy(b.kv_to_device, self.host_slots, self.slots)
        self.copy(b.block_copies, self.slots, self.slots)
        for token, position, slot in zip(
            b.input_ids.tolist(), b.positions.tolist(), b.slot_mapping.tolist(), strict=True
        ):
            self.slots[slot] = (token, position)

    def copy(
        self,
        pairs: list[tuple[int, int]],
        source: dict[int, tuple[int, int]],
        destination: dict[int, tuple[int, int]],
    ) -> None:
        for src, dst in pairs:
            for offset in range(self.block_size):
                value = source.get(src * self.block_size + offset)
                if value is not None:
                    destination[dst * self.block_size + offset] = value
                else:  # (what the block held before is gone)
                    destination.pop(dst * self.block_size + offset, None)

    def read_context(self, block_table: np.ndarray, seq_len: int) -> list[int]:
        context = []
        for position in range(seq_len):
            slot = int(block_table[position // self.block_size]) * self.block_size
            token, stored_position = self.slots[slot + position % self.block_size]
            assert stored_position == position
            context.append(token)
        return context
