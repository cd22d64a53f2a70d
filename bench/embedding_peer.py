"""One engine's embedding run for bench/embeddings.py, in the Python that has it:
pyengine's, or vLLM's CPU build in a virtual environment of its own. It imports nothing
of bench/ and names the engine's packages only inside run(), so that it runs as a file in
either.

Reads one JSON object on stdin: {"engine": "pyengine" or "vllm", "model": a folder of a
config.json (dummy weights), "dtype": "auto" or a dtype, "max_model_len": n,
"pooling_type": "CLS" | "LAST" | "MEAN", "prompts": token id lists, "rounds": r}. Times
start-up to the first embedding (importing the engine, building it, one prompt), then
embeds every prompt at once, best of r rounds; prints one JSON object: start-up
seconds, texts/s, and the resident memory of the process and its children.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

START = time.perf_counter()

# (run as a file: its folder is on the path, and engine_peer.py imports nothing more)
from engine_peer import resident_mib  # noqa: E402


def run(job: dict[str, Any]) -> dict[str, Any]:
    engine, prompts = job["engine"], job["prompts"]
    if engine == "vllm":
        from vllm import LLM
        from vllm.config import PoolerConfig
        from vllm.inputs import TokensPrompt

        llm = LLM(model=job["model"], load_format="dummy", dtype=job["dtype"],
                  max_model_len=job["max_model_len"], runner="pooling", seed=0,
                  pooler_config=PoolerConfig(pooling_type=job["pooling_type"]))  # fmt: skip
        as_prompts: list[Any] = [TokensPrompt(prompt_token_ids=p) for p in prompts]
    elif engine == "pyengine":
        from pyengine import LLM  # type: ignore[no-redef]

        llm = LLM(job["model"], load_format="dummy", dtype=job["dtype"],
                  max_model_len=job["max_model_len"], runner="pooling",
                  pooler_config={"pooling_type": job["pooling_type"]})  # fmt: skip
        as_prompts = [{"prompt_token_ids": p} for p in prompts]
    else:
        raise ValueError(f"engine {engine!r}: expected 'pyengine' or 'vllm'")
    llm.embed(as_prompts[:1], use_tqdm=False)
    startup = time.perf_counter() - START
    best = float("inf")
    for _ in range(job["rounds"]):
        start = time.perf_counter()
        outputs = llm.embed(as_prompts, use_tqdm=False)
        best = min(best, time.perf_counter() - start)
        if len(outputs) != len(prompts) or not all(o.outputs.embedding for o in outputs):
            raise RuntimeError(f"{engine} embedded {len(outputs)} of {len(prompts)} texts")
    return {"startup_s": startup, "texts_per_s": len(prompts) / best,
            "resident_mib": resident_mib(os.getpid())}  # fmt: skip


if __name__ == "__main__":  # (vLLM's engine core starts processes that import this file)
    print(json.dumps(run(json.loads(sys.stdin.read()))))
