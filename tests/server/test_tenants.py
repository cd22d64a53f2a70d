"""Tenants on one server: several API keys (each checked in constant time), each with a
prefix-cache salt of its own that a request cannot override (--cache-salt-per-api-key),
and requests in priority order (--scheduling-policy priority)."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from helpers.server import API_KEY, Server, serving

SECOND_KEY = "second-tenant-key"
PROMPT = "Each tenant's prefix cache is its own, whatever salt it sends. " * 5


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    with tempfile.TemporaryDirectory() as folder:
        keys = Path(folder) / "keys"
        keys.write_text(f"\n{SECOND_KEY}\n")
        yield from serving(extra=["--api-key-file", str(keys), "--cache-salt-per-api-key",
                                  "--scheduling-policy", "priority"])  # fmt: skip


def ask(server: Server, key: str, **fields: object) -> tuple[int, dict]:  # type: ignore[type-arg]
    import http.client

    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    body = {"prompt": PROMPT, "max_tokens": 1, **fields}
    headers = {"Content-Type": "application/json", "Authorization": f"Bearer {key}"}
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers=headers)
    response = conn.getresponse()
    status, data = response.status, json.loads(response.read())
    conn.close()
    return status, data


def cached(server: Server, key: str, **fields: object) -> int:
    status, body = ask(server, key, **fields)
    assert status == 200, body
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


def test_every_key_is_let_in_and_no_other(server: Server) -> None:
    for key in (API_KEY, SECOND_KEY):
        assert ask(server, key)[0] == 200
    for wrong in ("", "wrong", API_KEY + "x", API_KEY[:-1], SECOND_KEY.upper()):
        status, error = ask(server, wrong)
        assert status == 401 and "API key" in error["error"]["message"]
    for path in ("/v1/models", f"/v1/models/{API_KEY}", "/v1/chat/completions"):
        assert server.request("GET" if "models" in path else "POST", path, "{}", auth=False)[
            0] == 401  # fmt: skip


def test_a_keys_salt_overrides_the_bodys(server: Server) -> None:
    """Each key's requests share blocks among themselves; another key's never, even
    when it sends the same cache_salt."""
    prompt = "A prompt no test here sent before, of several blocks. " * 5
    assert cached(server, API_KEY, prompt=prompt, cache_salt="shared") == 0
    # (the key's salt, not the body's)
    assert cached(server, API_KEY, prompt=prompt, cache_salt="other") > 0
    assert cached(server, SECOND_KEY, prompt=prompt, cache_salt="shared") == 0
    assert cached(server, SECOND_KEY, prompt=prompt) > 0


def test_priorities_are_taken(server: Server) -> None:
    assert ask(server, API_KEY, priority=-2, max_tokens=2)[0] == 200
    status, error = ask(server, API_KEY, priority="high")
    assert status == 400 and error["error"]["param"] == "priority"


def test_a_priority_past_the_schedulers_int32_is_a_400(server: Server) -> None:
    """The scheduler keeps priorities as int32: a value past it is refused by name (it
    was a 500), and its bounds are taken."""
    for priority in (2**31, -(2**31) - 1, 10**30):
        status, error = ask(server, API_KEY, priority=priority)
        assert status == 400 and error["error"]["param"] == "priority", error
    for priority in (2**31 - 1, -(2**31)):
        assert ask(server, API_KEY, priority=priority)[0] == 200
