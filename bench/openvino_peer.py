"""The batched workload of bench/quantized.py on OpenVINO GenAI, run by bench/quantized.py
in the Python that has openvino-genai (a virtual environment of its own, with
optimum-intel to export the model: docs/quantization.md says how). It imports neither
pyengine nor torch.

Reads one JSON object on stdin: {"model": the exported folder, "prompts": token id
lists, "output_len": n, "rounds": r}; runs every prompt at once through a
ContinuousBatchingPipeline with OpenVINO's defaults on the CPU (there: its inference
precision, bfloat16 on CPUs with AVX512-BF16, and its 8-bit KV cache), greedy,
ignore_eos; prints one JSON object: generated tokens/s (best of r), the precisions the
plugin ran, and the process's resident memory.
"""

from __future__ import annotations

import json
import sys
import time


def resident_mib() -> float:
    with open("/proc/self/status", encoding="utf-8") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    import numpy as np
    import openvino as ov
    import openvino_genai as genai

    job = json.load(sys.stdin)
    scheduler = genai.SchedulerConfig()
    scheduler.cache_size = 2  # GB of KV cache: every prompt's whole context at once
    pipe = genai.ContinuousBatchingPipeline(job["model"], scheduler, "CPU")
    config = genai.GenerationConfig()
    config.max_new_tokens = job["output_len"]
    config.ignore_eos = True
    config.do_sample = False
    prompts = [ov.Tensor(np.array([p], dtype=np.int64)) for p in job["prompts"]]
    pipe.generate(prompts[:2], [config] * len(prompts[:2]))  # warm-up
    best = float("inf")
    for _ in range(job["rounds"]):
        start = time.perf_counter()
        results = pipe.generate(prompts, [config] * len(prompts))
        best = min(best, time.perf_counter() - start)
        produced = sum(len(r.m_generation_ids[0]) for r in results)
        assert produced == len(prompts) * job["output_len"], produced
    core = ov.Core()
    print(json.dumps({
        "generated_tok_s": len(prompts) * job["output_len"] / best,
        "inference_precision": core.get_property("CPU", "INFERENCE_PRECISION_HINT").get_type_name(),
        "kv_cache_precision": core.get_property("CPU", "KV_CACHE_PRECISION").get_type_name(),
        "rss_mib": resident_mib(),
        "openvino_genai": genai.__version__,
    }))  # fmt: skip


if __name__ == "__main__":
    main()
