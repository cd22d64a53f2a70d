"""Clients that stop reading: a response whose client takes no data for the stall timeout
(`--stream-stall-timeout`) has its connection closed, which ends it as a client that
disconnects does (its engine requests aborted, their KV blocks freed).

What a stream holds meanwhile is bounded on every side: the engine thread merges a
request's news into one update its reader has not taken (async_engine._Stream), and the
connection holds what uvicorn's flow control lets through (its transport's high-water
mark, then the socket's buffers). Once those are full a send waits; a send that has
waited for the timeout is the stall. The engine thread never waits for any of it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any, Protocol

logger = logging.getLogger("pyengine")

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Any, Send], Awaitable[None]]

DEFAULT_STALL_TIMEOUT = 30.0
# Where a handler notes the engine requests its response streams (in the request's
# `state`, which every copy of its scope shares): the stall's log line names them.
REQUEST_IDS = "pyengine.request_ids"


class StallGuard:
    """ASGI middleware around the app (it needs the server's own `send`, which belongs to
    the connection; drain.DrainGate, around it, passes that on): closes the connection
    of a response whose send has waited `timeout` seconds, logs it and calls
    `on_stalled` (the metrics' counter)."""

    def __init__(
        self, app: ASGIApp, timeout: float, on_stalled: Callable[[], None] | None = None
    ) -> None:
        if timeout <= 0:
            raise ValueError(f"the stall timeout must be positive, got {timeout}")
        self.app = app
        self.timeout = timeout
        self.on_stalled = on_stalled

    async def __call__(self, scope: Scope, receive: Any, send: Send) -> None:
        if scope["type"] != "http":  # (the lifespan)
            await self.app(scope, receive, send)
            return
        watch = SendWatch(send, self.timeout, lambda task: self._stalled(scope, send, task))
        try:
            await self.app(scope, receive, watch.send)
        finally:
            watch.close()

    def _stalled(self, scope: Scope, send: Send, task: asyncio.Task[Any] | None) -> None:
        client = scope.get("client") or ("?", 0)
        requests = scope.get("state", {}).get(REQUEST_IDS)
        logger.warning(
            "client %s:%s took no data for %g s: closing its connection (%s %s%s)",
            client[0], client[1], self.timeout, scope.get("method"), scope.get("path"),
            f"; aborting {', '.join(requests)}" if requests else "",
        )  # fmt: skip
        if self.on_stalled is not None:
            self.on_stalled()
        transport = _transport(send)
        if transport is not None:
            # At once, dropping what it buffers (a plain close would wait for the client to
            # read it). The server sees a disconnect: the waiting send returns, the response
            # ends and its requests are aborted.
            transport.abort()
        elif task is not None:
            task.cancel()  # (not uvicorn: the handler at least does not wait for ever)


class SendWatch:
    """Times one response's sends with one timer, not one per send (a streamed token's
    send is on the per-token path): the timer is armed for a send's deadline; when it
    fires, that same send still waiting is a stall; a later send waiting gets its own
    deadline; none waiting disarms it until the next send."""

    def __init__(
        self,
        send: Send,
        timeout: float,
        on_stall: Callable[[asyncio.Task[Any] | None], None],
    ) -> None:
        self._send = send
        self._timeout = timeout
        self._on_stall = on_stall
        self._loop = asyncio.get_running_loop()
        self._sends = 0  # (numbers each send)
        self._began: float | None = None  # when the send in progress began
        self._task: asyncio.Task[Any] | None = None  # the one waiting in it
        self._timer: asyncio.TimerHandle | None = None
        self._timed = 0  # the send the timer is for

    async def send(self, message: Message) -> None:
        self._sends += 1
        self._began = self._loop.time()
        self._task = asyncio.current_task()
        if self._timer is None:
            self._arm()
        try:
            await self._send(message)
        finally:
            self._began = None

    def _arm(self) -> None:
        assert self._began is not None
        self._timed = self._sends
        self._timer = self._loop.call_at(self._began + self._timeout, self._fire)

    def _fire(self) -> None:
        self._timer = None
        if self._began is None:
            return  # no send waiting
        if self._sends == self._timed:
            self._on_stall(self._task)
        else:
            self._arm()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


class _Abortable(Protocol):
    def abort(self) -> None: ...


def _transport(send: Send) -> _Abortable | None:
    """The connection's transport behind uvicorn's `send` (a bound method of its
    request-response cycle, which holds it); None behind another server. (ASGI has no
    way to drop a connection whose buffers are full: a close would wait for them.)"""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    return transport if callable(getattr(transport, "abort", None)) else None
