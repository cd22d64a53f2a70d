"""Mixture-of-experts layers: the experts' fused kernel alone at Qwen3-30B-A3B's shapes
(hidden 2048, 128 experts, top 8, expert size 768), against a torch reference that loops
over the active experts, and a decode step's against the bound of reading its active
experts' bytes once at the machine's read bandwidth (measured here: torch's sum over a
2 GiB buffer, best of the run).

For 1, 8, 64 and 512 tokens (random hidden states, routed by random router logits
through the softmax top-8; each call times one of 8 routings after a read of a buffer
larger than the last-level cache, so that its experts' weights come from memory as a
model's layer finds them), in two forms: bfloat16 panels (a bfloat16 model's), and
8-bit blocks (GGUF's Q8_0) with int8 activations (llama.cpp's arithmetic). The torch
reference multiplies the same weights in bfloat16 with torch's matmul, an active expert
at a time, as transformers' MoE blocks do. Each time is the best of the 8 calls, the
peer's in the same process.

The last line printed is one JSON object, also written to bench/results/moe.json.

    python -m bench.moe [--tokens 1,8,64,512] [--experts 128]

(from the repository root; bench/__init__.py says how with a plain install)
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pyengine import ops
from pyengine.layers.block_quantized import BLOCK, BlockQuantized
from pyengine.layers.moe.routing import Routing, RoutingConfig, route
from pyengine.layers.quantization.packing import pack_bf16, pack_block_quantized

from .common import print_table, report

HIDDEN, EXPERT_SIZE, TOP_K = 2048, 768, 8


def random_q8_0(rows: int, columns: int) -> BlockQuantized:
    q = torch.randint(-128, 128, (rows, columns), dtype=torch.int8)
    scale = (torch.rand(rows, columns // BLOCK) * 0.001).half().float()
    return BlockQuantized(q.numpy(), scale.numpy(), torch.full_like(scale, -0.0).numpy())


class LayerForms:
    """One layer's experts: bfloat16 weights (torch's), and their packed stacks in each
    form the kernel takes."""

    def __init__(self, experts: int) -> None:
        self.gate_up = torch.randn(experts, 2 * EXPERT_SIZE, HIDDEN, dtype=torch.bfloat16) * 0.02
        self.down = torch.randn(experts, HIDDEN, EXPERT_SIZE, dtype=torch.bfloat16) * 0.02
        self.stacks = {
            "bfloat16": (
                torch.stack([pack_bf16(w.t().float().contiguous(), True) for w in self.gate_up]),
                torch.stack([pack_bf16(w.t().float().contiguous(), False) for w in self.down]),
            ),
            "int8": (
                torch.stack([pack_block_quantized(random_q8_0(2 * EXPERT_SIZE, HIDDEN), True)
                             for _ in range(experts)]),
                torch.stack([pack_block_quantized(random_q8_0(HIDDEN, EXPERT_SIZE))
                             for _ in range(experts)]),
            ),
        }  # fmt: skip

    def expert_bytes(self, form: str) -> int:
        """Bytes of one expert's packed weights."""
        gate_up, down = self.stacks[form]
        return gate_up[0].nbytes + down[0].nbytes


class ColdCache:
    """A buffer larger than the CPU's last-level cache (some hold hundreds of MiB), read
    before each timed call so that the call finds its weights in memory, as a model's
    layer does after the layers before it; each read is also a sample of the machine's
    read bandwidth."""

    def __init__(self, nbytes: int = 2**31) -> None:
        self.data = torch.ones(nbytes // 4)
        self.best_read = float("inf")

    def flush(self) -> None:
        start = time.perf_counter()
        self.data.sum()
        self.best_read = min(self.best_read, time.perf_counter() - start)

    @property
    def bandwidth(self) -> float:
        return self.data.nbytes / self.best_read

    def best_time(self, calls: list[Callable[[], None]]) -> float:
        """The fastest of `calls` (after a warm-up call of each), each timed after a
        flush."""
        for call in calls:
            call()
        best = float("inf")
        for call in calls:
            self.flush()
            start = time.perf_counter()
            call()
            best = min(best, time.perf_counter() - start)
        return best


def fused(forms: LayerForms, form: str, x: torch.Tensor, routing: Routing) -> Callable[[], None]:
    gate_up, down = forms.stacks[form]
    ids, weights = routing.expert_ids.to(torch.int32), routing.weights.float()
    out = torch.empty_like(x)
    int8 = form == "int8"
    return lambda: ops.fused_experts(out, x, ids, weights, gate_up, down, EXPERT_SIZE, False, int8)


def torch_loop(forms: LayerForms, x: torch.Tensor, routing: Routing) -> Callable[[], None]:
    """transformers' loop over the active experts, in bfloat16."""
    xb = x.bfloat16()
    weights = routing.weights.bfloat16()

    def run() -> None:
        out = torch.zeros_like(xb)
        for expert in torch.unique(routing.expert_ids).tolist():
            rows, slots = torch.where(routing.expert_ids == expert)
            gate, up = F.linear(xb[rows], forms.gate_up[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, forms.down[expert])
            out.index_add_(0, rows, y * weights[rows, slots, None])

    return run


ROUTINGS_CYCLED = 8


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="1,8,64,512")
    parser.add_argument("--experts", type=int, default=128)
    args = parser.parse_args()
    token_counts = [int(t) for t in args.tokens.split(",")]
    torch.manual_seed(0)
    forms = LayerForms(args.experts)
    config = RoutingConfig("softmax", TOP_K, args.experts, renormalize=True)
    cache = ColdCache()
    rows, figures = [], {}
    for tokens in token_counts:
        x = torch.randn(tokens, HIDDEN)
        routings = [
            route(torch.randn(tokens, args.experts), config) for _ in range(ROUTINGS_CYCLED)
        ]
        active = sum(len(torch.unique(r.expert_ids)) for r in routings) / len(routings)
        peer = cache.best_time([torch_loop(forms, x, r) for r in routings])
        for form in ("bfloat16", "int8"):
            xf = x.bfloat16() if form == "bfloat16" else x
            ours = cache.best_time([fused(forms, form, xf, r) for r in routings])
            bound = active * forms.expert_bytes(form) / cache.bandwidth
            key = f"{form}_{tokens}"
            figures[f"{key}_us"] = round(ours * 1e6, 1)
            figures[f"{key}_torch_us"] = round(peer * 1e6, 1)
            figures[f"speedup_vs_torch_{key}"] = round(peer / ours, 2)
            figures[f"{key}_of_bandwidth_bound"] = round(bound / ours, 3)
            rows.append((
                form, str(tokens), f"{active:.1f}", f"{ours * 1e3:.2f}", f"{peer * 1e3:.2f}",
                f"{peer / ours:.2f}x", f"{bound * 1e3:.2f}", f"{bound / ours:.0%}",
            ))  # fmt: skip
    bandwidth = cache.bandwidth
    figures["read_bandwidth_gb_s"] = round(bandwidth / 1e9, 1)
    print(
        f"The experts of one layer at Qwen3-30B-A3B's shapes ({args.experts} experts, top "
        f"{TOP_K}, hidden {HIDDEN}, expert size {EXPERT_SIZE}); read bandwidth "
        f"{bandwidth / 1e9:.1f} GB/s\n"
    )
    table = print_table(
        ("form", "tokens", "active experts", "fused ms", "torch loop ms (bf16)", "speedup",
         "bandwidth bound ms", "of the bound"),
        rows, num_text_columns=1,
    )  # fmt: skip
    report("moe", figures, tables=[table])


if __name__ == "__main__":
    main()
