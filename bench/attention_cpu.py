"""CPU paged attention: pyengine against torch SDPA on contiguous K/V, same process.

Decode at batch 1, 8, 32 with contexts 512, 2k, 8k (head sizes 64 and 128, GQA 16 query
heads over 4 kv heads), and prefill of 512 and 2k tokens. pyengine reads K/V through
shuffled block tables from its paged cache; SDPA gets the same data as dense
[batch, kv_heads, context, head] tensors (enable_gqa). Also prints the K/V bytes each
decode reads per second against this machine's read bandwidth, measured here. The last line
printed is one JSON object, also written to bench/results/attention_cpu.json.

    python -m bench.attention_cpu [--quick] [--dtype float32|bfloat16]
                                  [--cache-dtype float32|bfloat16|float16]

(from the repository root; bench/__init__.py says how with a plain install)
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch
import torch.nn.functional as F

import pyengine

from .common import best_time, print_table, report

BLOCK_SIZE = 16
NUM_Q_HEADS, NUM_KV_HEADS = 16, 4


def read_bandwidth() -> float:
    """Bytes/s of a streaming read (a sum over 512 MiB), best of several."""
    data = torch.ones(128 * 2**20, dtype=torch.float32)
    seconds = best_time(lambda: data.sum(), min_repeats=5, min_seconds=1.0)
    return data.numel() * 4 / seconds


def paged_copy(
    dense: torch.Tensor, block_tables: torch.Tensor, num_blocks: int, transposed: bool
) -> torch.Tensor:
    """dense [batch, kv_heads, ctx, head] -> paged [num_blocks, kv_heads, block, head]
    ([num_blocks, kv_heads, head, block] for keys: `transposed`)."""
    batch, heads, ctx, head = dense.shape
    per_req = ctx // BLOCK_SIZE
    blocks = dense.reshape(batch, heads, per_req, BLOCK_SIZE, head).permute(0, 2, 1, 3, 4)
    blocks = blocks.reshape(-1, heads, BLOCK_SIZE, head)
    if transposed:
        blocks = blocks.transpose(2, 3)
    cache = torch.zeros(num_blocks, *blocks.shape[1:], dtype=dense.dtype)
    cache[block_tables[:, :per_req].reshape(-1).long()] = blocks
    return cache


def case(
    batch: int, ctx: int, q_len: int, head: int, dtype: torch.dtype, cache_dtype: torch.dtype
) -> dict[str, float]:
    """pyengine's queries in dtype over a cache in cache_dtype; SDPA's K/V in dtype (the
    cache's values, so both compute the same attention)."""
    gen = torch.Generator().manual_seed(batch * 1_000_003 + ctx + head)
    k = torch.randn(batch, NUM_KV_HEADS, ctx, head, generator=gen).to(cache_dtype)
    v = torch.randn(batch, NUM_KV_HEADS, ctx, head, generator=gen).to(cache_dtype)
    q = torch.randn(batch, NUM_Q_HEADS, q_len, head, generator=gen).to(dtype)
    per_req = ctx // BLOCK_SIZE
    num_blocks = batch * per_req
    block_tables = torch.from_numpy(
        np.random.default_rng(ctx).permutation(num_blocks).astype(np.int32).reshape(batch, per_req)
    )
    key_cache = paged_copy(k, block_tables, num_blocks, transposed=True)
    value_cache = paged_copy(v, block_tables, num_blocks, transposed=False)
    query = q.permute(0, 2, 1, 3).reshape(batch * q_len, NUM_Q_HEADS, head).contiguous()
    out = torch.empty_like(query)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32)
    qsl = torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32)
    scale = 1.0 / math.sqrt(head)

    def ours() -> None:
        pyengine.paged_attention(
            out, query, key_cache, value_cache, block_tables, seq_lens, qsl, scale
        )

    causal = q_len > 1

    k_peer, v_peer = k.to(dtype), v.to(dtype)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k_peer, v_peer, is_causal=causal, scale=scale, enable_gqa=True
        )

    with torch.inference_mode():
        expected = sdpa().permute(0, 2, 1, 3).reshape(batch * q_len, NUM_Q_HEADS, head)
        ours()
        error = ((out.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
        ours_s, sdpa_s = best_time(ours), best_time(sdpa)
    kv_bytes = 2 * k.numel() * k.element_size()
    return {"ours_s": ours_s, "sdpa_s": sdpa_s, "kv_bytes": kv_bytes, "error": error}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="batch 1 and 8, contexts to 2k")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument(
        "--cache-dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="the KV cache's (default: --dtype); 16-bit under float32 queries: kv_cache_dtype",
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    cache_dtype_name = args.cache_dtype or args.dtype
    cache_dtype = getattr(torch, cache_dtype_name)
    torch.set_num_threads(torch.get_num_threads())
    bandwidth = read_bandwidth()

    rows, figures = [], {}
    batches = [1, 8] if args.quick else [1, 8, 32]
    contexts = [512, 2048] if args.quick else [512, 2048, 8192]
    for head in (64, 128):
        for batch in batches:
            for ctx in contexts:
                r = case(batch, ctx, 1, head, dtype, cache_dtype)
                speedup = r["sdpa_s"] / r["ours_s"]
                share = r["kv_bytes"] / r["ours_s"] / bandwidth
                name = f"decode_b{batch}_ctx{ctx}_h{head}"
                figures[f"speedup_vs_sdpa_{name}"] = round(speedup, 2)
                figures[f"bandwidth_share_{name}"] = round(share, 3)
                rows.append((f"decode b={batch} ctx={ctx} h={head}", r, speedup, share))
    for tokens in [512] if args.quick else [512, 2048]:
        r = case(1, tokens, tokens, 128, dtype, cache_dtype)
        speedup = r["sdpa_s"] / r["ours_s"]
        figures[f"speedup_vs_sdpa_prefill_{tokens}"] = round(speedup, 2)
        rows.append((f"prefill {tokens} h=128", r, speedup, float("nan")))

    print(
        f"# CPU paged attention ({args.dtype} queries, {cache_dtype_name} cache, "
        f"block {BLOCK_SIZE}, {NUM_Q_HEADS} q / {NUM_KV_HEADS} kv heads, "
        f"{torch.get_num_threads()} threads)"
    )
    print(f"read bandwidth measured here: {bandwidth / 1e9:.1f} GB/s\n")
    cells = []
    for name, r, speedup, share in rows:
        gbs = r["kv_bytes"] / r["ours_s"] / 1e9
        share_text = "" if math.isnan(share) else f"{share:.0%}"
        gbs_text = "" if math.isnan(share) else f"{gbs:.1f}"
        cells.append(
            (name, f"{r['ours_s'] * 1e3:.3f}", f"{r['sdpa_s'] * 1e3:.3f}", f"{speedup:.2f}x",
             gbs_text, share_text, f"{r['error']:.1e}")
        )  # fmt: skip
    header = ("case", "pyengine ms", "SDPA ms", "speedup vs SDPA", "K/V GB/s",
              "share of bandwidth", "max rel. error")  # fmt: skip
    table = print_table(header, cells)
    decode = [v for k, v in figures.items() if k.startswith("speedup_vs_sdpa_decode")]
    figures["read_bandwidth_gb_s"] = round(bandwidth / 1e9, 2)
    figures["target_decode_at_least_sdpa"] = min(decode) >= 1.0
    key = "bandwidth_share_decode_b32_ctx2048_h128"
    if key in figures:
        figures["target_60pct_bandwidth_b32_ctx2k"] = figures[key] >= 0.6
    report("attention_cpu", figures, tables=[table])


if __name__ == "__main__":
    main()
