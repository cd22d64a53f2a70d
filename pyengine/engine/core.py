"""The engine core: schedule -> execute -> update, once a step. It owns the C++
scheduler and the executor, and of each running row (a request, or one of its n
samples) only what choosing its tokens needs: its parameters and the tokens so far. The
text, stop strings and outputs are the output processor's.

With a pipeline of P stages, P steps are in flight at once so that every stage has work
(vLLM's virtual engines): P schedulers, each with its own requests and its own range of
the KV blocks, take turns; a request belongs to one, so it is in at most one step in
flight, and each scheduler's schedule -> update order is the one-step order.
"""

from __future__ import annotations

import uuid
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import numpy as np

from pyengine import Scheduler, StepBuffers
from pyengine.config import EngineConfig
from pyengine.engine.input_processor import EngineRequest
from pyengine.engine.step_in_flight import StepInFlight
from pyengine.engine.structured_output import GrammarCompiler, Matcher, StepGrammar
from pyengine.engine.thinking import Thinking
from pyengine.executor import Executor
from pyengine.faults import RequestFault
from pyengine.outputs import PositionLogprobs
from pyengine.sample.sampler import plain_greedy
from pyengine.spec_decode.registry import create_proposer
from pyengine.spec_decode.verify import SpecDecodeStats, accept_drafts
from pyengine.step_values import (
    ModelRunnerOutput,
    PromptLogprobRow,
    SamplingRow,
    SchedulerOutput,
)

# (row id, its new token or None, its finish reason or None), as Scheduler.outputs().
RowUpdate = tuple[str, int | None, str | None]


@dataclass
class _Row:
    """What the core keeps of a running row."""

    request: EngineRequest
    seed: int | None  # its draws' seed where the request is seeded
    output_token_ids: list[int] = field(default_factory=list)
    # Its tokens are the argmax of the logits once past min_tokens (no logprobs either).
    argmax_only: bool = False
    matcher: Matcher | None = None  # a structured output's, following its tokens
    thinking: Thinking | None = None  # a thinking row's reasoning, followed until it ends

    @property
    def constrained_now(self) -> Matcher | None:
        """Its matcher, once its reasoning (if it thinks) has ended."""
        return self.matcher if self.thinking is None or self.thinking.ended else None


@dataclass
class EngineCoreOutput:
    updates: list[RowUpdate]
    sampled_row_ids: list[str]  # the rows that sampled, in the runner output's order
    runner_output: ModelRunnerOutput | None
    # request id -> (prompt tokens its first step found in the prefix cache, of them those
    # the KV host tier held)
    num_cached_tokens: dict[str, tuple[int, int]]
    # (request id, prompt position, its logprobs)
    prompt_logprobs: list[tuple[str, int, PositionLogprobs]]
    # row id -> (draft tokens it verified, of them accepted), for the rows that verified
    drafts: dict[str, tuple[int, int]] = field(default_factory=dict)


class EngineCore:
    def __init__(
        self,
        config: EngineConfig,
        executor: Executor,
        grammars: GrammarCompiler | None = None,
        vocab_size: int = 0,
    ) -> None:
        self.config = config
        self.grammars = grammars  # structured outputs' matchers
        # A forced token's bitmask: as wide as the grammars' (a step stacks both kinds)
        self._mask_words = grammars.mask_words if grammars else -(-vocab_size // 32)
        self.lora = config.lora is not None
        self.speculative = config.speculative
        # The speculative method, chosen once: where the step's drafts come from.
        self.proposer = None if config.speculative is None else create_proposer(config.speculative)
        self.spec_stats = SpecDecodeStats()
        device = config.device.split(":")[0]
        spec = self.speculative
        self._drafting_batch = 0 if spec is None else spec.drafting_batch_size(
            config.max_num_seqs, device
        )  # fmt: skip
        self.executor = executor
        self._has_states = executor.num_state_slots > 0  # (a hybrid model's)
        num_virtual_engines = executor.max_steps_in_flight
        self.schedulers = [
            Scheduler(
                num_blocks=executor.num_blocks // num_virtual_engines,
                block_size=config.block_size,
                enable_prefix_caching=config.enable_prefix_caching,
                max_num_batched_tokens=config.max_num_batched_tokens,
                max_num_seqs=config.max_num_seqs,
                max_model_len=config.max_model_len,
                enable_chunked_prefill=config.enable_chunked_prefill,
                long_prefill_token_threshold=0,  # not an engine argument yet: no cap
                policy=config.scheduling_policy,
                max_loras=config.lora.max_loras if config.lora is not None else 0,
                draft_row_cost=0.0
                if spec is None
                else spec.draft_row_cost(device) + config.draft_token_cost,
                num_host_blocks=executor.num_host_blocks // num_virtual_engines,
                preemption_mode=config.preemption_mode,
                kv_groups=list(executor.kv_groups),
                num_state_slots=executor.num_state_slots,
                num_state_checkpoints=executor.num_state_checkpoints,
                state_checkpoint_interval=config.state_checkpoint_interval,
                state_snapshots=config.speculative is not None and executor.num_state_slots > 0,
            )
            for _ in range(num_virtual_engines)
        ]
        if self.proposer is not None:
            for scheduler in self.schedulers:
                self.proposer.configure(scheduler)
        self._virtual_engine_of: dict[str, int] = {}  # request id -> its scheduler
        self._in_flight: deque[StepInFlight] = deque()
        self._next_virtual_engine = 0  # the scheduler to fill first, in turn
        self._rows: dict[str, _Row] = {}
        self._live_rows: dict[str, int] = {}  # request id -> its rows still running
        self._finished_row_ids: list[str] = []  # for the workers, at the next step
        self.failed_request_ids: set[str] = set()  # the requests of a step that failed
        # What a step must look at row by row, kept as sets so that the common step (every
        # request scheduled before, greedy, no logprobs) skips those loops.
        self._unscheduled: set[str] = set()  # requests whose first step is still to come
        self._prompt_logprobs: dict[str, set[int]] = {}  # request -> positions scored
        self._sampled_rows: set[str] = set()  # rows that need sampling requests
        self._adapter_rows: set[str] = set()  # the rows through an adapter (metrics)

    @property
    def scheduler(self) -> Scheduler:
        """The first scheduler (the only one without a pipeline)."""
        return self.schedulers[0]

    def add_request(self, request: EngineRequest, row_ids: list[str]) -> None:
        """Schedules `request`, its samples under `row_ids` (the first is its own id),
        with the scheduler that has the fewest requests."""
        params, request_id = request.params, request.request_id
        virtual_engine = 0
        if len(self.schedulers) > 1:
            load = [0] * len(self.schedulers)
            for taken in self._virtual_engine_of.values():
                load[taken] += 1
            virtual_engine = load.index(min(load))
        constrained = params.structured_outputs
        if constrained is not None and self.grammars is None:
            raise ValueError("structured_outputs needs the model's tokenizer")
        # (a thinking budget forces tokens through a row's mask)
        budget = params.max_thinking_tokens is not None
        argmax_only = (plain_greedy(params) and params.logprobs is None and constrained is None
                       and not budget)  # fmt: skip
        self.schedulers[virtual_engine].add_request(
            request_id,
            request.prompt_array,
            max_tokens=request.max_tokens,
            min_tokens=request.min_tokens,
            eos_token_id=request.eos_token_id,
            stop_token_ids=request.stop_token_ids,
            ignore_eos=params.ignore_eos,
            n=params.n,
            adapter_id=0 if request.lora_request is None else request.lora_request.lora_int_id,
            # Prompt logprobs need every prompt position computed: no prefix-cache hits.
            cache_salt=request.cache_salt
            if params.prompt_logprobs is None
            else f"prompt-logprobs:{uuid.uuid4()}",
            priority=request.priority,
            # Greedy rows keep the drafts their argmax gives, sampled rows those their
            # draws give (accept_drafts): every request speculates (a constrained
            # request's rows after drafts are checked or masked from its matcher after
            # them).
            # (a thinking row's budget and its grammar's waking follow its tokens one step
            # row at a time: no drafts for it)
            speculate=self.proposer is not None and not params.thinking_end_token_ids,
        )
        for k, row_id in enumerate(row_ids):
            seed = None if params.seed is None else (params.seed * 1_000_003 + k) % 2**63
            matcher = None
            if constrained is not None and self.grammars is not None:
                matcher = self.grammars.matcher(constrained)
            thinking = None
            if params.thinking_end_token_ids:
                end = tuple(params.thinking_end_token_ids)
                thinking = Thinking(end, params.max_thinking_tokens)
            self._rows[row_id] = _Row(request, seed, argmax_only=argmax_only, matcher=matcher,
                                      thinking=thinking)  # fmt: skip
            if not argmax_only or params.min_tokens > 0:
                self._sampled_rows.add(row_id)
            if request.lora_request is not None:
                self._adapter_rows.add(row_id)
        self._virtual_engine_of[request_id] = virtual_engine
        self._live_rows[request_id] = len(row_ids)
        self._unscheduled.add(request_id)
        if params.prompt_logprobs is not None:
            self._prompt_logprobs[request_id] = set()

    def finish_rows(self, row_ids: Iterable[str], reason: str) -> None:
        """Ends rows the engine itself ends (aborts; "stop": a stop string)."""
        for row_id in row_ids:
            row = self._rows.get(row_id)
            # During its step a row's removal is recorded, and reported by update().
            scheduler = (
                self.schedulers[self._virtual_engine_of[row.request.request_id]] if row else None
            )
            if scheduler is not None and scheduler.has_request(row_id):
                if reason == "abort":
                    scheduler.abort_request(row_id)
                else:
                    scheduler.finish_request(row_id, reason)
            self._drop(row_id)

    def step(self) -> EngineCoreOutput:
        """One step: every scheduler without a step in flight plans and submits one,
        then the oldest step in flight is completed. Where the executor fails, the
        failed steps' rows are aborted (the caller ends their requests:
        failed_request_ids) and the error raised."""
        self.failed_request_ids = set()
        updates: list[RowUpdate] = []
        busy = {f.virtual_engine for f in self._in_flight}
        for k in range(len(self.schedulers)):
            virtual_engine = (self._next_virtual_engine + k) % len(self.schedulers)
            if virtual_engine not in busy:
                updates += self._submit(virtual_engine)
        self._next_virtual_engine = (self._next_virtual_engine + 1) % len(self.schedulers)
        if not self._in_flight:
            return EngineCoreOutput(updates, [], None, {}, [])
        flight = self._in_flight.popleft()
        try:
            output = self._complete(flight)
        except BaseException as error:
            if self._retry_without_culprits(flight, error):
                raise
            self._fail(flight)
            if not self.executor.is_alive:  # the other steps in flight are lost too
                while self._in_flight:
                    self._fail(self._in_flight.popleft())
            raise
        scheduler = self.schedulers[flight.virtual_engine]
        sampled = np.asarray(output.sampled_token_ids, dtype=np.int32)
        verified: dict[str, tuple[int, int]] = {}
        if flight.drafts is None:
            scheduler.update(sampled)
        else:
            assert flight.is_sampling is not None
            tokens, counts = accept_drafts(sampled, flight.is_sampling, flight.drafts)
            scheduler.update(tokens, counts)
            self.spec_stats.record(flight.drafts, counts)
            verified = {
                flight.row_ids[i]: (len(flight.drafts[i]), int(counts[i]) - 1)
                for i in np.flatnonzero(counts)
                if len(flight.drafts[i])
            }
        prompt_logprobs = [
            (request_id, position, logprobs)
            for (request_id, position), logprobs in zip(
                flight.scored, output.prompt_logprobs, strict=True
            )
        ]
        for request_id, position, _ in prompt_logprobs:
            self._prompt_logprobs[request_id].add(position)
        updates += self._updates(flight.virtual_engine)
        return EngineCoreOutput(
            updates, flight.sampled_row_ids, output, flight.cached, prompt_logprobs, verified
        )

    def _complete(self, flight: StepInFlight) -> ModelRunnerOutput:
        """The step's tokens: its forward pass's output (a draft model's drafts taken),
        its sampled tokens, and, where a grammar refuses a checked row's token, that row
        drawn again under its mask."""
        assert flight.executed is not None
        executed = flight.executed.result()
        if flight.drafts_in_step:
            assert executed.draft_token_ids is not None
            made = np.asarray(executed.draft_token_ids, dtype=np.int32)
            flight.take_drafts(made)
            self.schedulers[flight.virtual_engine].set_scheduled_drafts(made)
        grammar = flight.grammar
        if flight.sampled is None:  # (its masks follow the drafts just made)
            assert grammar is not None
            flight.sampled = self.executor.sample_tokens(
                flight.virtual_engine, grammar.for_sampling()
            )
        sampled = flight.sampled.result()
        tokens, logprobs = sampled.token_ids, sampled.logprobs
        refused = [] if grammar is None else grammar.refused(tokens)
        if refused:
            assert grammar is not None
            again = self.executor.redraw(flight.virtual_engine, refused, grammar.masks(refused))
            redrawn = again.result()
            tokens = list(tokens)
            for k, i in enumerate(refused):
                tokens[i] = redrawn.token_ids[k]
                if logprobs is not None and redrawn.logprobs is not None:
                    logprobs[i] = redrawn.logprobs[k]
        return ModelRunnerOutput(tokens, logprobs, executed.prompt_logprobs, executed.pooled)

    def _submit(self, virtual_engine: int) -> list[RowUpdate]:
        """Scheduler `virtual_engine` plans a step and the executor takes it: its forward
        pass, and, once the grammar masks are made (while the forward runs), its
        sampling; what the scheduler reports when it has nothing to run (aborted rows) is
        returned."""
        scheduler = self.schedulers[virtual_engine]
        # (no drafts for a batch that is compute-bound already)
        if self.proposer is not None and scheduler.stats().num_running <= self._drafting_batch:
            self.proposer.propose(scheduler)
        if scheduler.schedule() == 0:  # nothing to run (all aborted, or no room yet)
            scheduler.update(np.zeros(0, dtype=np.int32))
            return self._updates(virtual_engine)
        buffers = scheduler.buffers
        row_ids = buffers.request_ids  # a new list at every access: read once
        cached = self._first_steps(scheduler, row_ids) if self._unscheduled else {}
        num_sampled = int(np.count_nonzero(buffers.is_sampling))
        flight = StepInFlight(virtual_engine, row_ids, [], [], cached, num_sampled)
        num_drafts = buffers.num_draft_tokens
        if num_drafts.any():
            ends = buffers.query_start_loc[1:]
            pairs = zip(ends.tolist(), num_drafts.tolist(), strict=True)
            flight.drafts = [buffers.input_ids[end - d : end].copy() for end, d in pairs]
            flight.is_sampling = buffers.is_sampling.copy()
            flight.drafts_in_step = self.proposer is not None and self.proposer.drafts_in_step
        try:
            step = self._scheduler_output(buffers, row_ids, flight)
            grammar = flight.grammar
            if grammar is not None:
                if flight.drafts is not None and not flight.drafts_in_step:
                    grammar.set_drafts(flight.row_drafts())
                if flight.drafts_in_step:
                    step = replace(step, draft_masks=flight.first_draft_masks(grammar))
                grammar.start()
            flight.executed = self.executor.execute_model(step)
            if grammar is None:
                flight.sampled = self.executor.sample_tokens(virtual_engine, None)
            elif not (flight.drafts_in_step and grammar.masks_follow_drafts):
                flight.sampled = self.executor.sample_tokens(virtual_engine, grammar.for_sampling())
        except BaseException as error:
            if not self._retry_without_culprits(flight, error):
                self._fail(flight)
            raise
        self._in_flight.append(flight)
        return []

    def _retry_without_culprits(self, flight: StepInFlight, error: BaseException) -> bool:
        """Where `error` is a RequestFault that names some of the step's requests: they
        are aborted (failed_request_ids) and the step is cancelled for the others, which
        a later step schedules again. False (nothing done but the culprits' aborts) where
        it cannot be: another error, the executor gone, a fault that names none of them,
        or a step that forked samples or moved KV blocks."""
        if not isinstance(error, RequestFault) or not self.executor.is_alive:
            return False
        rows = [r for r in flight.row_ids if r in self._rows]
        culprits = {
            self._rows[r].request.request_id for r in rows if at_fault(self._rows[r].request, error)
        }
        if not culprits:
            return False
        self._abandon(flight)
        self.finish_rows([r for r in rows if self._rows[r].request.request_id in culprits], "abort")
        self.failed_request_ids |= culprits
        try:
            self.schedulers[flight.virtual_engine].cancel_step()
        except RuntimeError:
            return False  # (the caller fails the rest of the step)
        self._unscheduled |= set(flight.cached) - culprits  # (their first step is to come)
        return True

    @staticmethod
    def _abandon(flight: StepInFlight) -> None:
        for pending in (flight.executed, flight.sampled):
            if pending is not None:  # (answers still to come are dropped on arrival)
                pending.abandon()

    def _fail(self, flight: StepInFlight) -> None:
        """Aborts the rows of a step that will not complete, and ends it."""
        self._abandon(flight)
        rows = [r for r in flight.row_ids if r in self._rows]
        self.failed_request_ids |= {self._rows[r].request.request_id for r in rows}
        self.finish_rows(rows, "abort")
        scheduler = self.schedulers[flight.virtual_engine]
        if flight.is_sampling is None:
            scheduler.update(np.zeros(flight.num_sampled, np.int32))
        else:  # (a token for each sampling row: the rows are aborted, their tokens unread)
            scheduler.update(
                np.zeros(flight.num_sampled, np.int32), flight.is_sampling.astype(np.int32)
            )

    def _updates(self, virtual_engine: int = 0) -> list[RowUpdate]:
        """The last update()'s rows, a RowUpdate per new token (a row's accepted drafts
        first), its finish reason with the last."""
        updates = self.schedulers[virtual_engine].outputs()
        for row_id, token, reason in updates:
            row = self._rows.get(row_id)
            if row is None:
                continue
            if token is not None:
                row.output_token_ids.append(token)
                matcher = row.constrained_now  # (the thinking's end is not the answer's)
                if row.thinking is not None:
                    row.thinking.accept(token)
                if matcher is not None:
                    matcher.accept(token)
                if (
                    row.argmax_only
                    and row_id in self._sampled_rows
                    and len(row.output_token_ids) >= row.request.params.min_tokens
                ):
                    self._sampled_rows.discard(row_id)  # past min_tokens: plain argmax now
            if reason is not None:
                self._drop(row_id)
        return updates

    def _drop(self, row_id: str) -> None:
        row = self._rows.pop(row_id, None)
        if row is None:
            return
        self._finished_row_ids.append(row_id)
        self._sampled_rows.discard(row_id)
        self._adapter_rows.discard(row_id)
        request_id = row.request.request_id
        self._live_rows[request_id] -= 1
        if not self._live_rows[request_id]:  # the request's last row
            del self._live_rows[request_id]
            del self._virtual_engine_of[request_id]
            self._unscheduled.discard(request_id)
            self._prompt_logprobs.pop(request_id, None)

    def _first_steps(self, scheduler: Scheduler, row_ids: list[str]) -> dict[str, tuple[int, int]]:
        """A request's first step starts after the prompt tokens the prefix cache held
        (some of them, maybe, in the host tier)."""
        buffers = scheduler.buffers
        positions, starts = buffers.positions, buffers.query_start_loc
        cached = {}
        for i, row_id in enumerate(row_ids):
            if row_id in self._unscheduled:  # sample 0's row: its id is the request's
                self._unscheduled.discard(row_id)
                host = scheduler.num_host_cached_tokens(row_id)
                cached[row_id] = (int(positions[starts[i]]), host)
        return cached

    def _scheduler_output(
        self, buffers: StepBuffers, row_ids: list[str], flight: StepInFlight
    ) -> SchedulerOutput:
        """The step as the executor takes it; the flight gets the sampled rows' ids (one
        per logits row) and places, the (request, prompt position) of each prompt-logprob
        row, and the step's grammar."""
        # (a row with draft tokens has a logits row for each, and one more: the j-th
        # follows its drafts before j)
        rows_each = 1 + buffers.num_draft_tokens
        flight.places = [(int(i), j) for i in np.flatnonzero(buffers.is_sampling)
                         for j in range(int(rows_each[i]))]  # fmt: skip
        flight.sampled_row_ids = [row_ids[i] for i, _ in flight.places]
        sampling = None
        if self._sampled_rows and any(r in self._sampled_rows for r in flight.sampled_row_ids):
            sampling = [self._sampling_row(row_ids[i], j) for i, j in flight.places]
            flight.grammar = self._grammar(flight.sampled_row_ids, sampling)
        prompt_rows: list[PromptLogprobRow] = []
        if self._prompt_logprobs:
            for request_id, position, row in self._prompt_logprob_rows(buffers, row_ids):
                request = self._rows[request_id].request
                k = request.params.prompt_logprobs or 0
                prompt_rows.append(PromptLogprobRow(row, request.prompt_token_ids[position], k))
                flight.scored.append((request_id, position))
        finished, self._finished_row_ids = self._finished_row_ids, []
        step = SchedulerOutput(
            input_ids=buffers.input_ids,
            positions=buffers.positions,
            slot_mapping=buffers.group_slot_mapping,
            query_start_loc=buffers.query_start_loc,
            seq_lens=buffers.seq_lens,
            block_tables=buffers.group_block_tables,
            logits_indices=buffers.logits_indices,
            block_copies=buffers.block_copies,
            kv_to_host=buffers.kv_to_host,
            kv_to_device=buffers.kv_to_device,
            sampling=sampling,
            prompt_logprob_rows=prompt_rows,
            finished_row_ids=finished,
            virtual_engine=flight.virtual_engine,
        )
        if self._has_states:
            step = replace(step, state_slots=buffers.state_slots, has_state=buffers.has_state,
                           state_copies=buffers.state_copies,
                           state_loads=buffers.state_loads)  # fmt: skip
        if self.proposer is not None and self.proposer.drafts_in_step:  # (every step)
            step = replace(step, num_draft_tokens=buffers.num_draft_tokens.copy())
        if self.lora:
            step = self._with_adapters(step, row_ids)
        return step

    def adapter_states(self) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """The adapters (names, sorted) of the running requests, and of the waiting ones."""
        running: set[str] = set()
        waiting: set[str] = set()
        for row_id in self._adapter_rows:
            request = self._rows[row_id].request
            lora = request.lora_request
            scheduler = self.schedulers[self._virtual_engine_of[request.request_id]]
            if lora is None or not scheduler.has_request(row_id):  # (None: never, for mypy)
                continue
            state = scheduler.status(row_id)
            (running if state == "running" else waiting).add(lora.lora_name)
        return tuple(sorted(running)), tuple(sorted(waiting))

    def _with_adapters(self, step: SchedulerOutput, row_ids: list[str]) -> SchedulerOutput:
        """The step with its rows' adapter ids, and its adapters."""
        loras = [self._rows[r].request.lora_request for r in row_ids]
        ids = np.array([0 if lr is None else lr.lora_int_id for lr in loras], dtype=np.int64)
        adapters = {lr.lora_int_id: lr for lr in loras if lr is not None}
        return replace(step, adapter_ids=ids, adapters=adapters)

    def _sampling_row(self, row_id: str, num_drafts_before: int = 0) -> SamplingRow:
        """How to choose a logits row's token: for a row after some of its request's
        drafts, as if they were its tokens already (penalties count them, the worker
        adding them; min_tokens too), which they are if it is kept."""
        row = self._rows[row_id]
        request = row.request
        under_min = len(row.output_token_ids) + num_drafts_before < request.params.min_tokens
        forced = None  # (a spent thinking budget's next token)
        if row.thinking is not None:
            forced = row.thinking.forced_mask(self._mask_words)
        return SamplingRow(
            request.params,
            request.prompt_array,
            row.output_token_ids,
            row.seed,
            request.blocked_token_ids if under_min else (),
            allowed_tokens=forced,
            num_drafts_before=num_drafts_before,
            logit_bias=request.logit_bias,
        )

    def _grammar(
        self, sampled_row_ids: list[str], sampling: list[SamplingRow]
    ) -> StepGrammar | None:
        """The step's constrained rows (by index among its sampled rows), over their
        matchers."""
        matchers: dict[int, Matcher] = {}
        for i, row_id in enumerate(sampled_row_ids):
            matcher = self._rows[row_id].constrained_now
            if matcher is not None:
                matchers[i] = matcher
        if not matchers or self.grammars is None:
            return None
        return StepGrammar.of_rows(self.grammars, matchers, sampling)

    def _prompt_logprob_rows(
        self, buffers: StepBuffers, row_ids: list[str]
    ) -> list[tuple[str, int, int]]:
        """(request, prompt position predicted, token row) for requests that want prompt
        logprobs and compute prompt tokens in this step."""
        wanted = []
        for i, row_id in enumerate(row_ids):
            scored = self._prompt_logprobs.get(row_id)  # sample 0's row: the request's id
            if scored is None:
                continue
            prompt_len = len(self._rows[row_id].request.prompt_token_ids)
            starts = buffers.query_start_loc
            for row in range(int(starts[i]), int(starts[i + 1])):
                target = int(buffers.positions[row]) + 1
                if target < prompt_len and target not in scored:
                    wanted.append((row_id, target, row))
        return wanted


def at_fault(request: EngineRequest, fault: RequestFault) -> bool:
    """Whether the fault names the request, or its adapter."""
    lora = request.lora_request
    return request.request_id in fault.request_ids or (
        lora is not None and lora.lora_int_id in fault.lora_int_ids
    )
