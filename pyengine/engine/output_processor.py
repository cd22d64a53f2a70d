"""The output processor: from the core's per-row tokens to what callers read. It
detokenizes, finds stop strings, decodes logprobs, keeps each request's metrics, and
hands out RequestOutputs that are snapshots: no later step changes one."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field, replace

from pyengine.engine.core import EngineCoreOutput
from pyengine.engine.detokenizer import IncrementalDetokenizer
from pyengine.engine.input_processor import EngineRequest
from pyengine.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from pyengine.tokenizer import PyengineTokenizer


@dataclass
class SampleState:
    """One of a request's n samples."""

    index: int
    row_id: str  # the scheduler's id: the request's for sample 0, else sample_id(request, k)
    output: CompletionOutput  # the engine's, growing; callers get copies
    detokenizer: IncrementalDetokenizer | None  # the text so far, as tokens arrive
    finished: bool = False


@dataclass
class RequestState:
    request: EngineRequest
    samples: list[SampleState]
    metrics: RequestMetrics
    num_cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache
    num_host_cached_tokens: int = 0  # of them, those the KV host tier held
    done: bool = False
    prompt_logprobs: dict[int, PositionLogprobs] = field(default_factory=dict)  # by position

    def to_output(self) -> RequestOutput:
        """A snapshot: what later steps change (each sample's tokens, logprobs and text,
        the metrics) copied, so that they leave it as it is."""
        r = self.request
        return RequestOutput(
            request_id=r.request_id,
            prompt=r.prompt,
            prompt_token_ids=r.prompt_token_ids,  # the engine never changes it
            outputs=[_snapshot(s.output) for s in self.samples],
            finished=self.done,
            metrics=replace(self.metrics),
            num_cached_tokens=self.num_cached_tokens,
            num_host_cached_tokens=self.num_host_cached_tokens,
            prompt_logprobs=self._prompt_logprobs(),
        )

    def _prompt_logprobs(self) -> list[PositionLogprobs | None] | None:
        if self.request.params.prompt_logprobs is None:
            return None
        positions = range(1, len(self.request.prompt_token_ids))  # the first token has none
        return [None, *(self.prompt_logprobs.get(i) for i in positions)]


def _snapshot(output: CompletionOutput) -> CompletionOutput:
    logprobs = None if output.logprobs is None else list(output.logprobs)
    return replace(output, token_ids=list(output.token_ids), logprobs=logprobs)


class OutputProcessor:
    def __init__(self, tokenizer: PyengineTokenizer | None, eos_token_id: int | None) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.requests: dict[str, RequestState] = {}
        self.by_row_id: dict[str, tuple[RequestState, SampleState]] = {}
        self._finished: list[RequestState] = []  # done, not yet handed out
        self._stopped: list[str] = []  # rows a stop string ended, for the core

    def add_request(self, request: EngineRequest, row_ids: list[str]) -> None:
        params = request.params
        samples = [
            SampleState(
                k,
                row_id,
                CompletionOutput(k, "", []),
                None
                if self.tokenizer is None
                else IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens),
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

    def process(self, out: EngineCoreOutput, finished_only: bool = False) -> list[RequestOutput]:
        """Outputs of the requests that progressed in the step (or only the finished ones),
        and of every request finished since the last call; those leave the engine."""
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
        return self.collect([] if finished_only else list(progressed.values()))

    def collect(self, progressed: list[RequestState]) -> list[RequestOutput]:
        finished, self._finished = self._finished, []
        for state in finished:
            del self.requests[state.request.request_id]
            for s in state.samples:
                self.by_row_id.pop(s.row_id, None)
        ids = {id(state) for state in progressed}
        return [s.to_output() for s in progressed + [f for f in finished if id(f) not in ids]]

    def _append(
        self,
        state: RequestState,
        sample: SampleState,
        token: int,
        logprobs: PositionLogprobs | None,
        now: float,
    ) -> None:
        out = sample.output
        out.token_ids.append(token)
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
            if state.request.params.stop_strings:
                self._check_stop_strings(state, sample, new_from)

    def _decode_logprobs(self, logprobs: PositionLogprobs) -> None:
        if self.tokenizer is not None:
            for token, lp in logprobs.items():
                lp.decoded_token = self.tokenizer.token_text(token)

    def _check_stop_strings(self, state: RequestState, sample: SampleState, new_from: int) -> None:
        """Ends the sample at the first stop string that overlaps its text from `new_from`
        on (what the last token added; a token can add any number of characters)."""
        p = state.request.params
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
        self._stopped.append(sample.row_id)
        self._finish_sample(state, sample, "stop", text_done=True)

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
        sample.finished = True
        out = sample.output
        out.finish_reason = reason
        if reason == "stop" and out.stop_reason is None and last_token is not None:
            out.stop_reason = last_token if last_token != self.eos_token_id else None
        if not text_done and self.tokenizer is not None:
            params = state.request.params
            text_ids = out.token_ids
            # A stop token's text is not the answer's (as vLLM), special or not.
            if reason == "stop" and last_token is not None:
                text_ids = text_ids if params.include_stop_str_in_output else text_ids[:-1]
            out.text = self.tokenizer.decode(text_ids, params.skip_special_tokens)
        if all(s.finished for s in state.samples):
            state.done = True
            state.metrics.finished_time = time.time()
            self._finished.append(state)
