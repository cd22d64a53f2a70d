"""The clients of bench/soak.py: bare HTTP/1.1 over asyncio streams (a client library
would take CPU from the server on a 2-core machine, as bench/serve.py notes), each
client a behaviour (a plain request, one that disconnects mid-stream, one that never
reads, one that aborts, a malformed one), and each request's outcome."""

from __future__ import annotations

import asyncio
import contextlib
import enum
import json
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


class Outcome(enum.Enum):
    COMPLETED = "completed"
    REFUSED_429 = "refused 429"
    REFUSED_503 = "refused 503"
    REJECTED = "malformed, 4xx (expected)"
    MALFORMED_ACCEPTED = "malformed, not 4xx"
    ERRORED = "errored"
    CUT = "cut by the client"
    STALLED = "cut by the server (stalled)"  # a client that never read
    LOST = "lost"


class Truncated(Exception):
    """The connection ended before the whole answer: a lost request unless the client
    cut it itself."""


@dataclass
class Record:
    """One request as the client saw it."""

    kind: str  # "plain", "disconnect", "never_read", "abort", "malformed"
    sent: float = field(default_factory=time.perf_counter)
    status: int | None = None
    outcome: Outcome | None = None
    ttft: float | None = None  # first token's text (streams only)
    e2e: float | None = None  # the whole answer, or the refusal
    prompt_tokens: int = 0
    cached_tokens: int = 0
    retry_after: str | None = None
    detail: str = ""  # what went wrong, for the report


@dataclass(frozen=True)
class Call:
    """One HTTP request: where, what, with which key. A client that never reads asks
    for a small receive buffer and segment size (bytes): on loopback the server's send
    buffer grows with the segment size, to megabytes by default, and would take a
    long answer whole."""

    path: str
    body: bytes
    api_key: str | None
    stream: bool
    receive_buffer: int | None = None
    segment_size: int | None = None


async def connect(port: int, call: Call) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    """Opens a connection and sends `call` (Connection: close: one request a
    connection, so that the end of the answer is the end of the connection)."""
    sock = socket.socket()
    if call.receive_buffer is not None:  # (set before connecting: it sizes the window)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, call.receive_buffer)
    if call.segment_size is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_MAXSEG, call.segment_size)
    sock.setblocking(False)
    try:
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", port))
    except OSError:
        sock.close()
        raise
    reader, writer = await asyncio.open_connection(sock=sock)
    key = f"Authorization: Bearer {call.api_key}\r\n" if call.api_key else ""
    writer.write(
        f"POST {call.path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"{key}Content-Length: {len(call.body)}\r\nConnection: close\r\n\r\n".encode()
        + call.body
    )
    await writer.drain()
    return reader, writer


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status and the headers (names lower-cased)."""
    line = await reader.readline()
    if not line:
        raise Truncated("closed before a status line")
    status = int(line.split()[1])
    headers = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n"):
        if not line:
            raise Truncated("closed within the headers")
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def read_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[bytes]:
    """The body's pieces; Truncated where it ends early (a chunked body without its
    last chunk, fewer bytes than Content-Length)."""
    try:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            while True:
                size_line = await reader.readline()
                if not size_line:
                    raise Truncated("closed within a chunked body")
                size = int(size_line.split(b";")[0], 16)
                if size == 0:
                    return
                yield (await reader.readexactly(size + 2))[:-2]  # (+ its CRLF)
        elif "content-length" in headers:
            yield await reader.readexactly(int(headers["content-length"]))
        else:
            yield await reader.read()
    except asyncio.IncompleteReadError as error:
        raise Truncated("closed within the body") from error


async def sse_events(reader: asyncio.StreamReader, headers: dict[str, str]) -> AsyncIterator[str]:
    """The `data:` payloads of a Server-Sent Events body."""
    buffer = b""
    async for piece in read_body(reader, headers):
        buffer += piece
        while b"\n\n" in buffer:
            event, buffer = buffer.split(b"\n\n", 1)
            for line in event.split(b"\n"):
                if line.startswith(b"data: "):
                    yield line[6:].decode()


def has_text(event: dict[str, Any]) -> bool:
    """Whether a stream's event carries generated text (a chat stream's first events,
    the role, do not)."""
    for choice in event.get("choices") or ():
        delta = choice.get("delta") or {}
        if choice.get("text") or delta.get("content") or delta.get("tool_calls"):
            return True
    return False


def note_usage(record: Record, usage: dict[str, Any] | None) -> None:
    if usage:
        record.prompt_tokens = usage.get("prompt_tokens", 0)
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = details.get("cached_tokens") or 0


async def read_stream(
    reader: asyncio.StreamReader,
    headers: dict[str, str],
    record: Record,
    cut_after_events: int | None,
) -> None:
    """Reads a 200 stream to its end ([DONE], or an error event), timing the first
    text; with `cut_after_events`, the client stops reading after that many events of
    text (a client that goes away mid-stream)."""
    events = 0
    async for data in sse_events(reader, headers):
        if data == "[DONE]":
            record.outcome = Outcome.COMPLETED
            return
        event = json.loads(data)
        if "error" in event:
            record.outcome, record.detail = Outcome.ERRORED, data[:300]
            return
        note_usage(record, event.get("usage"))
        if has_text(event):
            events += 1
            if record.ttft is None:
                record.ttft = time.perf_counter() - record.sent
            if cut_after_events is not None and events >= cut_after_events:
                record.outcome = Outcome.CUT
                return
    raise Truncated("a stream ended without [DONE]")


def classify_status(record: Record, status: int, headers: dict[str, str]) -> bool:
    """Sets the outcome of an answer that is not a 200 (True), or leaves it (False)."""
    record.status = status
    if status == 200:
        return False
    record.e2e = time.perf_counter() - record.sent
    if status in (429, 503):
        record.outcome = Outcome.REFUSED_429 if status == 429 else Outcome.REFUSED_503
        record.retry_after = headers.get("retry-after")
    elif record.kind == "malformed":
        record.outcome = Outcome.REJECTED if 400 <= status < 500 else Outcome.MALFORMED_ACCEPTED
    else:
        record.outcome = Outcome.ERRORED
    return True


async def exchange(
    port: int, call: Call, record: Record, cut_after_events: int | None = None
) -> None:
    """Sends `call` and reads its whole answer into `record`; a connection that ends
    early is a lost request."""
    record.sent = time.perf_counter()  # (not when the record was made: it may have queued)
    writer = None
    try:
        reader, writer = await connect(port, call)
        status, headers = await read_head(reader)
        if classify_status(record, status, headers):
            async for piece in read_body(reader, headers):
                record.detail += piece[:300].decode(errors="replace")
        elif call.stream:
            await read_stream(reader, headers, record, cut_after_events)
        else:
            body = b"".join([piece async for piece in read_body(reader, headers)])
            answer = json.loads(body)
            note_usage(record, answer.get("usage"))
            record.outcome = Outcome.COMPLETED
            if record.kind == "malformed":
                record.outcome = Outcome.MALFORMED_ACCEPTED
        if record.outcome is Outcome.COMPLETED:
            record.e2e = time.perf_counter() - record.sent
    except (Truncated, ConnectionError, OSError) as error:
        record.outcome, record.detail = Outcome.LOST, f"{type(error).__name__}: {error}"
    finally:
        if writer is not None:
            writer.close()


async def abort_after(port: int, call: Call, record: Record, delay: float) -> None:
    """A client that gives up after `delay` seconds, whatever it has by then; an answer
    that came sooner counts as it came."""
    try:
        await asyncio.wait_for(exchange(port, call, record), delay)
    except asyncio.TimeoutError:
        record.outcome = Outcome.CUT  # (exchange's finally closed the connection)


async def never_read(
    port: int, call: Call, record: Record, load_over: asyncio.Event, hold: float
) -> None:
    """Sends a stream and reads nothing for `hold` seconds (or until the load is over);
    then takes what has come (did the server end the stream, or refuse it?) and
    closes."""
    try:
        reader, writer = await connect(port, call)
    except OSError as error:
        record.outcome, record.detail = Outcome.LOST, f"{type(error).__name__}: {error}"
        return
    try:
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(load_over.wait(), hold)
        seen, ended = await drain_briefly(reader)
        status = int(seen.split(b" ", 2)[1]) if seen.startswith(b"HTTP/1.1 ") else None
        if status in (429, 503):
            head = seen.split(b"\r\n\r\n", 1)[0].decode("latin-1").lower()
            classify_status(record, status, {"retry-after": "1"} if "retry-after" in head else {})
            record.e2e = None  # (not a refusal's latency: it was read late)
        else:
            record.status = status
            stalled = ended and b"data: [DONE]" not in seen  # (closed before its end)
            record.outcome = Outcome.STALLED if stalled else Outcome.CUT
    finally:
        writer.close()


async def drain_briefly(reader: asyncio.StreamReader, seconds: float = 1.0) -> tuple[bytes, bool]:
    """What the connection holds now (up to 4 MiB or `seconds`), and whether it ended
    (closed or reset): a stream the server ended reads to its end at once, one still
    running keeps coming."""
    seen = b""
    deadline = time.monotonic() + seconds
    while len(seen) < 4 << 20 and (left := deadline - time.monotonic()) > 0:
        try:
            piece = await asyncio.wait_for(reader.read(1 << 16), min(left, 0.2))
        except asyncio.TimeoutError:
            break
        except ConnectionError:
            return seen, True
        if not piece:
            return seen, True
        seen += piece
    return seen, False


async def get(port: int, path: str, timeout: float = 10.0) -> tuple[int, bytes]:
    """A GET's status and body (/health, /metrics)."""

    async def fetch() -> tuple[int, bytes]:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n".encode()
            )
            status, headers = await read_head(reader)
            return status, b"".join([piece async for piece in read_body(reader, headers)])
        finally:
            writer.close()

    return await asyncio.wait_for(fetch(), timeout)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text: each series (name with its labels, as written) to its value."""
    values = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            series, _, value = line.rpartition(" ")
            values[series] = float(value)
    return values


def metric(values: dict[str, float], name: str) -> float:
    """The sum of a metric's series (pyengine: labels only by model name)."""
    return sum(v for k, v in values.items() if k == name or k.startswith(name + "{"))
