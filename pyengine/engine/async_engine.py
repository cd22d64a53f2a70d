"""AsyncLLMEngine: the engine loop in a background thread, requests streamed to asyncio.

The LLMEngine belongs to one thread, which takes commands (add, abort, stop) between
steps and runs steps while any request is unfinished; all requests share its continuous
batch. Its requests ask for deltas (RequestOutputKind.DELTA): each step's news goes back
to the event loop in one call, as the output processor made it, a RequestOutput per
request that progressed holding what the step added (text that could still turn out to
begin a stop string held back until it cannot). A reader that falls behind (a client
whose socket is full) holds one output, the steps' deltas merged into it, never one per
step: the engine thread never waits for a reader. A caller without an event loop (the C
API's bridge) queues with add_request_nowait and a sink of its own, which the engine
thread calls directly.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from pyengine import _C
from pyengine.engine.llm_engine import LLMEngine
from pyengine.engine.stats import EngineStats
from pyengine.faults import RequestFault
from pyengine.flat_logprobs import FlatLogprobs
from pyengine.lora.request import LoRARequest
from pyengine.outputs import EngineOutput, RequestOutput
from pyengine.pooling_params import PoolingParams
from pyengine.sampling_params import RequestOutputKind, SamplingParams

logger = logging.getLogger("pyengine")


class OutputSink(Protocol):
    """Where a request's deltas go: put and fail run on `loop` (posted to it), or on the
    engine thread itself where loop is None (so they must be quick and never block)."""

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None: ...

    def put(self, delta: EngineOutput) -> None: ...

    def fail(self, error: BaseException) -> None: ...


@dataclass
class _Stream:
    """A request's deltas that its reader has not taken: at most one, into which later
    steps' deltas are merged (as vLLM's RequestOutputCollector), so that a reader that
    falls behind costs one output's memory, not one per step. `put`, `fail` and `take`
    run on `loop`."""

    loop: asyncio.AbstractEventLoop
    _pending: EngineOutput | None = field(default=None, init=False)
    _error: BaseException | None = field(default=None, init=False)  # (after every output)
    _ready: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    def put(self, delta: EngineOutput) -> None:
        if self._pending is None:
            self._pending = delta
            self._ready.set()
        else:  # (a pooling request has one output)
            assert isinstance(self._pending, RequestOutput) and isinstance(delta, RequestOutput)
            _merge(self._pending, delta)

    def fail(self, error: BaseException) -> None:
        self._error = error
        self._ready.set()

    async def take(self) -> EngineOutput | BaseException:
        """The deltas since the last take, merged; the error once none is left."""
        if self._pending is None and self._error is None:
            self._ready.clear()
            await self._ready.wait()
        delta, self._pending = self._pending, None
        if delta is not None:
            return delta
        assert self._error is not None
        return self._error


@dataclass
class _Command:
    kind: str  # "add", "abort", "fail_all", "stop"
    request_id: str = ""
    args: tuple[Any, ...] = ()
    done: concurrent.futures.Future[None] = field(default_factory=concurrent.futures.Future)


class EngineDeadError(RuntimeError):
    pass


class EngineStepError(RuntimeError):
    """A step that ran the request failed: the request was aborted, the engine serves on."""


class RequestStream:
    """One request's deltas (RequestOutputs of what its steps added), in order, until the
    one that finishes it; a pooling request's one PoolingRequestOutput."""

    def __init__(self, engine: AsyncLLMEngine, request_id: str, stream: _Stream) -> None:
        self.request_id = request_id
        self.finished = False
        self._engine = engine
        self._stream = stream
        # Called once each: at the first delta or at close, and once it has finished or
        # failed, or at close (a bound on waiting requests).
        self.on_start: Callable[[], None] | None = None
        self.on_end: Callable[[], None] | None = None

    def _started(self) -> None:
        if self.on_start is not None:
            on_start, self.on_start = self.on_start, None
            on_start()

    def _ended(self) -> None:
        self._started()
        if self.on_end is not None:
            on_end, self.on_end = self.on_end, None
            on_end()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> EngineOutput:
        if self.finished:
            raise StopAsyncIteration
        delta = await self._stream.take()
        self._started()
        if isinstance(delta, BaseException):
            self.finished = True
            self._ended()
            raise delta
        self.finished = delta.finished
        if self.finished:
            self._ended()
        return delta

    def close(self) -> None:
        """Aborts the request unless it has finished."""
        self._ended()
        if not self.finished:
            self.finished = True
            self._engine.abort(self.request_id)


class AsyncLLMEngine:
    """Runs `llm_engine` in a background thread from `start()` until `stop()`."""

    def __init__(
        self,
        llm_engine: LLMEngine,
        on_step: Callable[[EngineStats, list[RequestOutput], int], None] | None = None,
        step_timeout: float | None = None,
    ) -> None:
        self.llm_engine = llm_engine
        # A step running longer than this (seconds) is a hang: unhealthy, no new requests
        # until it ends.
        self.step_timeout = step_timeout
        self._step_started: float | None = None  # (time.monotonic() of the running step)
        self.tokenizer = llm_engine.tokenizer
        self.model_config = llm_engine.model_config
        self.config = llm_engine.config
        self.input_processor = llm_engine.input_processor  # stateless: any thread tokenizes
        self.stats = EngineStats()
        # Called on the engine thread after each step: the stats, the last deltas of the
        # requests that finished (their metrics say what /metrics records of them), and
        # the number of tokens generated.
        self._on_step = on_step
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._streams: dict[str, OutputSink] = {}  # touched only on the engine thread
        self._thread = threading.Thread(target=self._run, name="pyengine-engine", daemon=True)
        self._error: BaseException | None = None
        self._failed_before = False  # the last step failed too

    # -- the event loop's side -------------------------------------------------------

    def start(self) -> None:
        # The engine thread runs the kernels from now on: the pool of OpenMP workers that
        # building the engine (its profile step) made for this thread goes, or the two
        # pools would outnumber the cores and every parallel region wait on sleeping
        # workers (the OpenMP runtime stops spinning them).
        _C.release_thread_pool()
        self._thread.start()
        if self.step_timeout is not None:
            threading.Thread(target=self._watch_steps, name="pyengine-step-watchdog",
                             daemon=True).start()  # fmt: skip
        # An interpreter that exits with a step running would be torn down under it. (A
        # weak reference: the engine and its model go when their last user drops them.)
        atexit.register(_stop_at_exit, weakref.ref(self))

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive()

    def check_health(self) -> bool:
        """Running, with every worker there (a worker that died between steps is
        noticed here, and ends the executor: the next step fails at once), and no step
        running past step_timeout."""
        return (
            self._thread.is_alive()
            and self.stalled_step() is None
            and self.llm_engine.executor.check_health()
        )

    def stalled_step(self) -> float | None:
        """How long the step now running has run, where that is past step_timeout."""
        started = self._step_started
        if self.step_timeout is None or started is None:
            return None
        running = time.monotonic() - started
        return running if running > self.step_timeout else None

    def stop(self, timeout: float = 30.0) -> None:
        """Aborts every request (their streams end with finish_reason "abort") and joins
        the engine thread."""
        if self._thread.is_alive():
            self._submit(_Command("stop"))
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self.llm_engine.shutdown()  # the workers (their processes) end with the engine

    async def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Queues a request (through lora_request's adapter); a bad one raises ValueError
        here, and EngineDeadError while a step hangs (past step_timeout). Iterate the
        returned stream for its deltas (whatever params.output_kind says); close it to
        abort the request (a client gone)."""
        args = (prompt_token_ids, params, prompt, lora_request, priority, cache_salt)
        return await self._queue("add", request_id, args)

    async def add_pooling_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        prompt: str | None = None,
        token_type_ids: list[int] | None = None,
        priority: int = 0,
    ) -> RequestStream:
        """Queues a pooling request (runner "pooling"), as add_request does; its stream
        has one output, a PoolingRequestOutput."""
        args = (prompt_token_ids, params, prompt, token_type_ids, priority)
        return await self._queue("pool", request_id, args)

    async def _queue(self, kind: str, request_id: str, args: tuple[Any, ...]) -> RequestStream:
        """Hands an "add" or "pool" command to the engine thread; the request's stream."""
        stalled = self.stalled_step()
        if stalled is not None:
            raise EngineDeadError(
                f"the engine's step has run for {stalled:.0f} s, past its timeout of "
                f"{self.step_timeout:g} s: no new requests until it ends"
            )
        stream = _Stream(asyncio.get_running_loop())
        command = _Command(kind, request_id, (*args, stream))
        try:
            await asyncio.wrap_future(self._submit(command).done)
        except asyncio.CancelledError:
            # The caller went away (a client that disconnected) after the engine thread
            # took the command: the request runs unread, so it is aborted.
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, stream)

    def abort(self, request_id: str) -> concurrent.futures.Future[None] | None:
        """Queues the abort; its future is done once the engine thread has aborted the
        request (its KV blocks freed), None where the engine has stopped."""
        if not self._thread.is_alive():
            return None
        return self._submit(_Command("abort", request_id)).done

    def add_request_nowait(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        sink: OutputSink,
        prompt: str | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> None:
        """Queues a request without waiting for the engine thread, which may be in a long
        step (a caller that submits many requests one after another gets them into one
        batch). It is checked here, on the caller's thread, so that a bad request raises
        ValueError at once; what only the engine thread can refuse goes to sink.fail."""
        self.llm_engine.adapters.check(lora_request)
        self.input_processor.process(
            request_id, prompt_token_ids, params, prompt, lora_request=lora_request,
            priority=priority,
        )  # fmt: skip
        args = (prompt_token_ids, params, prompt, lora_request, priority, None, sink)
        self._queue_nowait(_Command("add", request_id, args), sink)

    def add_pooling_request_nowait(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        sink: OutputSink,
        prompt: str | None = None,
    ) -> None:
        """A pooling request, queued as add_request_nowait queues one."""
        self.input_processor.process_pooling(request_id, prompt_token_ids, params, prompt)
        args = (prompt_token_ids, params, prompt, None, 0, sink)
        self._queue_nowait(_Command("pool", request_id, args), sink)

    def _queue_nowait(self, command: _Command, sink: OutputSink) -> None:
        def refused(done: concurrent.futures.Future[None]) -> None:
            error = done.exception()
            if error is not None:
                sink.fail(error)

        self._submit(command).done.add_done_callback(refused)

    async def fail_all(self, reason: str) -> None:
        """Aborts every request; each stream ends with EngineDeadError(reason) (a shutdown
        that could wait no longer), not as a plain abort."""
        if self._thread.is_alive():
            await asyncio.wrap_future(self._submit(_Command("fail_all", args=(reason,))).done)

    def _submit(self, command: _Command) -> _Command:
        if not self._thread.is_alive():
            raise EngineDeadError(f"the engine is not running ({self._error or 'stopped'})")
        self._commands.put(command)
        if not self._thread.is_alive():  # it ended after the check above
            self._refuse_queued_commands()
        return command

    # -- the engine thread -----------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._serve_commands():
                if self.llm_engine.has_unfinished_requests():
                    self._step()
        except BaseException as error:  # a bug: fail every stream rather than hang it
            logger.exception("the engine loop failed")
            self._error = error
            for stream in self._streams.values():
                _post(stream.loop, stream.fail, error)
            raise
        finally:
            self._refuse_queued_commands()

    def _refuse_queued_commands(self) -> None:
        """Commands that raced with the end of the loop fail instead of waiting forever."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if not command.done.done():
                command.done.set_exception(EngineDeadError("the engine has stopped"))

    def _serve_commands(self) -> bool:
        """Runs the queued commands (waits for one while there is nothing to step);
        False once told to stop."""
        idle = not self.llm_engine.has_unfinished_requests()
        while True:
            try:
                command = self._commands.get(block=idle)
            except queue.Empty:
                return True
            idle = False
            if command.kind != "stop" and not command.done.set_running_or_notify_cancel():
                continue  # cancelled by its caller while queued: nobody waits for it
            if command.kind == "stop":
                for request_id in list(self._streams):
                    self.llm_engine.abort_request(request_id)
                while self.llm_engine.has_unfinished_requests():
                    self._step()
                command.done.set_result(None)
                return False
            try:
                if command.kind == "add":
                    self._add(command.request_id, *command.args)
                elif command.kind == "pool":
                    self._add_pooling(command.request_id, *command.args)
                elif command.kind == "fail_all":
                    self._fail_all(*command.args)
                else:
                    self.llm_engine.abort_request(command.request_id)
            except Exception as error:
                command.done.set_exception(error)
            else:
                command.done.set_result(None)

    def _add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        lora_request: LoRARequest | None,
        priority: int,
        cache_salt: str | None,
        stream: OutputSink,
    ) -> None:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        # A stream carries deltas: what each step added, merged while its reader lags.
        self.llm_engine.add_request(
            request_id, prompt_token_ids, params, prompt=prompt, lora_request=lora_request,
            priority=priority, cache_salt=cache_salt, output_kind=RequestOutputKind.DELTA,
        )  # fmt: skip
        self._streams[request_id] = stream

    def _add_pooling(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: PoolingParams,
        prompt: str | None,
        token_type_ids: list[int] | None,
        priority: int,
        stream: OutputSink,
    ) -> None:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running")
        self.llm_engine.add_pooling_request(
            request_id, prompt_token_ids, params, prompt, token_type_ids, priority=priority
        )
        self._streams[request_id] = stream

    def _step(self) -> None:
        self._step_started = time.monotonic()
        try:
            outputs = self.llm_engine.step()
        except RequestFault as fault:
            # Pinned on some requests (their adapter...): they alone were aborted, and
            # the step is retried without them. The engine is as sound as before.
            failed = self.llm_engine.core.failed_request_ids
            logger.warning("requests %s failed a step, which runs again without them: %s",
                           ", ".join(sorted(failed)), fault)  # fmt: skip
            outputs = []
            self._fail_streams(failed, fault)
        except Exception as error:
            # LLMEngine.step has already ended the step's requests; their aborts come
            # out of the next step, and the engine keeps serving the others. If that
            # step fails too, or the executor lost a worker, the engine itself is broken:
            # the loop ends (every stream gets the error, /health says so) rather than
            # fail forever.
            if self._failed_before or not self.llm_engine.executor.is_alive:
                raise
            logger.exception("an engine step failed; its requests were aborted")
            self._failed_before = True
            outputs = []
            self._fail_streams(self.llm_engine.core.failed_request_ids, error)
        else:
            self._failed_before = False
        finally:
            self._step_started = None
        deliveries: list[tuple[OutputSink, EngineOutput]] = []
        finished: list[RequestOutput] = []
        generated = 0
        for out in outputs:
            # (popped, not read then deleted: the watchdog may have taken it meanwhile)
            pick = self._streams.pop if out.finished else self._streams.get
            stream = pick(out.request_id, None)
            if stream is None:
                continue
            deliveries.append((stream, out))
            if isinstance(out, RequestOutput):  # (a pooling request's is no generation)
                generated += sum(len(o.token_ids) for o in out.outputs)
                if out.finished:
                    finished.append(out)
        self._update_stats()
        if self._on_step is not None:
            self._on_step(self.stats, finished, generated)
        for loop, batch in _by_loop(deliveries).items():
            _post(loop, _deliver, batch)

    def _watch_steps(self) -> None:
        """On its own thread: a step that runs past step_timeout cannot be interrupted, so
        every request ends now with EngineDeadError (each stream taken by one atomic pop,
        as the engine thread takes them), and is aborted once the step returns."""
        assert self.step_timeout is not None
        failed_step: float | None = None  # (the start of the step already failed)
        while self._thread.is_alive():
            time.sleep(min(self.step_timeout / 4, 0.5))
            started = self._step_started
            if started is None or started == failed_step:
                continue
            running = time.monotonic() - started
            if running <= self.step_timeout:
                continue
            failed_step = started
            logger.error("an engine step has run %.1f s, past its timeout: its requests "
                         "end with an error", running)  # fmt: skip
            self._fail_hung_step(running)

    def _fail_hung_step(self, running: float) -> None:
        """(the watchdog's thread) Ends every stream; the engine thread aborts their
        requests once the step returns."""

        def hang(request_id: str) -> EngineDeadError:
            return EngineDeadError(
                f"the engine's step has run for {running:.0f} s, past its timeout of "
                f"{self.step_timeout:g} s: request {request_id} ended"
            )

        for request_id in self._end_every_stream(hang):
            self._commands.put(_Command("abort", request_id))

    def _fail_all(self, reason: str) -> None:
        """(the engine thread) Ends every stream with `reason`, aborting its request."""
        for request_id in self._end_every_stream(lambda _: EngineDeadError(reason)):
            self.llm_engine.abort_request(request_id)

    def _end_every_stream(self, error_of: Callable[[str], BaseException]) -> list[str]:
        """Takes every stream, each by one atomic pop (the engine thread, the watchdog and
        fail_all may race for one), ends it with error_of(its request id), and returns
        the request ids it ended: the caller aborts them."""
        ended = []
        for request_id in list(self._streams):
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                _post(stream.loop, stream.fail, error_of(request_id))
                ended.append(request_id)
        return ended

    def _fail_streams(self, request_ids: set[str], error: Exception) -> None:
        """The requests of a failed step end with the error, not as plain aborts: what
        its own input caused (a RequestFault's message), else only the error's kind (a
        worker's traceback is for the log, which has it, not for the client)."""
        for request_id in request_ids:
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                cause = error if isinstance(error, RequestFault) else type(error).__name__
                failure = EngineStepError(
                    f"request {request_id} failed: {cause} (the server's log has the details)"
                )
                _post(stream.loop, stream.fail, failure)

    def _update_stats(self) -> None:
        # A snapshot, taken on the engine thread (the only one that reads the scheduler).
        self.stats = self.llm_engine.stats()


def _stop_at_exit(engine: weakref.ref[AsyncLLMEngine]) -> None:
    alive = engine()
    if alive is not None:
        alive.stop()


def _post(
    loop: asyncio.AbstractEventLoop | None, callback: Callable[..., None], *args: Any
) -> None:
    """Runs callback(*args) on `loop` (here and now where it is None); nothing where the
    loop is closed (its readers are gone: a script that ended, the stop at interpreter
    exit)."""
    if loop is None:
        callback(*args)
        return
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise


def _by_loop(
    deliveries: list[tuple[OutputSink, EngineOutput]],
) -> dict[asyncio.AbstractEventLoop | None, list[tuple[OutputSink, EngineOutput]]]:
    groups: dict[asyncio.AbstractEventLoop | None, list[tuple[OutputSink, EngineOutput]]] = {}
    for stream, delta in deliveries:
        groups.setdefault(stream.loop, []).append((stream, delta))
    return groups


def _deliver(batch: list[tuple[OutputSink, EngineOutput]]) -> None:
    for stream, delta in batch:
        stream.put(delta)


def _merge(into: RequestOutput, later: RequestOutput) -> None:
    """Adds `later` to `into`, a delta of the same request its reader has not taken:
    each sample's text, tokens and logprobs appended, the rest as `later` has it."""
    earlier = {s.index: s for s in into.outputs}
    for sample in later.outputs:
        mine = earlier.get(sample.index)
        if mine is None:
            into.outputs.append(sample)
            continue
        mine.text += sample.text
        mine.token_ids += sample.token_ids
        if sample.logprobs is not None:
            mine.logprobs = mine.logprobs if mine.logprobs is not None else FlatLogprobs()
            mine.logprobs += sample.logprobs  # type: ignore[operator]
        mine.finish_reason, mine.stop_reason = sample.finish_reason, sample.stop_reason
        mine.cumulative_logprob = sample.cumulative_logprob
    into.finished = later.finished
    into.metrics = later.metrics
    into.num_cached_tokens = later.num_cached_tokens
    into.num_host_cached_tokens = later.num_host_cached_tokens
    if into.prompt_logprobs is None:  # (only the first delta has them)
        into.prompt_logprobs = later.prompt_logprobs
