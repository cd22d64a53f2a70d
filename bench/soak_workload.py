"""What bench/soak.py's clients send: tenants with long system prompts, the mix of
client behaviours, and the catalogue of malformed requests."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from .soak_load import Call, Record, abort_after, exchange, never_read

# Common words: random sequences of them tokenize to about one token a word.
_WORDS_TEXT = (
    "the of and to in is for on with as by at from that this it be are was or an not "
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money "
    "story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city name"
)
WORDS = tuple(_WORDS_TEXT.split())


@dataclass(frozen=True)
class Mix:
    """Shares of the arrivals; the rest are plain requests."""

    malformed: float = 0.02
    disconnect: float = 0.05
    never_read: float = 0.05
    abort: float = 0.03
    # Of the plain requests (and those that abort):
    streamed: float = 0.5
    chat: float = 0.5
    n2: float = 0.15  # n = 2


def api_key(tenant: int) -> str:
    return f"soak-key-{tenant}"


@dataclass(frozen=True)
class Tenant:
    api_key: str  # "": none
    cache_salt: str  # "": none
    system: str  # its long system prompt, shared by all its requests


def plain_call(
    model: str,
    tenant: Tenant,
    question: str,
    *,
    chat: bool,
    stream: bool,
    extra: dict[str, Any],
) -> Call:
    """A request of `tenant`: its system prompt and `question`, chat or completion."""
    body: dict[str, Any] = {"model": model, "stream": stream}
    if tenant.cache_salt:
        body["cache_salt"] = tenant.cache_salt
    if chat:
        path = "/v1/chat/completions"
        body["messages"] = [
            {"role": "system", "content": tenant.system},
            {"role": "user", "content": question},
        ]
    else:
        path = "/v1/completions"
        body["prompt"] = f"{tenant.system}\n\nQuestion: {question}\nAnswer:"
    if stream:
        body["stream_options"] = {"include_usage": True}
    body.update(extra)
    return Call(path, json.dumps(body).encode(), tenant.api_key, stream)


class Workload:
    """Draws the soak's clients from `rng`: the same seed, the same requests."""

    fill_words = 400  # words of each prompt that fills the KV pool

    def __init__(
        self,
        model: str,
        mix: Mix,
        rng: np.random.Generator,
        stall_timeout_s: float,
        tenants: int = 4,
        prefix_words: int = 300,
    ) -> None:
        self.model, self.mix, self.rng = model, mix, rng
        self.tenants = [
            Tenant(api_key(i), f"salt-{i}", self.words(prefix_words, f"tenant {i}"))
            for i in range(tenants)
        ]
        # Long enough for the buffers to fill at a loaded server's pace (a minute) and
        # then for a stall timeout to end the stream; not for ever: a server without
        # one still frees the request once the client leaves.
        self.never_read_hold_s = stall_timeout_s + 60.0

    def words(self, n: int, topic: str) -> str:
        picked = self.rng.choice(WORDS, n)
        return f"You are the assistant of {topic}. Notes: " + " ".join(picked) + "."

    def question(self) -> str:
        return " ".join(self.rng.choice(WORDS, int(self.rng.integers(6, 20)))) + "?"

    def tenant(self) -> Tenant:
        return self.tenants[int(self.rng.integers(len(self.tenants)))]

    def plain(self, stream: bool | None = None, max_tokens: int | None = None) -> Call:
        mix, rng = self.mix, self.rng
        extra: dict[str, Any] = {
            "max_tokens": max_tokens or int(rng.integers(16, 97)),
            "temperature": 0.8,
            "seed": int(rng.integers(1 << 30)),
            "n": 2 if rng.random() < mix.n2 else 1,
        }
        return plain_call(
            self.model, self.tenant(), self.question(), chat=bool(rng.random() < mix.chat),
            stream=bool(rng.random() < mix.streamed) if stream is None else stream, extra=extra,
        )  # fmt: skip

    def next_client(
        self, port: int, load_over: asyncio.Event
    ) -> tuple[Record, Coroutine[Any, Any, None]]:
        """The next arrival: its record and the client to run."""
        mix, rng = self.mix, self.rng
        u = rng.random()
        if u < mix.malformed:
            record = Record("malformed")
            return record, exchange(port, self.malformed(), record)
        u -= mix.malformed
        if u < mix.disconnect:
            record = Record("disconnect")
            call = self.plain(stream=True, max_tokens=int(rng.integers(64, 129)))
            return record, exchange(port, call, record, int(rng.integers(1, 6)))
        u -= mix.disconnect
        if u < mix.never_read:
            record = Record("never_read")
            return record, never_read(port, self.unread(), record, load_over,
                                      self.never_read_hold_s)  # fmt: skip
        u -= mix.never_read
        if u < mix.abort:
            record = Record("abort")
            return record, abort_after(port, self.plain(), record, float(rng.uniform(0.05, 3)))
        record = Record("plain")
        return record, exchange(port, self.plain(), record)

    def unread(self) -> Call:
        """A stream of large events (20 top logprobs a token: about 2 kB), two samples
        of 600 tokens: some 2.4 MB, more than the server's buffers take for a client with
        a small receive window (half a megabyte was seen to fit, uvicorn's transport and
        the kernel's send buffer together), so that its sends must wait."""
        extra = {"max_tokens": 600, "n": 2, "ignore_eos": True, "logprobs": True,
                 "top_logprobs": 20}  # fmt: skip
        call = plain_call(self.model, self.tenant(), self.question(), chat=True, stream=True,
                          extra=extra)  # fmt: skip
        return Call(call.path, call.body, call.api_key, True, receive_buffer=4096,
                    segment_size=536)  # fmt: skip

    def malformed(self) -> Call:
        """One of the requests a server must refuse with a 4xx, drawn at random."""
        tenant = self.tenant()
        chat = {"model": self.model, "max_tokens": 8,
                "messages": [{"role": "user", "content": "Hi"}]}  # fmt: skip
        completion = {"model": self.model, "max_tokens": 8, "prompt": "Hi"}
        too_long = self.words(3000, "nobody")
        catalogue: list[tuple[str, object, str | None]] = [
            ("/v1/chat/completions", b'{"model": "x", "messages": [', tenant.api_key),
            ("/v1/chat/completions", {**chat, "messages": []}, tenant.api_key),
            ("/v1/chat/completions", {**chat, "messages": "Hi"}, tenant.api_key),
            ("/v1/chat/completions", {**chat, "temperature": 9}, tenant.api_key),
            ("/v1/completions", {**completion, "max_tokens": -1}, tenant.api_key),
            ("/v1/completions", {**completion, "top_p": 2}, tenant.api_key),
            ("/v1/completions", {**completion, "logprobs": 1000}, tenant.api_key),
            ("/v1/completions", {**completion, "model": "no-such-model"}, tenant.api_key),
            ("/v1/completions", {**completion, "prompt": too_long}, tenant.api_key),
            ("/v1/completions", completion, "not-a-key"),
        ]
        path, body, key = catalogue[int(self.rng.integers(len(catalogue)))]
        raw = body if isinstance(body, bytes) else json.dumps(body).encode()
        return Call(path, raw, key, False)

    def probe_call(self) -> Call:
        """A tiny request, to make the engine run one step."""
        extra = {"max_tokens": 1, "temperature": 0}
        return plain_call(self.model, self.tenants[0], "Hi?", chat=False, stream=False,
                          extra=extra)  # fmt: skip

    def fill_call(self, i: int) -> Call:
        """A prompt of its own (nothing cached), of fill_words words, one token out."""
        tenant = Tenant(self.tenants[0].api_key, f"fill-{i}", self.words(self.fill_words, str(i)))
        return plain_call(self.model, tenant, "?", chat=False, stream=False,
                          extra={"max_tokens": 1, "temperature": 0})  # fmt: skip

    def tier_call(self, i: int, prefix: str) -> Call:
        """Request i of the host-tier workload: a tenant's `prefix` and a question of
        its own, streamed (TTFT), greedy."""
        return plain_call(self.model, Tenant("", "", prefix), f"{i}: {self.question()}",
                          chat=False, stream=True,
                          extra={"max_tokens": 4, "temperature": 0})  # fmt: skip
