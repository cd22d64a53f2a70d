"""The app's own middlewares, outermost first: CORS (only where --allowed-origins names
origins), `ApiKeyCheck` (or, without keys, `HostCheck`), then `BodySizeLimit`: a request is
refused by its headers before its body is read. Ours are plain ASGI middlewares:
Starlette's BaseHTTPMiddleware would pass every chunk of a stream through a task and a
memory stream of its own, costing each streamed token. The guards around the whole app,
outside FastAPI's middleware stack, are in slow_clients.py (`StallGuard`, which needs
uvicorn's own `send`) and drain.py (`DrainGate`)."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from pyengine.entrypoints.openai.errors import APIError, error_response

DEFAULT_MAX_BODY_BYTES = 32 * 2**20


# What answers without a key: a balancer's health probe.
OPEN_PATHS = frozenset({"/health"})


@dataclass(frozen=True)
class Access:
    """Who may call the server and from where: its API keys (none: anyone, from this
    machine's names or an IP address), the admin keys among them (which may also load
    and unload adapters, from inside lora_root), whether each key's requests keep their
    prefix-cache blocks to themselves (None: where there are several keys), whether
    /metrics answers without a key, and the origins browsers may call it from."""

    api_keys: Sequence[str] = ()
    admin_api_keys: Sequence[str] = ()
    cache_salt_per_api_key: bool | None = None
    public_metrics: bool = False
    allowed_origins: Sequence[str] = ()
    allowed_hosts: Sequence[str] = ()  # (names besides localhost, where there is no key)
    lora_root: str | None = None

    @property
    def keys(self) -> list[str]:
        """Every key, the admin keys last (a key given as both is an admin key)."""
        admin = list(dict.fromkeys(self.admin_api_keys))
        return [k for k in dict.fromkeys(self.api_keys) if k not in admin] + admin

    @property
    def admin_indices(self) -> frozenset[int]:
        """The admin keys' places in `keys` (ApiKeyCheck.KEY_INDEX)."""
        n, admin = len(self.keys), len(set(self.admin_api_keys))
        return frozenset(range(n - admin, n))

    @property
    def salt_per_key(self) -> bool:
        if self.cache_salt_per_api_key is None:
            return len(self.keys) > 1
        return self.cache_salt_per_api_key


def add_middlewares(app: FastAPI, access: Access, max_request_body_bytes: int) -> None:
    """Wraps the app in the body size limit, the key check (without keys, the Host check)
    and CORS (none without allowed origins). Starlette runs the middleware added last
    outermost."""
    app.add_middleware(BodySizeLimit, max_bytes=max_request_body_bytes)
    if access.keys:
        open_paths = OPEN_PATHS | ({"/metrics"} if access.public_metrics else set())
        app.add_middleware(ApiKeyCheck, api_keys=access.keys, salt_per_key=access.salt_per_key,
                           open_paths=open_paths)  # fmt: skip
    else:
        if access.cache_salt_per_api_key:
            raise ValueError("--cache-salt-per-api-key needs --api-key")
        app.add_middleware(HostCheck, allowed_hosts=access.allowed_hosts)
    if access.allowed_origins:
        # Outermost: a preflight (which carries no key) is answered here, and a refusal
        # carries the headers that let the page read it.
        app.add_middleware(
            CORSMiddleware,
            allow_origins=access.allowed_origins,
            allow_methods=["*"],
            allow_headers=["*"],
        )


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
        await error_response(error, scope["path"])(scope, receive, send)


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
    """Refuses every request but those to `open_paths` without `Authorization: Bearer
    <key>` (or Anthropic's clients' `x-api-key: <key>`) of one of the keys, from its
    headers alone (its body is not read), every key
    compared in constant time (how long a refusal takes says nothing of a key); with
    salt_per_key, a request's scope carries its key's cache salt (SALT)."""

    SALT = "pyengine.cache_salt"
    KEY_INDEX = "pyengine.api_key_index"  # (which key let it in: adapters' owners)

    def __init__(
        self,
        app: Callable[..., Awaitable[None]],
        api_keys: Sequence[str],
        salt_per_key: bool,
        open_paths: frozenset[str] = OPEN_PATHS,
    ) -> None:
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]
        # (a salt no request can guess from another key's)
        self.salts = [hashlib.sha256(b"pyengine-salt:" + key).hexdigest() for key in self.expected]
        self.salt_per_key = salt_per_key
        self.open_paths = open_paths

    def key_index(self, header: bytes) -> int | None:
        """Which key `header` gives (every key compared: the time is the same for all)."""
        matches = [hmac.compare_digest(header, key) for key in self.expected]
        return matches.index(True) if any(matches) else None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] not in self.open_paths:
            headers = dict(scope["headers"])
            given = headers.get(b"authorization")
            if given is None and b"x-api-key" in headers:
                given = b"Bearer " + headers[b"x-api-key"]
            index = self.key_index(given or b"")
            if index is None:
                response = error_response(
                    APIError("invalid or missing API key", status=401), scope["path"]
                )
                await response(scope, receive, send)
                return
            scope = {**scope, self.KEY_INDEX: index}
            if self.salt_per_key:
                scope[self.SALT] = self.salts[index]
        await self.app(scope, receive, send)


class HostCheck:
    """Without an API key: refuses a request (but a health probe) whose Host header names
    a host by a name other than localhost or `allowed_hosts` (an IP address is taken). A
    web page can otherwise reach a key-less server on the user's machine through a DNS
    name its site points at 127.0.0.1 (DNS rebinding): the browser then sends that name
    as the Host."""

    def __init__(self, app: Callable[..., Awaitable[None]], allowed_hosts: Sequence[str]) -> None:
        self.app = app
        self.allowed = {"localhost", *(host.lower() for host in allowed_hosts)}

    def allows(self, host_header: bytes) -> bool:
        host = host_header.decode("latin-1").strip().lower()
        if host.startswith("["):  # [IPv6]:port
            name = host[1 : host.find("]")]
        else:
            name = host.split(":")[0] if host.count(":") == 1 else host
        if name in self.allowed:
            return True
        try:
            ipaddress.ip_address(name)
        except ValueError:
            return False
        return True

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] in ("http", "websocket") and scope["path"] not in OPEN_PATHS:
            host = dict(scope["headers"]).get(b"host", b"")
            if not self.allows(host):
                message = (
                    f"the Host header {host.decode('latin-1')[:100]!r} names a host this "
                    "server does not answer for without an API key (--allowed-hosts)"
                )
                await error_response(APIError(message, status=400), scope["path"])(
                    scope, receive, send
                )
                return
        await self.app(scope, receive, send)
