"""The app's own middlewares, outermost first: `BodySizeLimit`, CORS, then `ApiKeyCheck`.
Both of ours are plain ASGI middlewares: Starlette's BaseHTTPMiddleware would pass every
chunk of a stream through a task and a memory stream of its own, costing each streamed
token. The guards around the whole app, outside FastAPI's middleware stack, are in
slow_clients.py (`StallGuard`, which needs uvicorn's own `send`) and drain.py
(`DrainGate`)."""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from pyengine.entrypoints.openai.errors import APIError, error_response

DEFAULT_MAX_BODY_BYTES = 32 * 2**20


def add_middlewares(
    app: FastAPI,
    api_keys: Sequence[str],
    cache_salt_per_api_key: bool,
    allowed_origins: Sequence[str],
    max_request_body_bytes: int,
) -> None:
    """Wraps the app in the key check (none without keys), CORS and the body size limit.
    Starlette runs the middleware added last outermost."""
    if api_keys:
        app.add_middleware(ApiKeyCheck, api_keys=api_keys, salt_per_key=cache_salt_per_api_key)
    elif cache_salt_per_api_key:
        raise ValueError("--cache-salt-per-api-key needs --api-key")
    # After the key check, so outside it: preflights are answered here (as vLLM's server).
    app.add_middleware(
        CORSMiddleware,
        allow_origins=allowed_origins,
        allow_methods=["*"],
        allow_headers=["*"],
    )
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)  # (outermost)


class BodySizeLimit:
    """Refuses a request body larger than max_bytes with 413, before anything parses it:
    by its Content-Length, or, for a chunked body, once what arrived passes the limit."""

    def __init__(self, app: Callable[..., Awaitable[None]], max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # (gone before its body came)
                await self.app(scope, _replaying(message, receive), send)
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._refuse(scope, receive, send)
                return
            if not message.get("more_body"):
                break
        whole = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replaying(whole, receive), send)

    async def _refuse(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        error = APIError(f"the request body is larger than {self.max_bytes} bytes", status=413)
        await error_response(error)(scope, receive, send)


def _replaying(first: dict[str, Any], receive: Any) -> Callable[[], Awaitable[dict[str, Any]]]:
    """A receive that gives `first`, then what `receive` gives (the disconnect)."""
    given = False

    async def replay() -> dict[str, Any]:
        nonlocal given
        if not given:
            given = True
            return first
        return await receive()  # type: ignore[no-any-return]

    return replay


class ApiKeyCheck:
    """Refuses /v1 requests without `Authorization: Bearer <key>` of one of the keys,
    compared in constant time (how long a refusal takes says nothing of a key); with
    salt_per_key, a request's scope carries its key's cache salt (SALT)."""

    SALT = "pyengine.cache_salt"

    def __init__(
        self, app: Callable[..., Awaitable[None]], api_keys: Sequence[str], salt_per_key: bool
    ) -> None:
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]
        # (a salt no request can guess from another key's)
        self.salts = [hashlib.sha256(b"pyengine-salt:" + key).hexdigest() for key in self.expected]
        self.salt_per_key = salt_per_key

    def key_index(self, header: bytes) -> int | None:
        """Which key `header` gives (every key compared: the time is the same for all)."""
        matches = [hmac.compare_digest(header, key) for key in self.expected]
        return matches.index(True) if any(matches) else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if (
            scope["type"] == "http"
            and scope["method"] != "OPTIONS"  # a browser's CORS preflight carries no key
            and scope["path"].startswith("/v1")
        ):
            index = self.key_index(dict(scope["headers"]).get(b"authorization", b""))
            if index is None:
                response = error_response(APIError("invalid or missing API key", status=401))
                await response(scope, receive, send)
                return
            if self.salt_per_key:
                scope = {**scope, self.SALT: self.salts[index]}
        await self.app(scope, receive, send)
