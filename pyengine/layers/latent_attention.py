"""Multi-head latent attention's kernel step (DeepSeek's MLA): the step's latent vectors
into their cache slots, then every query token's heads against its request's cached
latents, in one of two forms.

- Absorbed (ops.mla_attention): the queries taken into the latent space, attending over
  the latents themselves. Per query and key it costs heads x (2 rank + rope), and
  nothing per key beside: the form for decode and short chunks.
- Expanded (`expanded_attention`): each request's cached latents turned into per-head
  keys and values, then plain causal attention (the paged attention kernel). Per query
  and key it costs heads x (nope + rope + v), a third of the absorbed form's at
  DeepSeek's sizes, but expanding a key costs heads x rank x (nope + v): the form for a
  request with many query tokens (a prefill), from `EXPANDED_FROM` of them (by the
  latent kernel's build).

The projections into and out of the latent space are the model's (models/deepseek.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from pyengine import _C, ops
from pyengine.layers.attention import AttentionMetadata, KVCache

# A request takes the expanded form from this many query tokens of a step, by the build
# of the latent kernel that runs the absorbed one (`_C.mla_bf16_build`; None: never):
# past it the keys' expansion (heads x rank x (nope + v) a key) costs less than what the
# cheaper scores save. bench/mla_prefill.py measures both forms at DeepSeek-V2-Lite's
# sizes. The portable loops (float32, float16, and bfloat16 on CPUs without AVX512-BF16)
# are faster at 16 tokens and for a prompt of 64 alone on an AVX-512 CPU, the expanded
# form 1.65x at 64 tokens over 256 latents and 6.4x for a whole 4k-token prompt (the
# SSE2 build put the crossing at 32). AVX512-BF16's dot products hold out to about 128
# tokens (0.95x there for a prompt alone, 1.3x over 512 latents, 1.9x at 1024). On AMX's
# tiles the absorbed form is faster at every size measured (1.2x to 4.8x).
EXPANDED_FROM: dict[str, int | None] = {"portable": 32, "avx512_bf16": 128, "amx": None}
# The context's tokens expanded at a time, into the cache the expanded form attends over
# (so that its keys and values exist once, in that cache, beside one piece's).
EXPANDED_PIECE = 1024


# An fp8 (e4m3) cache's storage: its bytes (the kernels' kFp8Cache).
FP8_CACHE = torch.uint8


def to_cache(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`rows` in a cache of `dtype` (an fp8 one's: e4m3's bytes)."""
    if dtype == FP8_CACHE:
        return rows.to(torch.float8_e4m3fn).view(FP8_CACHE)
    return rows.to(dtype)


def expanded_head_size(qk: int, v: int) -> int | None:
    """The head size the paged attention kernel takes for keys of `qk` and values of `v`
    numbers (both padded with zeros to the least it runs that holds them); None where
    it runs none so large."""
    sizes = [size for size in _C.attention_head_sizes() if size >= max(qk, v)]
    return min(sizes) if sizes else None


@dataclass(frozen=True)
class ExpandedWeights:
    """kv_b_proj by head: the key half [heads, nope, rank] and the value half [heads,
    rank, v]; the scale of q . k, and the head size the kernel runs them at
    (expanded_head_size)."""

    w_uk: torch.Tensor
    w_uv: torch.Tensor
    scale: float
    head_size: int


def expanded_attention(
    query: torch.Tensor,  # [tokens, heads, nope + rope]: the request's last query tokens
    context: torch.Tensor,  # [seq_len, rank + rope]: its cached latents, the step's last
    weights: ExpandedWeights,
    block_size: int = 16,
) -> torch.Tensor:
    """Each query token's heads' outputs in the value space, [tokens, heads, v]: the
    latents expanded to keys (nope from c_kv, the rotated part shared by the heads) and
    values, then causal attention (query i sits at position seq_len - tokens + i) by the
    paged attention kernel over a cache of the request's own, queries, keys and values
    padded with zeros to weights.head_size (the kernel takes one size for all three)."""
    tokens, seq_len = query.shape[0], context.shape[0]
    heads, nope, rank = weights.w_uk.shape
    v, qk, size = weights.w_uv.shape[2], query.shape[2], weights.head_size
    dtype, device = weights.w_uk.dtype, query.device
    blocks = -(-seq_len // block_size)
    key_cache = torch.empty(blocks, heads, size, block_size, dtype=dtype, device=device)
    value_cache = torch.empty(blocks, heads, block_size, size, dtype=dtype, device=device)
    # (a piece of the context at a time: the cache of the request's own is what it holds)
    for start in range(0, seq_len, EXPANDED_PIECE):
        piece = context[start : start + EXPANDED_PIECE]
        c_kv = piece[:, :rank].to(dtype)
        keys = torch.zeros(piece.shape[0], heads, size, dtype=dtype, device=device)
        keys[..., :nope] = torch.einsum("cr,hnr->chn", c_kv, weights.w_uk)
        keys[..., nope:qk] = piece[:, None, rank:].to(dtype)
        values = torch.zeros(piece.shape[0], heads, size, dtype=dtype, device=device)
        values[..., :v] = torch.einsum("cr,hrv->chv", c_kv, weights.w_uv)
        slots = torch.arange(start, start + piece.shape[0], device=device)
        ops.reshape_and_cache(keys, values, key_cache, value_cache, slots)
    table = torch.arange(blocks, dtype=torch.int32, device=query.device)[None]
    lens = torch.tensor([seq_len], dtype=torch.int32, device=query.device)
    starts = torch.tensor([0, tokens], dtype=torch.int32, device=query.device)
    padded = torch.zeros(tokens, heads, size, dtype=dtype, device=query.device)
    padded[..., :qk] = query
    out = torch.empty_like(padded)
    ops.paged_attention(out, padded, key_cache, value_cache, table, lens, starts,
                        weights.scale, 0, 0.0, seq_len, tokens)  # fmt: skip
    return out[..., :v]


def long_requests(meta: AttentionMetadata, expanded_from: int) -> tuple[list[int], list[int]]:
    """The requests of the step with at least `expanded_from` query tokens, and the step's
    query_start_loc as read to find them (none of either, without a host look, where the
    step says its longest has fewer)."""
    if 0 < meta.max_query_len < expanded_from:
        return [], []
    starts = meta.query_start_loc.tolist()
    long = [r for r in range(len(starts) - 1) if starts[r + 1] - starts[r] >= expanded_from]
    return long, starts


class LatentAttention:
    """One layer's: `rank` numbers of each latent vector are its value (c_kv), the
    rest its rotated key part (k_pe)."""

    # (as PagedAttention's, for the KV-cache groups: latent attention sees every position)
    sliding_window = 0
    attention_chunk = 0

    def __init__(self, num_heads: int, rank: int, rope_dim: int, scale: float) -> None:
        self.num_heads, self.rank, self.rope_dim, self.scale = num_heads, rank, rope_dim, scale
        self.kv_group = 0  # (the model runner sets it from the model's KVLayout)
        self.expanded_from = dict(EXPANDED_FROM)  # (a layer's own, that a test may lower)

    def expanded_from_over(self, cache: KVCache, dtype: torch.dtype) -> int | None:
        """The query tokens from which a request takes the expanded form, for queries
        in `dtype` over `cache` (None: none does), by the build that runs the absorbed one."""
        latents = cache[0]
        build = "portable"
        if latents.device.type == "cpu" and dtype == latents.dtype == torch.bfloat16:
            build = _C.mla_bf16_build(self.num_heads, latents.shape[-1], self.rank,
                                      latents.shape[1])  # fmt: skip
        return self.expanded_from[build]

    def write(self, latent: torch.Tensor, cache: KVCache, meta: AttentionMetadata) -> None:
        """The step's latent vectors [num_tokens, rank + rope_dim] into their slots (an fp8
        cache's: rounded to e4m3, unscaled, as vLLM's fp8 latent cache holds them)."""
        latents = cache[0]  # [num_blocks, block_size, rank + rope_dim]
        flat = latents.view(-1, latents.shape[-1])
        slots = meta.slot_mapping[self.kv_group]
        written = slots >= 0  # (-1: a padding row writes nothing)
        flat.index_copy_(0, slots[written], to_cache(latent[written], flat.dtype))

    def absorbed(
        self, query: torch.Tensor, cache: KVCache, meta: AttentionMetadata
    ) -> torch.Tensor:
        """query [num_tokens, num_heads, rank + rope_dim] (in the latent space) against
        the cached latents: [num_tokens, num_heads, rank]."""
        latents = cache[0]
        if latents.dtype == FP8_CACHE or query.dtype not in (torch.float32, latents.dtype):
            query = query.to(torch.float32 if latents.dtype == FP8_CACHE else latents.dtype)
        out = torch.empty(query.shape[0], self.num_heads, self.rank, dtype=query.dtype,
                          device=query.device)  # fmt: skip
        ops.mla_attention(out, query.contiguous(), latents, meta.block_tables[self.kv_group],
                          meta.seq_lens, meta.query_start_loc, self.scale, self.rank)  # fmt: skip
        return out

    def context(self, cache: KVCache, meta: AttentionMetadata, request: int) -> torch.Tensor:
        """Request `request`'s cached latents, [seq_len, rank + rope_dim]."""
        latents = cache[0]
        seq_len = int(meta.seq_lens[request])
        blocks = -(-seq_len // latents.shape[1])
        table = meta.block_tables[self.kv_group, request, :blocks].long()
        rows = latents[table].view(-1, latents.shape[-1])[:seq_len]
        return rows.view(torch.float8_e4m3fn) if rows.dtype == FP8_CACHE else rows


def without_requests(
    meta: AttentionMetadata, starts: list[int], requests: list[int]
) -> tuple[AttentionMetadata, torch.Tensor]:
    """The step's metadata (its query_start_loc as `starts`) with `requests` (not all of
    them) taken out, and the query rows of those that remain."""
    dropped = set(requests)
    keep = [r for r in range(len(starts) - 1) if r not in dropped]
    rows = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in keep])
    lengths = torch.tensor([starts[r + 1] - starts[r] for r in keep], dtype=torch.int32)
    kept_starts = torch.zeros(len(keep) + 1, dtype=torch.int32)
    kept_starts[1:] = lengths.cumsum(0)
    device = meta.seq_lens.device
    index = torch.tensor(keep, device=device)
    sub = replace(
        meta,
        slot_mapping=meta.slot_mapping[:, rows.to(device)],
        block_tables=meta.block_tables[:, index],
        seq_lens=meta.seq_lens[index],
        query_start_loc=kept_starts.to(device),
        max_query_len=int(lengths.max()),
    )
    return sub, rows
