"""The engine loop: the C++ scheduler plans a step, the model runs it over the paged KV
cache, the sampler picks tokens, the scheduler applies them; detokenization and stop
strings are done here."""

from __future__ import annotations

import time
import uuid
from collections.abc import Sequence
from copy import copy
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from pyengine import Scheduler, StepBuffers
from pyengine.config import EngineConfig
from pyengine.detokenizer import IncrementalDetokenizer
from pyengine.loader.resolve import LoadedModel
from pyengine.model_runner import ModelRunner
from pyengine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from pyengine.sampler import (
    Sampler,
    SamplerOutput,
    SamplingRow,
    gather_logprobs,
    plain_greedy,
)
from pyengine.sampling_params import SamplingParams
from pyengine.tokenizer import PyengineTokenizer


def check_token_ids(token_ids: Sequence[int], vocab_size: int, what: str) -> None:
    """Raises ValueError naming `what` and the first entry that is not an integer token id
    in [0, vocab_size)."""
    ids = np.asarray(token_ids)
    if ids.ndim == 1 and ids.dtype.kind in "iu":  # the common case, without a Python loop
        outside = (ids < 0) | (ids >= vocab_size)
        if not outside.any():
            return
        token_ids = [int(ids[outside.argmax()])]
    for t in token_ids:
        if isinstance(t, bool) or not isinstance(t, int | np.integer):
            raise ValueError(f"{what}: token ids must be integers, got {t!r:.40}")
        if not 0 <= t < vocab_size:
            raise ValueError(f"{what}: token id {t} is outside the vocabulary [0, {vocab_size})")


@dataclass
class _Sample:
    """One of a request's n samples."""

    index: int
    row_id: str  # the scheduler's id: the request's for sample 0, else sample_id(request, k)
    generator: torch.Generator | None
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer | None  # the text so far, as tokens arrive
    finished: bool = False


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    samples: list[_Sample]
    metrics: RequestMetrics
    blocked_token_ids: tuple[int, ...] = ()
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    done: bool = False
    prompt_logprobs: dict[int, PositionLogprobs] = field(default_factory=dict)  # by position
    # Its tokens are the argmax of the logits once past min_tokens (no logprobs either).
    argmax_only: bool = False
    # The prompt as an array, for the penalties, made once rather than every step.
    prompt_array: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int32))

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[s.output for s in self.samples],
            finished=self.done,
            metrics=self.metrics,
            num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self._prompt_logprobs(),
        )

    def _prompt_logprobs(self) -> list[PositionLogprobs | None] | None:
        if self.params.prompt_logprobs is None:
            return None
        positions = range(1, len(self.prompt_token_ids))  # the first token has none
        return [None, *(self.prompt_logprobs.get(i) for i in positions)]


class LLMEngine:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        self.config = config
        self.model_config = loaded.config
        self.tokenizer: PyengineTokenizer | None = loaded.tokenizer
        self.runner = ModelRunner(loaded, config)
        self.scheduler = Scheduler(
            num_blocks=self.runner.num_blocks,
            block_size=config.block_size,
            enable_prefix_caching=config.enable_prefix_caching,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_num_seqs=config.max_num_seqs,
            max_model_len=config.max_model_len,
            enable_chunked_prefill=config.enable_chunked_prefill,
            long_prefill_token_threshold=0,  # not an engine argument yet: no cap
            policy="fcfs",  # not an engine argument yet
        )
        self.sampler = Sampler(config.seed, config.device)
        self.requests: dict[str, _RequestState] = {}
        self._by_row_id: dict[str, tuple[_RequestState, _Sample]] = {}
        self._finished: list[_RequestState] = []  # done, not yet returned by step()
        # What a step must look at row by row, kept as sets so that the common step (every
        # request scheduled before, greedy, no logprobs) skips those loops: 0.64 ms of
        # Python a step at 256 requests before, which a GPU would wait on.
        self._unscheduled: set[str] = set()  # requests whose first step is still to come
        self._prompt_logprobs: set[str] = set()  # requests that want prompt logprobs
        self._sampled_rows: set[str] = set()  # unfinished samples that need sampling rows

    # -- requests --------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        params = self._checked(request_id, prompt_token_ids, params)
        eos, *more_eos = self.model_config.eos_token_ids or (None,)
        stop_ids = list(params.stop_token_ids or [])
        if not params.ignore_eos:
            stop_ids += [t for t in more_eos if t is not None]
        room = self.config.max_model_len - len(prompt_token_ids)
        max_tokens = room if params.max_tokens is None else min(params.max_tokens, room)
        prompt_array = np.asarray(prompt_token_ids, dtype=np.int32)
        self.scheduler.add_request(
            request_id,
            prompt_array,
            max_tokens=max_tokens,
            min_tokens=min(params.min_tokens, max_tokens),
            eos_token_id=eos,
            stop_token_ids=stop_ids,
            ignore_eos=params.ignore_eos,
            n=params.n,
            # Prompt logprobs need every prompt position computed: no prefix-cache hits.
            cache_salt="" if params.prompt_logprobs is None else f"prompt-logprobs:{uuid.uuid4()}",
        )
        blocked = tuple(stop_ids) + (() if params.ignore_eos or eos is None else (eos,))
        samples = [
            _Sample(
                k,
                request_id if k == 0 else Scheduler.sample_id(request_id, k),
                self._generator(params.seed, k),
                CompletionOutput(k, "", []),
                None
                if self.tokenizer is None
                else IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
            )
            for k in range(params.n)
        ]
        state = _RequestState(
            request_id,
            prompt,
            list(prompt_token_ids),
            params,
            samples,
            RequestMetrics(time.time() if arrival_time is None else arrival_time),
            blocked if params.min_tokens > 0 else (),
            argmax_only=plain_greedy(params) and params.logprobs is None,
            prompt_array=prompt_array,
        )
        self.requests[request_id] = state
        self._unscheduled.add(request_id)
        if params.prompt_logprobs is not None:
            self._prompt_logprobs.add(request_id)
        for s in samples:
            self._by_row_id[s.row_id] = (state, s)
            if not state.argmax_only or params.min_tokens > 0:
                self._sampled_rows.add(s.row_id)

    def _checked(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> SamplingParams:
        """The request's own copy of `params`, checked again (a caller may have changed
        its fields since it was made, or change them while the request runs); raises
        ValueError naming whatever the engine cannot run."""
        if not isinstance(request_id, str):
            raise ValueError(f"a request id must be a string, got {request_id!r:.40}")
        if request_id in self.requests:
            raise ValueError(f"request {request_id!r} already exists")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"request {request_id!r}: {params!r:.40} is not a SamplingParams")
        params = replace(  # validates; the lists its own too
            params,
            stop=copy(params.stop),
            stop_token_ids=copy(params.stop_token_ids),
            logit_bias=copy(params.logit_bias),
        )
        if not prompt_token_ids:
            raise ValueError(f"request {request_id!r}: the prompt is empty")
        vocab, what = self.model_config.vocab_size, f"request {request_id!r}"
        check_token_ids(prompt_token_ids, vocab, what)
        check_token_ids(params.stop_token_ids or [], vocab, f"{what}: stop_token_ids")
        check_token_ids(list(params.logit_bias or {}), vocab, f"{what}: logit_bias")
        c = self.config
        limits = [("logprobs", "max_logprobs", c.max_logprobs),
                  ("prompt_logprobs", "max_logprobs", c.max_logprobs),
                  ("n", "max_num_seqs", c.max_num_seqs)]  # fmt: skip
        for name, limit_name, limit in limits:
            asked = getattr(params, name)
            if asked is not None and asked > limit:
                raise ValueError(
                    f"{what}: {name} {asked} is more than {limit_name} ({limit}, an engine "
                    "argument)"
                )
        if len(prompt_token_ids) >= self.config.max_model_len:
            raise ValueError(
                f"request {request_id!r}: the prompt has {len(prompt_token_ids)} tokens; "
                f"max_model_len is {self.config.max_model_len} (prompt plus at least one token)"
            )
        return params

    def _generator(self, seed: int | None, sample: int) -> torch.Generator | None:
        """A seeded sample's own generator, on the host (see SamplingRow)."""
        if seed is None:
            return None
        generator = torch.Generator()
        return generator.manual_seed((seed * 1_000_003 + sample) % 2**63)

    def abort_request(self, request_id: str) -> None:
        state = self.requests.get(request_id)
        if state is None:
            return
        for s in state.samples:
            if not s.finished and self.scheduler.has_request(s.row_id):
                self.scheduler.abort_request(s.row_id)
            self._finish_sample(state, s, "abort")

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step --------------------------------------------------------------------

    def step(self, finished_only: bool = False) -> list[RequestOutput]:
        """Runs one engine step; returns the requests that got tokens in it or finished
        (since the last step, aborts too), or only the finished ones. Their outputs are
        live: read them before the next step."""
        if self.scheduler.schedule() == 0:  # nothing to run (all aborted, or no room yet)
            self.scheduler.update(np.zeros(0, dtype=np.int32))
            return self._collect_outputs([])
        b = self.scheduler.buffers
        row_ids = b.request_ids  # a new list at every access: read once
        sampling = [self._by_row_id[row_ids[i]] for i in np.flatnonzero(b.is_sampling)]
        if self._unscheduled:
            self._note_cached_prefixes(b, row_ids)
        try:
            sampled = self._run_step(b, row_ids, sampling)
        except BaseException:
            # A failed step (bad weights, interrupt) ends its requests, not the engine.
            for row_id in row_ids:
                if row_id in self._by_row_id:
                    self.abort_request(self._by_row_id[row_id][0].request_id)
            self.scheduler.update(np.zeros(len(sampling), dtype=np.int32))
            raise
        logprobs_of = {}
        if sampled.logprobs is not None:
            logprobs_of = {
                id(sample): lp
                for (_, sample), lp in zip(sampling, sampled.logprobs, strict=True)
                if lp is not None
            }
        self.scheduler.update(np.asarray(sampled.token_ids, dtype=np.int32))
        now = time.time()
        progressed: dict[str, _RequestState] = {}
        for row_id, token, reason in self.scheduler.outputs():
            state, sample = self._by_row_id[row_id]
            progressed[state.request_id] = state
            if token is not None:
                self._append(state, sample, token, logprobs_of.get(id(sample)), now)
            if reason is not None and not sample.finished:
                self._finish_sample(state, sample, reason, token)
        return self._collect_outputs([] if finished_only else list(progressed.values()))

    def _note_cached_prefixes(self, b: StepBuffers, row_ids: list[str]) -> None:
        """A request's first step starts after the prompt tokens the prefix cache held."""
        positions, starts = b.positions, b.query_start_loc
        for i, row_id in enumerate(row_ids):
            if row_id in self._unscheduled:  # sample 0's row: its id is the request's
                self._unscheduled.discard(row_id)
                self.requests[row_id].num_cached_tokens = int(positions[starts[i]])

    def discard_finished(self) -> None:
        self._collect_outputs([])

    def _prompt_logprob_rows(
        self, b: StepBuffers, row_ids: list[str]
    ) -> list[tuple[_RequestState, int, int]]:
        """(request, prompt position predicted, token row) for requests that want prompt
        logprobs and compute prompt tokens in this step."""
        wanted = []
        for i, row_id in enumerate(row_ids):
            if row_id not in self._prompt_logprobs:  # sample 0's row: the request's id
                continue
            state = self.requests[row_id]
            for row in range(int(b.query_start_loc[i]), int(b.query_start_loc[i + 1])):
                target = int(b.positions[row]) + 1
                if target < len(state.prompt_token_ids) and target not in state.prompt_logprobs:
                    wanted.append((state, target, row))
        return wanted

    def _run_step(
        self, b: StepBuffers, row_ids: list[str], sampling: list[tuple[_RequestState, _Sample]]
    ) -> SamplerOutput:
        wanted = self._prompt_logprob_rows(b, row_ids) if self._prompt_logprobs else []
        logits, scored = self.runner.execute(b, [row for _, _, row in wanted])
        if scored is not None:
            self._score_prompts(wanted, scored)
        if not self._sampled_rows or all(
            sample.row_id not in self._sampled_rows for _, sample in sampling
        ):  # the common batch: no rows to build
            return self.sampler.argmax(logits)
        rows = [
            SamplingRow(
                state.params,
                state.prompt_array,
                sample.output.token_ids,
                sample.generator,
                state.blocked_token_ids
                if len(sample.output.token_ids) < state.params.min_tokens
                else (),
            )
            for state, sample in sampling
        ]
        return self.sampler(logits, rows)

    def _score_prompts(
        self, wanted: list[tuple[_RequestState, int, int]], hidden: torch.Tensor
    ) -> None:
        """Prompt logprobs of `wanted` (from _prompt_logprob_rows) from the final hidden
        states of its rows: max_num_seqs rows at a time, so that a long prompt's logits
        never exist whole (8192 rows of a 128k vocabulary would be 4 GB in float32)."""
        tokens = [state.prompt_token_ids[target] for state, target, _ in wanted]
        ks = [state.params.prompt_logprobs or 0 for state, _, _ in wanted]
        rows = self.config.max_num_seqs
        for start in range(0, len(wanted), rows):
            part = slice(start, start + rows)
            logprobs = torch.log_softmax(self.runner.logits(hidden[part]).float(), dim=-1)
            entries = gather_logprobs(logprobs, tokens[part], ks[part])
            for (state, target, _), entry in zip(wanted[part], entries, strict=True):
                self._decode_logprobs(entry)
                state.prompt_logprobs[target] = entry

    def _append(
        self,
        state: _RequestState,
        sample: _Sample,
        token: int,
        logprobs: PositionLogprobs | None,
        now: float,
    ) -> None:
        out = sample.output
        out.token_ids.append(token)
        if (
            sample.row_id in self._sampled_rows
            and state.argmax_only
            and len(out.token_ids) >= state.params.min_tokens
        ):
            self._sampled_rows.discard(sample.row_id)  # past min_tokens: plain argmax now
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        if logprobs is not None:
            if out.logprobs is None:
                out.logprobs = []
                out.cumulative_logprob = 0.0
            self._decode_logprobs(logprobs)
            out.logprobs.append(logprobs)
            out.cumulative_logprob = (out.cumulative_logprob or 0.0) + logprobs[token].logprob
        if sample.detokenizer is not None:
            new_from = len(out.text)  # the detokenizer's text only grows
            sample.detokenizer.add(token)
            out.text = sample.detokenizer.text
            if state.params.stop_strings:
                self._check_stop_strings(state, sample, new_from)

    def _decode_logprobs(self, logprobs: PositionLogprobs) -> None:
        if self.tokenizer is not None:
            for token, lp in logprobs.items():
                lp.decoded_token = self.tokenizer.token_text(token)

    def _check_stop_strings(self, state: _RequestState, sample: _Sample, new_from: int) -> None:
        """Ends the sample at the first stop string that overlaps its text from `new_from`
        on (what the last token added; a token can add any number of characters)."""
        p = state.params
        text = sample.output.text  # detokenized so far
        stops = p.stop_strings
        start = max(0, new_from - max(len(s) for s in stops) + 1)
        hits = [(text.find(s, start), s) for s in stops]
        hits = [(at, s) for at, s in hits if at >= 0]
        if not hits:
            return
        at, stop = min(hits)
        sample.output.text = text[: at + len(stop)] if p.include_stop_str_in_output else text[:at]
        sample.output.stop_reason = stop
        if self.scheduler.has_request(sample.row_id):
            self.scheduler.finish_request(sample.row_id, "stop")
        self._finish_sample(state, sample, "stop", text_done=True)

    def _finish_sample(
        self,
        state: _RequestState,
        sample: _Sample,
        reason: str,
        last_token: int | None = None,
        text_done: bool = False,
    ) -> None:
        if sample.finished:
            return
        sample.finished = True
        self._sampled_rows.discard(sample.row_id)
        out = sample.output
        out.finish_reason = reason
        if reason == "stop" and out.stop_reason is None and last_token is not None:
            out.stop_reason = last_token if last_token != self._eos() else None
        if not text_done and self.tokenizer is not None:
            out.text = self.tokenizer.decode(out.token_ids, state.params.skip_special_tokens)
        if all(s.finished for s in state.samples):
            state.done = True
            state.metrics.finished_time = time.time()
            self._finished.append(state)

    def _eos(self) -> int | None:
        ids = self.model_config.eos_token_ids
        return ids[0] if ids else None

    def _collect_outputs(self, progressed: list[_RequestState]) -> list[RequestOutput]:
        """Outputs of `progressed` and of every request finished since the last call; the
        finished ones leave the engine."""
        finished, self._finished = self._finished, []
        for state in finished:
            del self.requests[state.request_id]
            self._unscheduled.discard(state.request_id)
            self._prompt_logprobs.discard(state.request_id)
            for s in state.samples:
                self._by_row_id.pop(s.row_id, None)
        ids = {id(state) for state in progressed}
        return [s.to_output() for s in progressed + [f for f in finished if id(f) not in ids]]

    def stats(self) -> dict[str, float]:
        s = self.scheduler.stats()
        return {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "num_preemptions": s.num_preemptions,
            "prefix_cache_hit_rate": s.prefix_cache_hit_rate,
            "kv_cache_usage": s.kv_cache_usage,
        }
