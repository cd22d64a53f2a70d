"""The least time any engine can take for the offline throughput workload on this GPU, at
the rates the device shows in the same run: a large 16-bit matmul's FLOP/s and a large
device-to-device copy's bytes/s. The prefill takes at least its FLOPs at that matmul rate;
each decode step at least the longer of its matmul FLOPs at that rate and the bytes it
must read (every weight once, every request's K/V) at that bandwidth, as if an engine
overlapped its compute and reads perfectly. Weights and K/V are 16-bit; every request
decodes in every step (the workload's prompts all fit the batch). The attention's FLOPs
in decode and the fused layers' traffic are left out: a floor, not an estimate."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    num_prompts: int
    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class Bound:
    prefill_s: float
    decode_s: float

    @property
    def total_s(self) -> float:
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
) -> Bound:
    """The floor of prefill and decode seconds, at `matmul_flop_s` (a large 16-bit GEMM's
    rate) and `copy_byte_s` (a large device-to-device copy's bytes read and written)."""
    layers = config["num_hidden_layers"]
    head_dim = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"])
    layer, head = linear_parameters(config)
    weights = layers * layer + head
    # Prefill: every prompt token through the layers, causal attention over the prompt,
    # and one LM-head row per prompt.
    attention = 4 * config["num_attention_heads"] * head_dim * layers  # per (query, key)
    pairs = work.prompt_len * (work.prompt_len + 1) // 2
    prefill = (
        2 * layers * layer * work.num_prompts * work.prompt_len
        + attention * pairs * work.num_prompts
        + 2 * head * work.num_prompts
    )
    # Decode: output_len - 1 steps (the prefill gave the first token) of every request.
    kv_per_token = 2 * layers * config["num_key_value_heads"] * head_dim * 2  # K and V, bytes
    decode = 0.0
    for step in range(1, work.output_len):
        context = work.prompt_len + step  # keys each request reads
        reads = 2 * weights + work.num_prompts * context * kv_per_token
        decode += max(2 * weights * work.num_prompts / matmul_flop_s, reads / copy_byte_s)
    return Bound(prefill / matmul_flop_s, decode)


def matmul_flop_s(time_fn: Callable[[Callable[[], object]], float]) -> float:
    """FLOP/s of an 8192^3 bfloat16 matmul on the GPU, timed by time_fn(fn) -> seconds a
    call."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / time_fn(lambda: a @ b)
