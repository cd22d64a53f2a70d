"""MLA prefill in its two forms: one request's prompt attending in the absorbed form
(queries into the latent space, ops.mla_attention over the latents) and in the expanded
one (the latents expanded to per-head keys and values, then causal attention), at
DeepSeek-V2-Lite's sizes in bfloat16, from the projections' outputs to the heads'
values, the absorbed form on AMX's tiles (where the CPU has them) and in the build that
runs without (AVX512-BF16's dot products, or the portable loops). It places
layers/latent_attention.py's EXPANDED_FROM: the query tokens from which a request takes
the expanded form, by build.

    python -m bench.mla_prefill
"""

from __future__ import annotations

import argparse
from typing import Any

import torch

from bench.common import best_time, print_table, report
from pyengine import _C
from pyengine.layers.attention import AttentionMetadata
from pyengine.layers.latent_attention import (
    EXPANDED_FROM,
    ExpandedWeights,
    LatentAttention,
    expanded_attention,
    expanded_head_size,
)

HEADS, RANK, ROPE, NOPE, V = 16, 512, 64, 128, 128
DTYPE = torch.bfloat16
AMX = _C.amx_tiles()  # (the dense kernels' switch, which the latent kernel follows)


def forms(tokens: int, context: int, bs: int) -> dict[str, float]:
    """Seconds of the absorbed form (on AMX's tiles where the CPU has them, and in the
    build that runs without them: AVX512-BF16's dot products or the portable loops) and
    of the expanded form, for `tokens` query tokens
    at the end of a `context`-token request, its latents in shuffled blocks."""
    blocks = -(-context // bs)
    cache = torch.randn(blocks, bs, RANK + ROPE).to(DTYPE)
    table = torch.randperm(blocks, dtype=torch.int32)[None]
    lens = torch.tensor([context], dtype=torch.int32)
    qsl = torch.tensor([0, tokens], dtype=torch.int32)
    meta = AttentionMetadata(torch.zeros(1, 0, dtype=torch.long), table[None], lens, qsl)
    attn = LatentAttention(HEADS, RANK, ROPE, (NOPE + ROPE) ** -0.5)
    w_uk = (torch.randn(HEADS, NOPE, RANK) / RANK**0.5).to(DTYPE)
    w_uv = (torch.randn(HEADS, RANK, V) / RANK**0.5).to(DTYPE)
    q_nope = torch.randn(tokens, HEADS, NOPE).to(DTYPE)
    q_pe = torch.randn(tokens, HEADS, ROPE).to(DTYPE)

    def absorbed() -> torch.Tensor:  # (as models/deepseek.py's LatentAttentionLayer)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)
        out = attn.absorbed(torch.cat((q_latent, q_pe), dim=-1), (cache, cache), meta)
        return torch.bmm(out.transpose(0, 1), w_uv)

    size = expanded_head_size(NOPE + ROPE, V)
    assert size is not None
    weights = ExpandedWeights(w_uk, w_uv, attn.scale, size)

    def expanded() -> torch.Tensor:
        query = torch.cat((q_nope, q_pe), dim=-1)
        return expanded_attention(query, attn.context((cache, cache), meta, 0), weights)

    times = {"expanded": best_time(expanded, 3, 0.2)}
    if AMX:
        times["tiles"] = best_time(absorbed, 3, 0.2)
    _C.set_amx_tiles(False)
    times["no_amx"] = best_time(absorbed, 3, 0.2)
    _C.set_amx_tiles(AMX)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", default="16,64,256,1024,4096")
    parser.add_argument("--block-size", type=int, default=16)
    args = parser.parse_args()
    latents = torch.zeros(1, args.block_size, RANK + ROPE, dtype=DTYPE)
    engine_from = LatentAttention(HEADS, RANK, ROPE, 1.0).expanded_from_over(
        (latents, latents), DTYPE
    )
    _C.set_amx_tiles(False)
    build = _C.mla_bf16_build(HEADS, RANK + ROPE, RANK, args.block_size)
    _C.set_amx_tiles(AMX)
    figures: dict[str, Any] = {"expanded_from": EXPANDED_FROM, "amx": AMX,
                               "build_without_amx": build,
                               "engine_expands_from": engine_from}  # fmt: skip
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for context in sorted({tokens, 4 * tokens}):
            times = forms(tokens, context, args.block_size)
            key = f"q{tokens}_ctx{context}"
            for form, seconds in times.items():
                figures[f"{form}_ms_{key}"] = round(seconds * 1e3, 3)
            no_amx, expanded = times["no_amx"], times["expanded"]
            figures[f"speedup_expanded_vs_no_amx_{key}"] = round(no_amx / expanded, 2)
            tiles = times.get("tiles")
            if tiles is not None:
                figures[f"speedup_tiles_vs_expanded_{key}"] = round(expanded / tiles, 2)
            rows.append((f"{tokens:,}", f"{context:,}",
                         f"{tiles * 1e3:.2f}" if tiles is not None else "-",
                         f"{no_amx * 1e3:.2f}", f"{expanded * 1e3:.2f}",
                         f"{expanded / tiles:.2f}" if tiles is not None else "-",
                         f"{no_amx / expanded:.2f}"))  # fmt: skip
    choice = "never expands" if engine_from is None else f"expands from {engine_from} query tokens"
    print(f"MLA prefill, one request (DeepSeek-V2-Lite: {HEADS} heads, latent {RANK} + {ROPE}, "
          f"nope {NOPE}, v {V}; bfloat16, {torch.get_num_threads()} threads; "
          f"{'AMX' if AMX else 'no AMX'}); the engine here {choice}")  # fmt: skip
    table = print_table(
        ("query tokens", "context", "absorbed AMX ms", f"absorbed {build} ms", "expanded ms",
         "expanded / AMX", f"{build} / expanded"), rows,
    )  # fmt: skip
    report("mla_prefill", figures, tables=[table])


if __name__ == "__main__":
    main()
