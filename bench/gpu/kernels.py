"""The CUDA kernels on one GPU, in one process:

- decode paged attention (batch 64, context 4k, head 128, 32 query / 8 KV heads): time and
  achieved GB/s of K/V read, against a large device-to-device copy measured in the same run;
- prefill attention over the paged cache (4k tokens): TFLOP/s against torch's
  scaled_dot_product_attention on contiguous K/V;
- the fused-layer and cache-write kernels against the same math in eager torch: time and
  achieved GB/s of the bytes each must read and write;
- the kernels of one prefill step of the offline-throughput run (Llama-3-8B shape, 8192
  tokens in prompts of 512), op by op: what the step costs on the device alone, to set
  against the step's measured time (bench/gpu/throughput.py);
- a mixture-of-experts layer at Qwen3-30B-A3B's shapes (GroupedExperts) against torch
  expert by expert (TorchExperts): time, and a decode row's GB/s of its active experts.

The last line printed is one JSON object, also written to bench/results/gpu_kernels.json
(gpu_kernels_attention.json with --attention-only).

    python -m bench.gpu.kernels [--tokens 4096] [--step-tokens 8192] [--dtype bfloat16]

(bench/gpu/run.sh runs it; bench/__init__.py says how from a checkout)
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch

from pyengine import ops

from ..common import print_table, report


def cuda_time(fn: Callable[[], object], repeats: int = 50) -> float:
    """Seconds per call, from CUDA events around `repeats` calls after a warm-up."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def copy_bandwidth() -> float:
    """Bytes/s of a 1 GiB device-to-device copy (read + write)."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * src.numel() / cuda_time(lambda: dst.copy_(src), repeats=20)


def paged_cache(
    lengths: list[int], kv_heads: int, d: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random K/V caches holding requests of `lengths` tokens in shuffled blocks, their
    block tables and seq_lens."""
    per_request = [-(-n // block_size) for n in lengths]
    blocks = sum(per_request)
    ids = torch.randperm(blocks, dtype=torch.int32)
    tables = torch.zeros(len(lengths), max(per_request), dtype=torch.int32)
    start = 0
    for i, n in enumerate(per_request):
        tables[i, :n] = ids[start : start + n]
        start += n
    key_cache = torch.randn(blocks, kv_heads, d, block_size, device="cuda").to(dtype)
    value_cache = torch.randn(blocks, kv_heads, block_size, d, device="cuda").to(dtype)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    return key_cache, value_cache, tables.cuda(), seq_lens.cuda()


def decode_seconds(
    batch: int,
    context: int,
    heads: int,
    kv_heads: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    repeats: int = 50,
) -> float:
    """Seconds per decode attention call: a query token for each of `batch` requests of
    `context` tokens, with the engine's hints (max_seq_len, max_query_len 1)."""
    key_cache, value_cache, tables, seq_lens = paged_cache(
        [context] * batch, kv_heads, d, block_size, dtype
    )
    query = torch.randn(batch, heads, d, device="cuda").to(dtype)
    out = torch.empty_like(query)
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    return cuda_time(
        lambda: ops.paged_attention(out, query, key_cache, value_cache, tables, seq_lens, qsl,
                                    d**-0.5, 0, 0.0, context, 1), repeats
    )  # fmt: skip


def prefill_seconds(
    tokens: int,
    heads: int,
    kv_heads: int,
    d: int,
    block_size: int,
    dtype: torch.dtype,
    repeats: int = 5,
    prompts: int = 1,
) -> float:
    """Seconds per prefill attention call: `prompts` fresh prompts of `tokens` tokens."""
    key_cache, value_cache, tables, seq_lens = paged_cache(
        [tokens] * prompts, kv_heads, d, block_size, dtype
    )
    query = torch.randn(prompts * tokens, heads, d, device="cuda").to(dtype)
    out = torch.empty_like(query)
    qsl = torch.arange(0, prompts * tokens + 1, tokens, dtype=torch.int32, device="cuda")
    return cuda_time(
        lambda: ops.paged_attention(out, query, key_cache, value_cache, tables, seq_lens, qsl,
                                    d**-0.5, 0, 0.0, tokens, tokens), repeats
    )  # fmt: skip


def sdpa_seconds(
    prompts: int, tokens: int, heads: int, kv_heads: int, d: int, dtype: torch.dtype
) -> float:
    """torch's causal scaled_dot_product_attention on contiguous [prompts, heads, tokens,
    d] Q/K/V (K/V repeated over each GQA group)."""
    q = torch.randn(prompts, heads, tokens, d, device="cuda").to(dtype)
    k = torch.randn(prompts, kv_heads, tokens, d, device="cuda").to(dtype)
    k = k.repeat_interleave(heads // kv_heads, 1)
    v = torch.randn_like(k)
    return cuda_time(
        lambda: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), repeats=5
    )


def attention_rows(
    dtype: torch.dtype, copy: float
) -> tuple[list[tuple[str, ...]], dict[str, float]]:
    heads, kv_heads, d, block_size = 32, 8, 128, 16
    rows: list[tuple[str, ...]] = []
    figures: dict[str, float] = {}
    # Decode, a query token per request, with the hints the engine gives: 64 requests of
    # 4k tokens, and 256 of 640 (the offline-throughput run's average context).
    for batch, context in ((64, 4096), (256, 640)):
        seconds = decode_seconds(batch, context, heads, kv_heads, d, block_size, dtype)
        gb_s = 2 * batch * context * kv_heads * d * dtype.itemsize / seconds
        rows.append((f"decode b={batch} ctx={context}", f"{seconds * 1e6:.0f}",
                     f"{gb_s / 1e9:.0f} GB/s", f"{gb_s / copy:.0%} of copy"))  # fmt: skip
        name = f"decode_b{batch}_ctx{context}"
        figures[f"{name}_attention_gb_s"] = round(gb_s / 1e9, 1)
        figures[f"{name}_attention_share_of_copy"] = round(gb_s / copy, 3)
    # Prefill against SDPA on contiguous K/V: one 4k-token prompt, and the throughput
    # run's prefill step (16 prompts of 512).
    for prompts, tokens, name in ((1, 4096, "prefill 4k"), (16, 512, "prefill 16 x 512")):
        seconds = prefill_seconds(tokens, heads, kv_heads, d, block_size, dtype, prompts=prompts)
        sdpa = sdpa_seconds(prompts, tokens, heads, kv_heads, d, dtype)
        flops = prompts * 2 * 2 * heads * d * tokens * tokens / 2  # QK and PV, causal half
        peer = f"SDPA {flops / sdpa / 1e12:.1f} TFLOP/s ({sdpa / seconds:.2f}x)"
        rows.append((name, f"{seconds * 1e6:.0f}", f"{flops / seconds / 1e12:.1f} TFLOP/s", peer))
        key = "prefill" if prompts == 1 else "prefill_16x512"
        figures[f"{key}_attention_tflop_s"] = round(flops / seconds / 1e12, 2)
        figures[f"speedup_vs_sdpa_{key}_attention"] = round(sdpa / seconds, 3)
    return rows, figures


def prefill_step_rows(
    tokens: int, dtype: torch.dtype, timer: Callable[[Callable[[], object]], float] = cuda_time
) -> tuple[list[tuple[str, ...]], float]:
    """Seconds of each kernel of one Llama-3-8B-shaped prefill step of `tokens` tokens in
    prompts of 512 (32 layers), as the model runs them; the rows and the total."""
    hidden, inter, heads, kv_heads, d, layers, prompt = 4096, 14336, 32, 8, 128, 32, 512
    dev = "cuda"
    x = torch.randn(tokens, hidden, device=dev, dtype=dtype)
    residual = torch.randn_like(x)
    norm = torch.rand(hidden, device=dev, dtype=dtype) + 0.5
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, device=dev, dtype=dtype)
    q = qkv[:, : heads * d].view(tokens, heads, d)
    k = qkv[:, heads * d : (heads + kv_heads) * d].view(tokens, kv_heads, d)
    v = qkv[:, (heads + kv_heads) * d :].view(tokens, kv_heads, d)
    attn = torch.empty(tokens, heads, d, device=dev, dtype=dtype)
    gate_up = torch.randn(tokens, 2 * inter, device=dev, dtype=dtype)
    act = torch.empty(tokens, inter, device=dev, dtype=dtype)
    weights = {
        name: torch.randn(n, k_, device=dev, dtype=dtype) * 0.02
        for name, (n, k_) in {
            "qkv": ((heads + 2 * kv_heads) * d, hidden), "o": (hidden, heads * d),
            "gate_up": (2 * inter, hidden), "down": (hidden, inter),
        }.items()
    }  # fmt: skip
    prompts = tokens // prompt
    key_cache, value_cache, tables, seq_lens = paged_cache(
        [prompt] * prompts, kv_heads, d, 16, dtype
    )
    slots = (tables[:, :, None].long() * 16 + torch.arange(16, device=dev)).view(-1)[:tokens]
    qsl = torch.arange(0, tokens + 1, prompt, dtype=torch.int32, device=dev)
    positions = torch.arange(tokens, device=dev, dtype=torch.int32) % prompt
    inv_freq = 1e-4 ** (torch.arange(0, d, 2, device=dev) / d)
    freqs = torch.arange(prompt, device=dev)[:, None] * inv_freq
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()
    linear = torch.nn.functional.linear
    per_layer: list[tuple[str, int, Callable[[], object]]] = [
        ("fused_add_rms_norm x2", 2, lambda: ops.fused_add_rms_norm(x, residual, norm, 1e-5)),
        ("qkv matmul", 1, lambda: linear(x, weights["qkv"])),
        ("rotary_embedding", 1, lambda: ops.rotary_embedding(positions, q, k, cos_sin)),
        ("reshape_and_cache", 1,
         lambda: ops.reshape_and_cache(k, v, key_cache, value_cache, slots)),
        ("paged_attention", 1,
         lambda: ops.paged_attention(attn, q, key_cache, value_cache, tables, seq_lens, qsl,
                                     d**-0.5, 0, 0.0, prompt, prompt)),
        ("o matmul", 1, lambda: linear(attn.view(tokens, -1), weights["o"])),
        ("gate_up matmul", 1, lambda: linear(x, weights["gate_up"])),
        ("silu_and_mul", 1, lambda: ops.silu_and_mul(act, gate_up)),
        ("down matmul", 1, lambda: linear(act, weights["down"])),
    ]  # fmt: skip
    seconds = {name: calls * layers * timer(fn) for name, calls, fn in per_layer}
    total = sum(seconds.values())
    rows = [(name, f"{s * 1e3:.1f}", f"{s / total:.0%}") for name, s in seconds.items()]
    return rows, total


def block_gemm_rows(dtype: torch.dtype, copy: float) -> tuple[list[tuple[str, ...]], dict]:  # type: ignore[type-arg]
    """ops.block_gemm on a 4096 x 4096 weight of 4-bit blocks (a Llama-3-8B projection)
    against torch's matmul over the same weight dequantized to `dtype` (cuBLAS), for a
    decode's few rows and a prefill's many; GB/s of the quantized bytes it streams."""
    from pyengine.layers.block_quantized import BlockQuantized
    from pyengine.layers.quantization.cuda_blocks import CudaBlockForm

    n = k = 4096
    gen = torch.Generator().manual_seed(0)
    scale = torch.rand(n, k // 32, generator=gen) * 0.01
    blocks = BlockQuantized(
        torch.randint(0, 16, (n, k), dtype=torch.uint8, generator=gen).numpy(),
        scale.numpy(), (-8 * scale).numpy(),
    )  # fmt: skip
    form = CudaBlockForm(blocks, torch.device("cuda"))
    dense = torch.from_numpy(blocks.dequantize()).to("cuda", dtype)
    quantized_bytes = n * k // 2 + 2 * scale.numel() * 4
    rows, figures = [], {}
    for m in (1, 16, 64, 512):
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        out = torch.empty(m, n, device="cuda", dtype=dtype)
        ours = cuda_time(lambda x=x, out=out: ops.block_gemm(
            out, x, form.packed, form.scale, form.offset, None, 4, 32))  # fmt: skip
        theirs = cuda_time(lambda x=x: x @ dense.t())
        rows.append((f"{m} rows", f"{ours * 1e6:.1f}", f"{quantized_bytes / ours / 1e9:.0f}",
                     f"{quantized_bytes / ours / copy:.0%}", f"{theirs * 1e6:.1f}",
                     f"{theirs / ours:.2f}x"))  # fmt: skip
        figures[f"block_gemm_m{m}_us"] = round(ours * 1e6, 1)
        figures[f"speedup_vs_torch_block_gemm_m{m}"] = round(theirs / ours, 2)
    # FP8 W8A8's product (layers/quantization/fp8_w8a8.py): e4m3 x e4m3, scales per row and column
    fp8_weight = (dense / dense.abs().amax()).to(torch.float8_e4m3fn)
    for m in (16, 512):
        xq = torch.randn(m, k, device="cuda").to(torch.float8_e4m3fn)
        sx, sw = torch.ones(m, 1, device="cuda"), torch.ones(1, n, device="cuda")
        x = torch.randn(m, k, device="cuda", dtype=dtype)
        ours = cuda_time(lambda xq=xq, sx=sx, sw=sw: torch._scaled_mm(
            xq, fp8_weight.t(), scale_a=sx, scale_b=sw, out_dtype=torch.bfloat16))  # fmt: skip
        theirs = cuda_time(lambda x=x: x @ dense.t())
        rows.append((f"FP8 _scaled_mm, {m} rows", f"{ours * 1e6:.1f}",
                     f"{n * k / ours / 1e9:.0f}", f"{n * k / ours / copy:.0%}",
                     f"{theirs * 1e6:.1f}", f"{theirs / ours:.2f}x"))  # fmt: skip
        figures[f"speedup_vs_torch_fp8_scaled_mm_m{m}"] = round(theirs / ours, 2)
        # INT8 W8A8's (layers/quantization/int8_w8a8.py): int8 x int8 into int32 on the tensor cores
        xi = torch.randint(-127, 128, (m, k), device="cuda", dtype=torch.int8)
        wi = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8)
        ours = cuda_time(lambda xi=xi, wi=wi: torch._int_mm(xi, wi.t()))
        rows.append((f"INT8 _int_mm, {m} rows", f"{ours * 1e6:.1f}",
                     f"{n * k / ours / 1e9:.0f}", f"{n * k / ours / copy:.0%}",
                     f"{theirs * 1e6:.1f}", f"{theirs / ours:.2f}x"))  # fmt: skip
        figures[f"speedup_vs_torch_int8_int_mm_m{m}"] = round(theirs / ours, 2)
    return rows, figures


def moe_rows(dtype: torch.dtype, copy: float) -> tuple[list[tuple[str, ...]], dict]:  # type: ignore[type-arg]
    """A FusedMoE layer of Qwen3-30B-A3B's shapes (hidden 2048, 128 experts, top 8, expert
    size 768) through GroupedExperts against TorchExperts on the same weights; for one
    row, GB/s of the 8 active experts' bytes."""
    from pyengine.layers.moe.layer import FusedMoE
    from pyengine.layers.moe.methods import GroupedExperts, TorchExperts
    from pyengine.layers.moe.routing import RoutingConfig
    from pyengine.layers.placement import Placement

    hidden, n, experts, top_k = 2048, 768, 128, 8
    placement = Placement(dtype=dtype, device=torch.device("cuda"))
    routing = RoutingConfig("softmax", top_k, experts, renormalize=True)
    ours_layer = FusedMoE(hidden, n, routing, placement, method=GroupedExperts(placement))
    for p in ours_layer.parameters():
        p.data.normal_(0.0, hidden**-0.5)
    ours_layer.process_weights_after_loading()
    torch_layer = FusedMoE(hidden, n, routing, placement, method=TorchExperts(placement))
    torch_layer.router, torch_layer.gate_up = ours_layer.router, ours_layer.gate_up
    torch_layer.down = ours_layer.down
    active = top_k * 3 * n * hidden * (torch.finfo(dtype).bits // 8)
    rows, figures = [], {}
    for m in (1, 64, 512):
        x = torch.randn(m, hidden, device="cuda", dtype=dtype)
        ours = cuda_time(lambda x=x: ours_layer(x), repeats=20)
        theirs = cuda_time(lambda x=x: torch_layer(x), repeats=5)
        bandwidth = f"{active / ours / 1e9:.0f} ({active / ours / copy:.0%})" if m == 1 else "-"
        rows.append((f"{m} rows", f"{ours * 1e6:.0f}", bandwidth, f"{theirs * 1e6:.0f}",
                     f"{theirs / ours:.2f}x"))  # fmt: skip
        figures[f"moe_m{m}_us"] = round(ours * 1e6, 1)
        figures[f"speedup_vs_torch_moe_m{m}"] = round(theirs / ours, 2)
    return rows, figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--step-tokens", type=int, default=8192, help="of the prefill step")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument(
        "--attention-only",
        action="store_true",
        help="only the attention table (run.sh runs "
        "it again with PYENGINE_FLASH_PREFILL_WARPS=4, the other prefill tile)",
    )
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    device = torch.cuda.get_device_name()
    copy = copy_bandwidth()
    attention, attention_figures = attention_rows(dtype, copy)
    figures = {"copy_gb_s": round(copy / 1e9, 1), **attention_figures}
    attention_columns = ("attention (32 q / 8 kv heads, head 128)", "us", "achieved", "against")
    if args.attention_only:
        table = print_table(attention_columns, attention)
        report("gpu_kernels_attention", figures, tables=[table], device=device)
        return
    size = torch.finfo(dtype).bits // 8
    t, hidden, inter, heads, kv_heads, d = args.tokens, 4096, 14336, 32, 8, 128
    dev = "cuda"
    x = torch.randn(t, hidden, device=dev, dtype=dtype)
    residual = torch.randn_like(x)
    weight = torch.rand(hidden, device=dev, dtype=dtype) + 0.5
    out = torch.empty_like(x)
    gate_up = torch.randn(t, 2 * inter, device=dev, dtype=dtype)
    act = torch.empty(t, inter, device=dev, dtype=dtype)
    q = torch.randn(t, heads, d, device=dev, dtype=dtype)
    k = torch.randn(t, kv_heads, d, device=dev, dtype=dtype)
    positions = torch.randint(0, 8192, (t,), device=dev)
    inv_freq = 1e-4 ** (torch.arange(0, d, 2, device=dev) / d)
    freqs = torch.arange(8192, device=dev)[:, None] * inv_freq
    cos_sin = torch.cat((freqs.cos(), freqs.sin()), dim=-1).float()
    blocks, block_size = t // 16 + 8, 16
    key_cache = torch.zeros(blocks, kv_heads, d, block_size, device=dev, dtype=dtype)
    value_cache = torch.zeros(blocks, kv_heads, block_size, d, device=dev, dtype=dtype)
    slots = torch.randperm(blocks * block_size, device=dev)[:t]

    def torch_rms_norm() -> torch.Tensor:
        xf = x.float()
        inv = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)
        return (weight.float() * (xf * inv)).to(dtype)

    def torch_rotary() -> None:
        cs = cos_sin[positions][:, None, :]
        for tensor in (q, k):
            a, b = tensor[..., : d // 2].float(), tensor[..., d // 2 :].float()
            c, s = cs[..., : d // 2], cs[..., d // 2 :]
            tensor.copy_(torch.cat((a * c - b * s, b * c + a * s), dim=-1))

    def torch_cache_write() -> None:
        block, offset = slots // block_size, slots % block_size
        key_cache[block, :, :, offset] = k
        value_cache[block, :, offset, :] = k

    cases: list[tuple[str, int, Callable[[], object], Callable[[], object]]] = [
        ("rms_norm", 2 * t * hidden * size,
         lambda: ops.rms_norm(out, x, weight, 1e-6), torch_rms_norm),
        ("fused_add_rms_norm", 4 * t * hidden * size,
         lambda: ops.fused_add_rms_norm(out, residual, weight, 1e-6),
         lambda: torch_rms_norm() + residual),
        ("silu_and_mul", 3 * t * inter * size,
         lambda: ops.silu_and_mul(act, gate_up),
         lambda: torch.nn.functional.silu(gate_up[:, :inter]) * gate_up[:, inter:]),
        ("rotary_embedding", 2 * t * (heads + kv_heads) * d * size,
         lambda: ops.rotary_embedding(positions, q, k, cos_sin), torch_rotary),
        ("reshape_and_cache", 4 * t * kv_heads * d * size,
         lambda: ops.reshape_and_cache(k, k, key_cache, value_cache, slots), torch_cache_write),
    ]  # fmt: skip
    rows: list[tuple[str, ...]] = []
    for name, traffic, ours, theirs in cases:
        mine, peer = cuda_time(ours), cuda_time(theirs)
        gb_s = traffic / mine
        rows.append((name, f"{mine * 1e6:.1f}", f"{gb_s / 1e9:.0f}", f"{gb_s / copy:.0%}",
                     f"{peer * 1e6:.1f}", f"{peer / mine:.2f}x"))  # fmt: skip
        figures[f"{name}_gb_s"] = round(traffic / mine / 1e9, 1)
        figures[f"speedup_vs_torch_{name}"] = round(peer / mine, 2)
    print(f"# CUDA kernels: {torch.cuda.get_device_name()}, {args.dtype}; "
          f"device-to-device copy {copy / 1e9:.0f} GB/s")  # fmt: skip
    tables = [print_table(attention_columns, attention)]
    print()
    print(f"fused layers and cache writes, {t} tokens:")
    tables.append(
        print_table(("kernel", "us", "GB/s", "of copy", "torch us", "speedup vs torch"), rows)
    )
    step_rows, step = prefill_step_rows(args.step_tokens, dtype)
    print()
    print(f"one prefill step of {args.step_tokens} tokens in prompts of 512, 32 layers, "
          f"kernels alone: {step * 1e3:.0f} ms")  # fmt: skip
    tables.append(print_table(("op (all layers)", "ms", "share"), step_rows))
    figures["prefill_step_kernels_ms"] = round(step * 1e3, 1)
    gemm_rows, gemm_figures = block_gemm_rows(dtype, copy)
    print()
    print("4-bit block GEMM (PYENGINE_CUDA_BLOCK_GEMM), FP8's _scaled_mm and INT8's _int_mm,")
    print("4096 x 4096,")
    print("against torch's matmul over the 16-bit weight (GB/s: of the quantized bytes):")
    gemm_columns = ("x rows", "us", "GB/s", "of copy", "torch us", "speedup vs torch")
    tables.append(print_table(gemm_columns, gemm_rows))
    figures.update(gemm_figures)
    moe, moe_figures = moe_rows(dtype, copy)
    print()
    print("mixture-of-experts layer, Qwen3-30B-A3B shapes (2048 hidden, 128 experts, top 8,")
    print("768 each), against torch expert by expert:")
    moe_columns = ("x rows", "us", "GB/s (of copy)", "torch us", "speedup vs torch")
    tables.append(print_table(moe_columns, moe))
    figures.update(moe_figures)
    report("gpu_kernels", figures, tables=tables, device=device)


if __name__ == "__main__":
    main()
