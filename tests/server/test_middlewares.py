"""The server's access middlewares on a bare app, driven as ASGI: without a key, a Host
header that names another site is refused (DNS rebinding), an IP address or localhost
taken; CORS answers no origin unless --allowed-origins names it; several keys keep
their prefix caches apart by default; a route answers without a key only where it is
open (/health, /metrics with --public-metrics)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request

from pyengine.entrypoints.openai.middlewares import Access, ApiKeyCheck, add_middlewares


def app_with(access: Access) -> FastAPI:
    app = FastAPI()

    async def echo(raw: Request) -> dict[str, Any]:
        return {"salt": raw.scope.get(ApiKeyCheck.SALT)}

    for path in ("/health", "/metrics", "/v1/models"):
        app.add_api_route(path, echo, methods=["GET"])
    add_middlewares(app, access, 1000)
    return app


def call(
    app: FastAPI, path: str, headers: dict[str, str], method: str = "GET"
) -> tuple[int, dict[str, str]]:
    """The status and headers of one request through the app."""
    scope = {"type": "http", "method": method, "path": path, "raw_path": path.encode(),
             "query_string": b"", "root_path": "", "scheme": "http", "server": ("127.0.0.1", 8000),
             "http_version": "1.1", "client": ("127.0.0.1", 5000),
             "headers": [(k.lower().encode(), v.encode()) for k, v in headers.items()]}  # fmt: skip
    sent: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    asyncio.run(app(scope, receive, send))
    start = sent[0]
    return start["status"], {k.decode(): v.decode() for k, v in start["headers"]}


def test_without_a_key_only_this_machines_names_and_addresses_are_answered() -> None:
    app = app_with(Access(allowed_hosts=["models.internal"]))
    for host in ("127.0.0.1:8000", "localhost:8000", "LOCALHOST", "[::1]:8000", "10.0.0.5",
                 "models.internal:8000"):  # fmt: skip
        assert call(app, "/v1/models", {"Host": host})[0] == 200, host
    for host in ("evil.example:8000", "127.0.0.1.evil.example", "", "[evil]:80"):
        assert call(app, "/v1/models", {"Host": host})[0] == 400, host


def test_cors_is_off_unless_origins_are_named() -> None:
    preflight = {"Host": "localhost", "Origin": "http://page.example",
                 "Access-Control-Request-Method": "GET"}  # fmt: skip
    _, headers = call(app_with(Access()), "/v1/models", preflight, "OPTIONS")
    assert "access-control-allow-origin" not in headers
    _, headers = call(app_with(Access(allowed_origins=["http://page.example"])), "/v1/models",
                      preflight, "OPTIONS")  # fmt: skip
    assert headers["access-control-allow-origin"] == "http://page.example"


def test_open_routes_and_salts_per_key() -> None:
    keyed = Access(api_keys=["a", "b"])
    assert keyed.salt_per_key and not Access(api_keys=["a"]).salt_per_key
    assert not Access(api_keys=["a", "b"], cache_salt_per_api_key=False).salt_per_key
    app = app_with(keyed)
    assert call(app, "/health", {})[0] == 200
    assert call(app, "/metrics", {})[0] == 401
    assert call(app_with(Access(api_keys=["a"], public_metrics=True)), "/metrics", {})[0] == 200
    assert call(app, "/v1/models", {"Authorization": "Bearer b"})[0] == 200
    assert call(app, "/v1/models", {"Authorization": "Bearer c"})[0] == 401


def test_admin_keys_come_last_and_count_once() -> None:
    access = Access(api_keys=["a", "root", "b"], admin_api_keys=["root", "ops"])
    assert access.keys == ["a", "b", "root", "ops"]
    assert access.admin_indices == frozenset({2, 3})
