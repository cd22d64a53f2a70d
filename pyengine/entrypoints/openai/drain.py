"""Draining on SIGTERM (a container's stop) or Ctrl-C: new requests are answered 503 at
once while the requests in flight run to their end, within the shutdown timeout; those
still running then end with an error (an error event in a stream), and the server
exits. A second signal ends it at once, as uvicorn's own."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import uvicorn

from pyengine.entrypoints.openai.errors import APIError, error_response

logger = logging.getLogger(__name__)

# What a request may still reach while the server drains: what it knows of itself.
_OPEN_WHILE_DRAINING = ("/metrics",)


class DrainGate:
    """ASGI middleware around the whole app: counts the requests in flight and, once
    `draining`, answers every new one 503 (/health too, so that a balancer stops sending
    them) with `Connection: close`."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app
        self.draining = False
        self.in_flight = 0

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining and scope["path"] not in _OPEN_WHILE_DRAINING:
            error = APIError("the server is shutting down", status=503,
                             headers={"Connection": "close"})  # fmt: skip
            await error_response(error, scope["path"])(scope, receive, send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose first SIGTERM or SIGINT drains through `gate` for up to
    `timeout` seconds, then fails what is left through `fail_all`, then stops."""

    def __init__(
        self,
        config: uvicorn.Config,
        gate: DrainGate,
        timeout: float,
        fail_all: Callable[[str], Awaitable[None]],
    ) -> None:
        super().__init__(config)
        self.gate = gate
        self.timeout = timeout
        self.fail_all = fail_all
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain: asyncio.Future[None] | None = None

    async def serve(self, sockets: Any = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.gate.draining or self._loop is None or self.should_exit:
            super().handle_exit(sig, frame)  # a second signal: now
            return
        self._captured_signals.append(sig)  # (raised again once the server is down)
        self.gate.draining = True
        logger.info(
            "%s: draining (new requests 503; %d in flight, up to %g s)",
            signal.Signals(sig).name, self.gate.in_flight, self.timeout,
        )  # fmt: skip
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain = asyncio.ensure_future(self._drain_then_stop())

    async def _drain_then_stop(self) -> None:
        deadline = time.monotonic() + self.timeout
        while self.gate.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if self.gate.in_flight:
            logger.warning(
                "%d requests still in flight after the shutdown timeout: ended with an error",
                self.gate.in_flight,
            )
            await self.fail_all(
                f"the server shut down before the request finished ({self.timeout:g} s "
                "shutdown timeout)"
            )
            # (their error events and answers go out before the connections close)
            end = time.monotonic() + 5.0
            while self.gate.in_flight and time.monotonic() < end:
                await asyncio.sleep(0.05)
        self.should_exit = True
