"""Serving under load: the OpenAI server over HTTP against pyengine's offline throughput
on the same workload, in the same run.

A synthetic workload (N prompts of random token ids, lengths drawn from a range, a fixed
number of output tokens each, ignore_eos) runs first offline (LLM.generate with at most
`concurrency` requests in its batch, as the server gets them) and then through
`python -m pyengine.entrypoints.openai.api_server` started here, with streamed
/v1/completions sent at a fixed concurrency or with Poisson arrivals. Reported:
request throughput, output tokens/s, and time to first token (TTFT), time per output token
after the first (TPOT) and inter-token latency (ITL) at p50/p90/p99.

The last line printed is one JSON object, also written to bench/results/serve.json.

    python -m bench.serve [--num-prompts 128] [--min-len 16] [--max-len 64]
                          [--output-len 128] [--concurrency 32] [--request-rate inf] [--seed 0]

(from the repository root; bench/__init__.py says how with a plain install)
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from pyengine import LLM, SamplingParams
from pyengine.loader.resolve import DEFAULT_MODEL

from .common import print_table, report


@dataclass
class RequestResult:
    sent: float
    chunk_times: list[float] = field(default_factory=list)  # one per chunk with tokens
    output_tokens: int = 0
    error: str | None = None

    @property
    def ttft(self) -> float:
        return self.chunk_times[0] - self.sent

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)


async def stream_completion(port: int, body: dict[str, object]) -> RequestResult:
    """POSTs a streamed completion over a bare HTTP/1.1 connection (a client library
    would take CPU from the server on this 2-core machine) and times every event."""
    result = RequestResult(time.perf_counter())
    payload = json.dumps(body).encode()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n".encode()
        + payload
    )
    await writer.drain()
    status = await reader.readline()
    if b" 200 " not in status:
        result.error = (status + await reader.read()).decode(errors="replace")[:300]
    else:
        while line := await reader.readline():
            if not line.startswith(b"data: {"):
                continue  # chunk sizes, blank lines, [DONE]
            event = json.loads(line[6:])
            if event.get("usage"):
                result.output_tokens = event["usage"]["completion_tokens"]
            elif event["choices"]:
                result.chunk_times.append(time.perf_counter())
    writer.close()
    return result


async def run_load(
    port: int,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    request_rate: float,
    rng: np.random.Generator,
) -> tuple[list[RequestResult], float]:
    limit = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int]) -> RequestResult:
        async with limit:
            return await stream_completion(
                port,
                {
                    "prompt": prompt,
                    "max_tokens": output_len,
                    "temperature": 0,
                    "ignore_eos": True,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                },
            )

    start = time.perf_counter()
    tasks = []
    for prompt in prompts:
        tasks.append(asyncio.create_task(one(prompt)))
        if request_rate != float("inf"):
            await asyncio.sleep(rng.exponential(1 / request_rate))
    results = await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def start_server(
    model: str, max_model_len: int, *options: str
) -> tuple[subprocess.Popen[bytes], int]:
    """`pyengine serve` of `model` (more command-line options: `options`) on a free port,
    once healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = int(s.getsockname()[1])
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pyengine.entrypoints.openai.api_server",
            "--model",
            model,
            "--port",
            str(port),
            "--max-model-len",
            str(max_model_len),
            "--uvicorn-log-level",
            "warning",
            *options,
        ],  # fmt: skip
        stdout=subprocess.DEVNULL,
        cwd=tempfile.gettempdir(),  # not the checkout: its pyengine/ has no compiled _C
    )
    wait_until_healthy(server, port, 300, "the server")
    return server, port


def wait_until_healthy(
    server: subprocess.Popen[bytes], port: int, seconds: float, what: str
) -> None:
    """Until GET /health answers 200 (a server of pyengine's or llama.cpp's); kills the
    server and raises if it does not within `seconds`, and raises if it exits first."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{what} exited with status {server.returncode} while starting")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1) as conn:
                conn.sendall(
                    b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n"
                )
                if b" 200 " in conn.recv(100):
                    return
        except OSError:
            pass
        time.sleep(0.5)
    server.kill()
    raise RuntimeError(f"{what} did not come up")


def percentiles(values: list[float]) -> list[str]:
    if not values:
        return ["-"] * 3
    return [f"{np.percentile(values, q) * 1000:.0f}" for q in (50, 90, 99)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--min-len", type=int, default=16)
    parser.add_argument("--max-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    rng = np.random.default_rng(args.seed)
    max_model_len = args.max_len + args.output_len + 16
    lengths = rng.integers(args.min_len, args.max_len + 1, args.num_prompts)
    generated = args.num_prompts * args.output_len

    # The peer: the same engine offline, every prompt at once.
    llm = LLM(
        args.model, max_model_len=max_model_len, max_num_seqs=args.concurrency, seed=args.seed
    )
    vocab = llm.llm_engine.model_config.vocab_size
    prompts = [rng.integers(100, vocab - 100, n).tolist() for n in lengths]
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True)
    llm.generate(prompts[:2], SamplingParams(max_tokens=4), use_tqdm=False)  # warm up
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    offline_seconds = time.perf_counter() - start
    del llm
    gc.collect()

    server, port = start_server(args.model, max_model_len)
    try:
        asyncio.run(run_load(port, prompts[:2], 4, 2, float("inf"), rng))  # warm up
        results, seconds = asyncio.run(
            run_load(port, prompts, args.output_len, args.concurrency, args.request_rate, rng)
        )
    finally:
        server.terminate()
        server.wait(60)

    failed = [r.error for r in results if r.error is not None or not r.chunk_times]
    ok = [r for r in results if r.error is None and r.chunk_times]
    served_tokens = sum(r.output_tokens for r in ok)
    ttft = [r.ttft for r in ok]
    tpot = [t for r in ok if (t := r.tpot) is not None]
    itl = [b - a for r in ok for a, b in zip(r.chunk_times, r.chunk_times[1:], strict=False)]
    offline_tok_s = generated / offline_seconds
    serve_tok_s = served_tokens / seconds
    rate = "inf" if args.request_rate == float("inf") else f"{args.request_rate:g}/s"

    print(
        f"# Serving: {args.model}, {args.num_prompts} prompts of {args.min_len}-{args.max_len} "
        f"tokens, {args.output_len} output tokens each (ignore_eos), concurrency "
        f"{args.concurrency}, request rate {rate}, streamed /v1/completions over HTTP\n"
    )
    runs = print_table(
        ("run", "seconds", "requests/s", "output tok/s"),
        [
            (f"offline LLM.generate, batch <= {args.concurrency} (peer)", f"{offline_seconds:.1f}",
             f"{args.num_prompts / offline_seconds:.2f}", f"{offline_tok_s:.1f}"),
            ("server over HTTP", f"{seconds:.1f}", f"{len(ok) / seconds:.2f}",
             f"{serve_tok_s:.1f}"),
        ],
    )  # fmt: skip
    print()
    latency = print_table(
        ("latency (ms)", "p50", "p90", "p99"),
        [("TTFT", *percentiles(ttft)), ("TPOT", *percentiles(tpot)), ("ITL", *percentiles(itl))],
    )
    print(
        f"\nserver output tok/s = {serve_tok_s / offline_tok_s:.0%} of offline; "
        f"{len(failed)} failed requests; {served_tokens} of {generated} tokens served"
    )
    if failed:
        print(f"first failure: {failed[0]}")
    figures = {
        "offline_output_tok_s": round(offline_tok_s, 1),
        "serve_output_tok_s": round(serve_tok_s, 1),
        "speedup_vs_offline_output_tok_s": round(serve_tok_s / offline_tok_s, 3),
        "serve_requests_s": round(len(ok) / seconds, 3),
        "ttft_p50_s": round(float(np.percentile(ttft, 50)), 3) if ttft else None,
        "ttft_p99_s": round(float(np.percentile(ttft, 99)), 3) if ttft else None,
        "tpot_p50_s": round(float(np.percentile(tpot, 50)), 4) if tpot else None,
        "itl_p99_s": round(float(np.percentile(itl, 99)), 4) if itl else None,
        "failed_requests": len(failed),
    }
    report("serve", figures, tables=[runs, latency])


if __name__ == "__main__":
    main()
