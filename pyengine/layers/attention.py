"""The attention layer over the paged KV cache, and the per-step metadata it reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyengine import ops


@dataclass
class AttentionMetadata:
    """The step's flat batch as the kernels see it (see StepBuffers)."""

    slot_mapping: torch.Tensor  # int64 [num_tokens]
    block_tables: torch.Tensor  # int32 [num_reqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    max_seq_len: int = 0  # the longest seq_len (0: unknown), for the CUDA kernel's split
    max_query_len: int = 0  # the most query tokens of a request (0: unknown), CUDA grid


# One layer's cache: keys [num_blocks, kv_heads, head, block] (transposed), values
# [num_blocks, kv_heads, block, head].
KVCache = tuple[torch.Tensor, torch.Tensor]


class PagedAttention:
    """Writes the step's K/V into their slots, then attends every query token causally to
    its request's context through the block table: one call for prefill, chunked prefill
    and decode together."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_size: int, sliding_window: int = 0
    ) -> None:
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = head_size**-0.5
        self.sliding_window = sliding_window
        # A checkpoint's static per-tensor K and V scales, which an int8 cache takes (0:
        # a scale per token and head; other caches need none).
        self.k_scale = self.v_scale = 0.0

    def __call__(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        key_cache, value_cache = cache
        int8 = key_cache.dtype == torch.int8
        ops.reshape_and_cache(
            key, value, key_cache, value_cache, meta.slot_mapping,
            self.k_scale if int8 else 0.0, self.v_scale if int8 else 0.0,
        )  # fmt: skip
        out = torch.empty_like(query)
        ops.paged_attention(
            out,
            query,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            self.sliding_window,
            0.0,
            meta.max_seq_len,
            meta.max_query_len,
        )
        return out
