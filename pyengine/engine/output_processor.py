"""The output processor: from the core's per-row tokens to what callers read. It
detokenizes (its detokenizers find stop strings and hold back text that could begin
one), decodes logprobs, keeps each request's metrics, and hands out RequestOutputs as
each request's params.output_kind asks: deltas, what each step added (a stream); whole
outputs at each step, copies that no later step changes; or one whole output at the end.
Nothing a step does costs the length of a request's output so far, but the whole
outputs that CUMULATIVE asks for."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np

from pyengine.config import PoolerConfig
from pyengine.engine.core import EngineCoreOutput
from pyengine.engine.detokenizer import IncrementalDetokenizer
from pyengine.engine.input_processor import EngineRequest
from pyengine.engine.pooling import finish_pooled
from pyengine.flat_logprobs import FlatLogprobs
from pyengine.outputs import (
    CompletionOutput,
    EngineOutput,
    PoolingOutput,
    PoolingRequestOutput,
    PositionLogprobs,
    RequestMetrics,
    RequestOutput,
)
from pyengine.sampling_params import RequestOutputKind
from pyengine.tokenizer import PyengineTokenizer


@dataclass
class SampleState:
    """One of a request's n samples: all it has generated, and how much of that its
    deltas have handed out."""

    index: int
    row_id: str  # the scheduler's id: the request's for sample 0, else sample_id(request, k)
    detokenizer: IncrementalDetokenizer | None  # the text, as tokens arrive (no tokenizer: None)
    token_ids: list[int] = field(default_factory=list)
    logprobs: FlatLogprobs | None = None  # one position per token, where they were asked for
    cumulative_logprob: float | None = None
    finish_reason: str | None = None  # "stop", "length", "abort"
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    num_sent_tokens: int = 0  # tokens (and their logprobs) that deltas have handed out
    sent_finish: bool = False  # a delta has handed out its finish

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def whole(self, copy: bool) -> CompletionOutput:
        """All the sample has generated: copies of its lists where later steps could
        still change them (copy), else the lists themselves (its logprobs: a view, which
        later steps leave as it is)."""
        logprobs = self.logprobs
        if copy and logprobs is not None:
            logprobs = logprobs[:]
        return CompletionOutput(
            self.index,
            "" if self.detokenizer is None else self.detokenizer.text,
            list(self.token_ids) if copy else self.token_ids,
            self.finish_reason,
            self.stop_reason,
            logprobs,
            self.cumulative_logprob,
        )

    def delta(self) -> CompletionOutput | None:
        """What the sample added since its last delta (its new tokens, text and logprobs,
        its finish); None where that is nothing."""
        if self.sent_finish:
            return None
        text = "" if self.detokenizer is None else self.detokenizer.take_new_text(self.finished)
        start = self.num_sent_tokens
        new_tokens = self.token_ids[start:]
        if not new_tokens and not text and not self.finished:
            return None
        logprobs = None if self.logprobs is None else self.logprobs[start:]
        self.num_sent_tokens, self.sent_finish = len(self.token_ids), self.finished
        return CompletionOutput(
            self.index,
            text,
            new_tokens,
            self.finish_reason,
            self.stop_reason,
            logprobs,
            self.cumulative_logprob,
        )


@dataclass
class RequestState:
    request: EngineRequest
    samples: list[SampleState]
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    num_host_cached_tokens: int = 0  # of them, those the KV host tier held
    done: bool = False
    prompt_logprobs: dict[int, PositionLogprobs] = field(default_factory=dict)  # by position
    num_outputs: int = 0  # handed out so far (the first delta carries the prompt logprobs)
    pooled: list[float] | None = None  # a pooling request's output, finished

    def make_output(self) -> EngineOutput | None:
        """The request's output now, as its params.output_kind asks: what its samples
        added since the last one (DELTA), or all of it (CUMULATIVE, and FINAL_ONLY once
        the request is done; None before). A pooling request has one, once done (with
        no numbers where it was aborted)."""
        if self.request.pooling is not None:
            if not self.done:
                return None
            r = self.request
            return PoolingRequestOutput(
                r.request_id, r.prompt_token_ids, PoolingOutput(self.pooled or []), True, r.prompt
            )
        kind = self.request.params.output_kind
        if kind is RequestOutputKind.DELTA:
            outputs = [d for d in (s.delta() for s in self.samples) if d is not None]
        elif kind is RequestOutputKind.CUMULATIVE or self.done:
            # A done request leaves the engine: its lists are handed over, not copied.
            outputs = [s.whole(copy=not self.done) for s in self.samples]
        else:
            return None
        # A delta carries the prompt's logprobs once, in the request's first output.
        with_prompt = self.num_outputs == 0 or kind is not RequestOutputKind.DELTA
        self.num_outputs += 1
        r = self.request
        return RequestOutput(
            request_id=r.request_id,
            prompt=r.prompt,
            prompt_token_ids=r.prompt_token_ids,  # the engine never changes it
            outputs=outputs,
            finished=self.done,
            prompt_logprobs=self._prompt_logprobs() if with_prompt else None,
            metrics=replace(self.metrics),
            num_cached_tokens=self.num_cached_tokens,
            num_host_cached_tokens=self.num_host_cached_tokens,
        )

    def _prompt_logprobs(self) -> list[PositionLogprobs | None] | None:
        if self.request.params.prompt_logprobs is None:
            return None
        positions = range(1, len(self.request.prompt_token_ids))  # the first token has none
        return [None, *(self.prompt_logprobs.get(i) for i in positions)]


class OutputProcessor:
    def __init__(
        self,
        tokenizer: PyengineTokenizer | None,
        eos_token_id: int | None,
        pooler: PoolerConfig | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.pooler = pooler  # the pooling runner's
        self.requests: dict[str, RequestState] = {}
        self.by_row_id: dict[str, tuple[RequestState, SampleState]] = {}
        self._finished: list[RequestState] = []  # done, not yet handed out
        self._stopped: list[str] = []  # rows a stop string ended, for the core

    def add_request(self, request: EngineRequest, row_ids: list[str]) -> None:
        # (a pooling request's one token is no text)
        tokenizer = self.tokenizer if request.pooling is None else None
        samples = [
            SampleState(
                k,
                row_id,
                None if tokenizer is None else IncrementalDetokenizer(tokenizer, request.params),
            )
            for k, row_id in enumerate(row_ids)
        ]
        state = RequestState(request, samples, RequestMetrics(request.arrival_time))
        self.requests[request.request_id] = state
        for s in samples:
            self.by_row_id[s.row_id] = (state, s)

    def abort_request(self, request_id: str) -> list[str]:
        """Ends the request's samples; returns the rows still running, for the core."""
        state = self.requests.get(request_id)
        if state is None:
            return []
        running = [s.row_id for s in state.samples if not s.finished]
        for s in state.samples:
            self._finish_sample(state, s, "abort")
        return running

    def take_stopped_rows(self) -> list[str]:
        """Rows that stop strings ended since the last call (the core finishes them)."""
        stopped, self._stopped = self._stopped, []
        return stopped

    def process(self, out: EngineCoreOutput) -> list[EngineOutput]:
        """The outputs of the requests that progressed in the step, and of every request
        finished since the last call (those leave the engine), as each one's
        output_kind asks."""
        for request_id, (cached, host) in out.num_cached_tokens.items():
            state = self.requests[request_id]
            state.num_cached_tokens, state.num_host_cached_tokens = cached, host
        for request_id, position, logprobs in out.prompt_logprobs:
            self._decode_logprobs(logprobs)
            self.requests[request_id].prompt_logprobs[position] = logprobs
        # Per row, its logits rows' logprobs in order: a row that verified drafts has one
        # for each of its new tokens (its accepted drafts, then one more), then unused.
        logprobs_of: dict[str, deque[PositionLogprobs]] = {}
        runner = out.runner_output
        if runner is not None and runner.pooled is not None:
            self._take_pooled(out.sampled_row_ids, runner.pooled)
        if runner is not None and runner.logprobs is not None:
            for row_id, lp in zip(out.sampled_row_ids, runner.logprobs, strict=True):
                if lp is not None:
                    logprobs_of.setdefault(row_id, deque()).append(lp)
        for row_id, (proposed, accepted) in out.drafts.items():
            if row_id not in self.by_row_id:  # (aborted during its step)
                continue
            metrics = self.by_row_id[row_id][0].metrics
            metrics.num_draft_tokens += proposed
            metrics.num_accepted_tokens += accepted
        now = time.time()
        progressed: dict[str, RequestState] = {}
        for row_id, token, reason in out.updates:
            state, sample = self.by_row_id[row_id]
            progressed[state.request.request_id] = state
            # (a row's accepted drafts come as several updates: none past a stop string)
            if token is not None and not sample.finished:
                entries = logprobs_of.get(row_id)
                self._append(state, sample, token, entries.popleft() if entries else None, now)
            if reason is not None and not sample.finished:
                self._finish_sample(state, sample, reason, token)
        return self._collect(list(progressed.values()))

    def _take_pooled(self, row_ids: list[str], pooled: np.ndarray) -> None:
        """Each pooling request's numbers, finished as its PoolingParams ask."""
        assert self.pooler is not None, "a pooling runner's step"
        for row_id, data in zip(row_ids, pooled, strict=True):
            found = self.by_row_id.get(row_id)
            params = None if found is None else found[0].request.pooling
            if found is not None and params is not None:
                found[0].pooled = finish_pooled(data, params, self.pooler)

    def _collect(self, progressed: list[RequestState]) -> list[EngineOutput]:
        """The outputs of `progressed` and of the requests finished since the last call,
        which leave the engine."""
        finished = self.discard_finished()
        ids = {id(state) for state in progressed}
        states = progressed + [f for f in finished if id(f) not in ids]
        return [out for out in (s.make_output() for s in states) if out is not None]

    def discard_finished(self) -> list[RequestState]:
        """Takes the requests finished since the last call out of the engine."""
        finished, self._finished = self._finished, []
        for state in finished:
            del self.requests[state.request.request_id]
            for s in state.samples:
                self.by_row_id.pop(s.row_id, None)
        return finished

    def _append(
        self,
        state: RequestState,
        sample: SampleState,
        token: int,
        logprobs: PositionLogprobs | None,
        now: float,
    ) -> None:
        sample.token_ids.append(token)
        if state.metrics.first_token_time is None:
            state.metrics.first_token_time = now
        if logprobs is not None:
            if sample.logprobs is None:
                # (decoded as read: most positions are read once, by a server, if at all)
                text = None if self.tokenizer is None else self.tokenizer.token_text
                sample.logprobs = FlatLogprobs(text)
                sample.cumulative_logprob = 0.0
            sample.logprobs.append(logprobs, token)
            sample.cumulative_logprob = (sample.cumulative_logprob or 0.0) + logprobs[token].logprob
        if sample.detokenizer is not None:
            stop = sample.detokenizer.add(sample.token_ids)
            if stop is not None:  # the detokenizer has ended the text at it
                sample.stop_reason = stop
                self._stopped.append(sample.row_id)
                self._finish_sample(state, sample, "stop", text_done=True)

    def _decode_logprobs(self, logprobs: PositionLogprobs) -> None:
        if self.tokenizer is not None:
            for token, lp in logprobs.items():
                lp.decoded_token = self.tokenizer.token_text(token)

    def _finish_sample(
        self,
        state: RequestState,
        sample: SampleState,
        reason: str,
        last_token: int | None = None,
        text_done: bool = False,
    ) -> None:
        if sample.finished:
            return
        sample.finish_reason = reason
        if reason == "stop" and sample.stop_reason is None and last_token is not None:
            sample.stop_reason = last_token if last_token != self.eos_token_id else None
        if not text_done and sample.detokenizer is not None:
            text_ids = sample.token_ids
            # A stop token's text is not the answer's (as vLLM), special or not.
            if reason == "stop" and last_token is not None:
                include = state.request.params.include_stop_str_in_output
                text_ids = text_ids if include else text_ids[:-1]
            sample.detokenizer.finish(text_ids)
        if all(s.finished for s in state.samples):
            state.done = True
            metrics = state.metrics
            metrics.finished_time = time.time()
            metrics.finish_reasons = [s.finish_reason or "abort" for s in state.samples]
            metrics.num_output_tokens = [len(s.token_ids) for s in state.samples]
            self._finished.append(state)
