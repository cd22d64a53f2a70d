"""A pure-Python scheduler: the peer that bench.scheduler measures pyengine.Scheduler against.

Written the way vLLM v1's Python scheduler is: request dataclasses, a waiting queue and a
running list, one loop over the running requests then one over the waiting ones, and a
per-step loop in update(). It has its own minimal block allocator (a FIFO free list and a
block list per request) instead of pyengine.KVCacheManager, so that no part of it is C++;
there is no prefix caching (the benchmark runs the C++ side with it disabled too).

Its constructor, methods and buffers are those of ``pyengine.Scheduler``, and so is its
policy (cpp/src/core/scheduler.cpp), down to the block ids it hands out: blocks are taken from
the head of the free list, and a freed request's blocks go back to its head, released last
block first (so the most recently freed are reused first, as pyengine's BlockPool does).
One difference: block_tables rows are zero padded past a request's blocks, as
scheduler_output.h documents (the C++ leaves them stale).
"""

from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from enum import IntEnum

import numpy as np

NO_TOKEN = -1


class FinishReason(IntEnum):  # the codes of StepResults.finish_reasons
    NONE = 0
    STOP = 1
    LENGTH = 2
    ABORT = 3


class RequestStatus(IntEnum):
    WAITING = 0
    RUNNING = 1
    FINISHED = 2


@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    token_ids: list[int]  # prompt, then generated tokens
    num_prompt_tokens: int
    max_tokens: int
    min_tokens: int
    eos_token_id: int | None
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    waiting_key: tuple[int, float, int]  # (priority or 0, arrival_time, submission order)
    num_computed_tokens: int = 0  # tokens whose KV is computed or scheduled
    status: RequestStatus = RequestStatus.WAITING

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class BlockAllocator:
    """KV-cache blocks without prefix caching: a LIFO free list and each request's blocks;
    with num_state_slots, a hybrid model's recurrent-state slots too (a LIFO free list,
    the lowest first; a request takes one at its first allocation)."""

    def __init__(self, num_blocks: int, block_size: int, num_state_slots: int = 0) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_block_ids: deque[int] = deque(range(num_blocks))
        self.req_to_blocks: dict[str, list[int]] = {}
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))
        self.state_slots: dict[str, int] = {}

    def allocate_slots(self, request: Request, num_new_tokens: int) -> bool:
        """Gives `request` blocks for its next `num_new_tokens` tokens (and a state slot
        at its first); False, changing nothing, if the pool has too few free blocks or
        no state slot is free."""
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_needed = request.num_computed_tokens + num_new_tokens
        num_new_blocks = -(-num_needed // self.block_size) - len(blocks)
        needs_slot = self.num_state_slots > 0 and request.request_id not in self.state_slots
        if num_new_blocks > len(self.free_block_ids) or (needs_slot and not self.free_state_slots):
            return False
        for _ in range(num_new_blocks):
            blocks.append(self.free_block_ids.popleft())
        if needs_slot:
            self.state_slots[request.request_id] = self.free_state_slots.pop()
        return True

    def free(self, request_id: str) -> None:
        """Returns a request's blocks to the head of the free list, each pushed there last
        block first: the request's first block ends up at the head; and its state slot."""
        self.free_block_ids.extendleft(reversed(self.req_to_blocks.pop(request_id, [])))
        if request_id in self.state_slots:
            self.free_state_slots.append(self.state_slots.pop(request_id))


@dataclass
class SchedulerStats:
    num_running: int
    num_waiting: int
    num_preemptions: int
    kv_cache_usage: float


class StepBuffers:
    """The flat inputs of one step in arrays allocated once; the properties are views of
    the current step's part, like pyengine.StepBuffers."""

    def __init__(self, max_num_tokens: int, max_num_reqs: int, max_blocks_per_request: int):
        self.max_blocks_per_request = max_blocks_per_request
        self.num_reqs = self.num_tokens = self.num_sampled = 0
        self.request_ids: list[str] = []
        self._input_ids = np.zeros(max_num_tokens, np.int32)
        self._positions = np.zeros(max_num_tokens, np.int32)
        self._slot_mapping = np.zeros(max_num_tokens, np.int64)
        self._query_start_loc = np.zeros(max_num_reqs + 1, np.int32)
        self._seq_lens = np.zeros(max_num_reqs, np.int32)
        self._block_tables = np.zeros((max_num_reqs, max_blocks_per_request), np.int32)
        self._logits_indices = np.zeros(max_num_reqs, np.int32)
        self._num_scheduled_tokens = np.zeros(max_num_reqs, np.int32)
        self._is_sampling = np.zeros(max_num_reqs, np.bool_)
        self._state_slots = np.zeros(max_num_reqs, np.int32)
        self._has_state = np.zeros(max_num_reqs, np.int32)

    input_ids = property(lambda self: self._input_ids[: self.num_tokens])
    positions = property(lambda self: self._positions[: self.num_tokens])
    slot_mapping = property(lambda self: self._slot_mapping[: self.num_tokens])
    query_start_loc = property(lambda self: self._query_start_loc[: self.num_reqs + 1])
    seq_lens = property(lambda self: self._seq_lens[: self.num_reqs])
    block_tables = property(lambda self: self._block_tables[: self.num_reqs])
    logits_indices = property(lambda self: self._logits_indices[: self.num_sampled])
    num_scheduled_tokens = property(lambda self: self._num_scheduled_tokens[: self.num_reqs])
    is_sampling = property(lambda self: self._is_sampling[: self.num_reqs])
    state_slots = property(lambda self: self._state_slots[: self.num_reqs])
    has_state = property(lambda self: self._has_state[: self.num_reqs])


class StepResults:
    """What update() reported, row by row as in StepBuffers.request_ids."""

    def __init__(self, max_num_reqs: int) -> None:
        self.num_reqs = self.num_finished = 0
        self._new_token_ids = np.full(max_num_reqs, NO_TOKEN, np.int32)
        self._finish_reasons = np.zeros(max_num_reqs, np.uint8)

    new_token_ids = property(lambda self: self._new_token_ids[: self.num_reqs])
    finish_reasons = property(lambda self: self._finish_reasons[: self.num_reqs])


class PyScheduler:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = False,
        max_num_batched_tokens: int = 2048,
        max_num_seqs: int = 256,
        max_model_len: int = 4096,
        enable_chunked_prefill: bool = True,
        long_prefill_token_threshold: int = 0,
        policy: str = "fcfs",
        num_state_slots: int = 0,
    ) -> None:
        if enable_prefix_caching:
            raise ValueError("PyScheduler has no prefix caching")
        if policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {policy!r}")
        if min(num_blocks, max_num_batched_tokens, max_num_seqs, max_model_len) <= 0:
            raise ValueError("num_blocks and the max_* limits must be positive")
        if not enable_chunked_prefill and max_num_batched_tokens < max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens < max_model_len")
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.use_priority = policy == "priority"
        self.kv = BlockAllocator(num_blocks, block_size, num_state_slots)
        self.requests: dict[str, Request] = {}
        self.waiting: list[tuple[tuple[int, float, int], Request]] = []  # a heap
        self.running: list[Request] = []  # admission order
        self.buffers = StepBuffers(
            max_num_batched_tokens, max_num_seqs, -(-max_model_len // block_size)
        )
        self.results = StepResults(max_num_seqs)
        self.step_requests: list[Request | None] = []  # rows of the last schedule()
        self.step_is_sampling: list[bool] = []
        self.step_pending = False
        self.next_arrival_seq = 0
        self.num_preemptions = 0

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        max_tokens: int = 16,
        min_tokens: int = 0,
        eos_token_id: int | None = None,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        n: int = 1,
        priority: int = 0,
        arrival_time: float = 0.0,
    ) -> None:
        prompt = list(prompt_token_ids)
        max_len = min(len(prompt) + max_tokens, self.max_model_len)
        if request_id in self.requests:
            raise ValueError(f"add_request: request id {request_id!r} already exists")
        if not prompt or min(prompt) < 0 or len(prompt) > self.max_model_len:
            raise ValueError("add_request: empty prompt, negative token or prompt > max_model_len")
        if max_tokens < 1 or not 0 <= min_tokens <= max_tokens or n != 1:
            raise ValueError(
                "add_request: needs max_tokens >= 1, 0 <= min_tokens <= max_tokens, n == 1"
            )
        if -(-max_len // self.block_size) > self.kv.num_blocks:
            raise ValueError("add_request: the request could never fit in the KV cache")
        key = (priority if self.use_priority else 0, arrival_time, self.next_arrival_seq)
        self.next_arrival_seq += 1
        request = Request(
            request_id,
            prompt,
            len(prompt),
            max_tokens,
            min_tokens,
            eos_token_id,
            frozenset(stop_token_ids),
            ignore_eos,
            key,
        )
        self.requests[request_id] = request
        heapq.heappush(self.waiting, (key, request))

    def abort_request(self, request_id: str) -> None:
        request = self.requests.pop(request_id)  # KeyError for an unknown id
        if request.status == RequestStatus.WAITING:
            self.waiting = [entry for entry in self.waiting if entry[1] is not request]
            heapq.heapify(self.waiting)
        else:
            self.running.remove(request)
        request.status = RequestStatus.FINISHED
        self.kv.free(request_id)
        # A step in flight keeps its row; update() reports it as aborted.
        self.step_requests = [None if r is request else r for r in self.step_requests]

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def stats(self) -> SchedulerStats:
        usage = 1.0 - len(self.kv.free_block_ids) / self.kv.num_blocks
        return SchedulerStats(len(self.running), len(self.waiting), self.num_preemptions, usage)

    def schedule(self) -> int:
        """Plans one step into self.buffers; returns the number of requests scheduled."""
        if self.step_pending:
            raise RuntimeError("schedule: the last step has not been update()d")
        budget = self.max_num_batched_tokens
        scheduled: dict[Request, int] = {}  # request -> tokens this step, in row order
        preempted = False

        # Running requests first: a decode token each, or their prompt's next chunk.
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new_tokens = self._num_tokens_to_schedule(request, budget)
            while not self.kv.allocate_slots(request, num_new_tokens):
                victim = max(self.running, key=lambda r: r.waiting_key)
                position = self.running.index(victim)
                self._preempt(position)
                preempted = True
                if victim is request:
                    break
                # A victim already scheduled this step gives its tokens back.
                budget += scheduled.pop(victim, 0)
                if position < i:
                    i -= 1
            if request.status != RequestStatus.RUNNING:
                # It came last in policy order and preempted itself; the requests after it
                # come before it and may fit in the blocks it freed.
                continue
            request.num_computed_tokens += num_new_tokens
            scheduled[request] = num_new_tokens
            budget -= num_new_tokens
            i += 1

        # Then waiting requests in policy order, unless this step had to preempt.
        while (
            not preempted and budget > 0 and self.waiting and len(self.running) < self.max_num_seqs
        ):
            request = self.waiting[0][1]
            num_new_tokens = request.num_tokens - request.num_computed_tokens
            if self.long_prefill_token_threshold > 0:
                num_new_tokens = min(num_new_tokens, self.long_prefill_token_threshold)
            if not self.enable_chunked_prefill and num_new_tokens > budget:
                break
            num_new_tokens = min(num_new_tokens, budget)
            if not self.kv.allocate_slots(request, num_new_tokens):
                break
            heapq.heappop(self.waiting)
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens += num_new_tokens
            self.running.append(request)
            scheduled[request] = num_new_tokens
            budget -= num_new_tokens

        self._write_step(scheduled)
        self.step_pending = True
        return len(scheduled)

    def update(self, sampled_token_ids: np.ndarray | Sequence[int]) -> int:
        """Appends one sampled token per logits_indices row, applies the stop conditions,
        frees finished requests and fills self.results; returns how many finished."""
        if not self.step_pending:
            raise RuntimeError("update: no step was scheduled since the last update")
        if isinstance(sampled_token_ids, np.ndarray):
            sampled = sampled_token_ids.tolist()
        else:
            sampled = list(sampled_token_ids)
        if len(sampled) != self.buffers.num_sampled:
            raise ValueError(
                f"update: expected {self.buffers.num_sampled} sampled token ids, got {len(sampled)}"
            )
        if sampled and min(sampled) < 0:
            raise ValueError("update: negative token id")
        self.step_pending = False
        new_token_ids: list[int] = []
        finish_reasons: list[int] = []
        finished: list[Request] = []
        next_sample = 0
        for request, is_sampling in zip(self.step_requests, self.step_is_sampling, strict=True):
            token, reason = NO_TOKEN, FinishReason.NONE
            if is_sampling:
                if request is None:  # aborted during the step
                    reason = FinishReason.ABORT
                else:
                    token = sampled[next_sample]
                    request.token_ids.append(token)
                    reason = self._stop_reason(request, token)
                    if reason != FinishReason.NONE:
                        request.status = RequestStatus.FINISHED
                        finished.append(request)
                next_sample += 1
            new_token_ids.append(token)
            finish_reasons.append(reason)
        if finished:
            self.running = [r for r in self.running if r.status == RequestStatus.RUNNING]
            for request in finished:
                self.kv.free(request.request_id)
                del self.requests[request.request_id]
        num_reqs = len(new_token_ids)
        self.results.num_reqs, self.results.num_finished = num_reqs, len(finished)
        self.results._new_token_ids[:num_reqs] = new_token_ids
        self.results._finish_reasons[:num_reqs] = finish_reasons
        self.step_requests = []
        return len(finished)

    def _num_tokens_to_schedule(self, request: Request, budget: int) -> int:
        num_new_tokens = request.num_tokens - request.num_computed_tokens
        if self.long_prefill_token_threshold > 0:
            num_new_tokens = min(num_new_tokens, self.long_prefill_token_threshold)
        return min(num_new_tokens, budget)

    def _preempt(self, position: int) -> None:
        """Frees running[position] to recompute later; it waits again in policy order."""
        request = self.running.pop(position)
        self.kv.free(request.request_id)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self.num_preemptions += 1
        heapq.heappush(self.waiting, (request.waiting_key, request))

    def _stop_reason(self, request: Request, token: int) -> FinishReason:
        if request.num_output_tokens >= request.min_tokens:
            if token == request.eos_token_id and not request.ignore_eos:
                return FinishReason.STOP
            if token in request.stop_token_ids:
                return FinishReason.STOP
        if (
            request.num_output_tokens >= request.max_tokens
            or request.num_tokens >= self.max_model_len
        ):
            return FinishReason.LENGTH
        return FinishReason.NONE

    def _write_step(self, scheduled: dict[Request, int]) -> None:
        block_size = self.block_size
        b = self.buffers
        input_ids: list[int] = []
        positions: list[int] = []
        slot_mapping: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        logits_indices: list[int] = []
        is_sampling: list[bool] = []
        b._block_tables[: len(scheduled)] = 0
        for row, (request, num_new_tokens) in enumerate(scheduled.items()):
            blocks = self.kv.req_to_blocks[request.request_id]
            end = request.num_computed_tokens
            start = end - num_new_tokens
            input_ids += request.token_ids[start:end]
            positions += range(start, end)
            slot_mapping += [
                blocks[p // block_size] * block_size + p % block_size for p in range(start, end)
            ]
            query_start_loc.append(len(input_ids))
            seq_lens.append(end)
            b._block_tables[row, : len(blocks)] = blocks
            sampling = end == request.num_tokens
            is_sampling.append(sampling)
            if sampling:
                logits_indices.append(len(input_ids) - 1)
        num_reqs, num_tokens = len(scheduled), len(input_ids)
        b.num_reqs, b.num_tokens, b.num_sampled = num_reqs, num_tokens, len(logits_indices)
        b.request_ids = [r.request_id for r in scheduled]
        b._input_ids[:num_tokens] = input_ids
        b._positions[:num_tokens] = positions
        b._slot_mapping[:num_tokens] = slot_mapping
        b._query_start_loc[: num_reqs + 1] = query_start_loc
        b._seq_lens[:num_reqs] = seq_lens
        b._logits_indices[: len(logits_indices)] = logits_indices
        b._num_scheduled_tokens[:num_reqs] = list(scheduled.values())
        b._state_slots[:num_reqs] = [self.kv.state_slots.get(r.request_id, -1) for r in scheduled]
        b._has_state[:num_reqs] = [int(r.num_computed_tokens > n) for r, n in scheduled.items()]
        b._is_sampling[:num_reqs] = is_sampling
        self.step_requests = list(scheduled)
        self.step_is_sampling = is_sampling
