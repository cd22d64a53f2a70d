"""The least time an engine can take for the offline throughput workload on this GPU, at
the rates the device shows in the same run: a large 16-bit matmul's FLOP/s and a large
device-to-device copy's bytes/s. Two floors:

- any engine: the longer of all the run's matmul FLOPs at that rate and all the bytes it
  must read at that bandwidth (each decode step reads every weight once and every
  request's K/V), as if compute and reads overlapped perfectly across the whole run;
- prefill, then decode (what an engine that runs the phases apart can reach): the
  prefill's FLOPs at the matmul rate, then each decode step at least the longer of its
  matmul FLOPs and its reads.

Weights and K/V are 16-bit; every request decodes in every step (the workload's prompts
all fit the batch). The attention's FLOPs in decode and the fused layers' traffic are
left out, and a copy's rate stands for the read bandwidth: floors, not estimates."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Floor:
    any_engine_s: float  # compute and reads overlapped over the whole run
    prefill_s: float  # prefill, then decode
    decode_s: float

    @property
    def phases_s(self) -> float:
        return self.prefill_s + self.decode_s


def linear_parameters(config: Mapping[str, int]) -> tuple[int, int]:
    """(the matmul weights of one decoder layer, the LM head's) of a Llama config."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim", hidden // config["num_attention_heads"])
    q = config["num_attention_heads"] * head_dim
    kv = config["num_key_value_heads"] * head_dim
    layer = hidden * (q + 2 * kv) + q * hidden + 3 * hidden * inter
    return layer, config["vocab_size"] * hidden


def roofline(
    config: Mapping[str, int], work: Workload, matmul_flop_s: float, copy_byte_s: float
) -> Floor:
    """The floors of the run, at `matmul_flop_s` (a large 16-bit GEMM's rate) and
    `copy_byte_s` (a large device-to-device copy's bytes read and written)."""
    layers = config["num_hidden_layers"]
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    layer, head = linear_parameters(config)
    weights = layers * layer + head
    # Prefill: every prompt token through the layers, causal attention over the prompt,
    # and one LM-head row per prompt.
    attention = 4 * config["num_attention_heads"] * head_dim * layers  # per (query, key)
    pairs = work.prompt_len * (work.prompt_len + 1) // 2
    prefill_flops = (
        2 * layers * layer * work.num_prompts * work.prompt_len
        + attention * pairs * work.num_prompts
        + 2 * head * work.num_prompts
    )
    # Decode: output_len - 1 steps (the prefill gave the first token) of every request.
    kv_per_token = 2 * layers * config["num_key_value_heads"] * head_dim * 2  # K and V, bytes
    step_flops = 2 * weights * work.num_prompts
    decode_s = 0.0
    total_reads = 0.0
    for step in range(1, work.output_len):
        context = work.prompt_len + step  # keys each request reads
        reads = 2 * weights + work.num_prompts * context * kv_per_token
        total_reads += reads
        decode_s += max(step_flops / matmul_flop_s, reads / copy_byte_s)
    total_flops = prefill_flops + step_flops * (work.output_len - 1)
    any_engine = max(total_flops / matmul_flop_s, total_reads / copy_byte_s)
    return Floor(any_engine, prefill_flops / matmul_flop_s, decode_s)


def matmul_flop_s(time_fn: Callable[[Callable[[], object]], float]) -> float:
    """FLOP/s of an 8192^3 bfloat16 matmul on the GPU, timed by time_fn(fn) -> seconds a
    call."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / time_fn(lambda: a @ b)
