"""The attention layer over the paged KV cache, and the per-step metadata it reads."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pyengine import ops


@dataclass
class AttentionMetadata:
    """The step's flat batch as the kernels see it (see StepBuffers): the slots and block
    tables of each KV-cache group (worker/kv_layout.py), which a layer picks by its own."""

    slot_mapping: torch.Tensor  # int64 [num_kv_groups, num_tokens]
    block_tables: torch.Tensor  # int32 [num_kv_groups, num_reqs, max_blocks]
    seq_lens: torch.Tensor  # int32 [num_reqs]
    query_start_loc: torch.Tensor  # int32 [num_reqs + 1]
    max_seq_len: int = 0  # the longest seq_len (0: unknown), for the CUDA kernel's split
    max_query_len: int = 0  # the most query tokens of a request (0: unknown), CUDA grid
    # A hybrid model's recurrent layers: each one's state tensors (by its state_index:
    # layers/recurrent_state.py), each request's state slot, and 1 where the slot holds
    # the state of its tokens before the step (0: new, read as zeros; int32 [num_reqs]).
    # None for a model without them.
    states: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    state_slots: torch.Tensor | None = None
    has_state: torch.Tensor | None = None


# One layer's cache: keys [num_blocks, kv_heads, head, block] (transposed), values
# [num_blocks, kv_heads, block, head].
KVCache = tuple[torch.Tensor, torch.Tensor]


class PagedAttention:
    """Writes the step's K/V into their slots, then attends every query token causally to
    its request's context through the block table: one call for prefill, chunked prefill
    and decode together."""

    def __init__(
        self, num_heads: int, num_kv_heads: int, head_size: int, sliding_window: int = 0,
        scale: float | None = None, logit_soft_cap: float = 0.0, attention_chunk: int = 0,
    ) -> None:  # fmt: skip
        """scale: of q . k (None: head_size^-0.5); logit_soft_cap: each score as cap *
        tanh(score / cap) before the softmax (0: none; Gemma 2's); attention_chunk: a
        query sees only the keys of its own chunk of that many positions (0: no chunks;
        Llama 4's local layers)."""
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_size = head_size
        self.scale = head_size**-0.5 if scale is None else scale
        self.sliding_window = sliding_window
        self.attention_chunk = attention_chunk
        self.logit_soft_cap = logit_soft_cap
        # Each head's sink logit (gpt-oss's), float32 [num_heads] on the caches' device: it
        # takes a share of the softmax and adds no value. None: no sinks.
        self.sinks: torch.Tensor | None = None
        # A checkpoint's static per-tensor K and V scales (0: none), and the cache dtype
        # that takes them: an int8 cache's instead of its scale per token and head; an
        # fp8 cache stores x / scale (the scores then times k_scale, the output v_scale).
        self.k_scale = self.v_scale = 0.0
        self.scaled_cache: torch.dtype | None = None
        # The KV-cache group whose block tables this layer reads (the model runner sets
        # it from the model's KVLayout).
        self.kv_group = 0

    def static_scales(self, kind: str | None, k_scale: float, v_scale: float) -> None:
        """A checkpoint's kv_cache_scheme scales, for its cache `kind` ("int8", "fp8")."""
        self.k_scale, self.v_scale = k_scale, v_scale
        self.scaled_cache = {"int8": torch.int8, "fp8": torch.uint8}.get(kind or "")

    def __call__(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor,
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        key_cache, value_cache = cache
        scaled = key_cache.dtype == self.scaled_cache
        k_scale, v_scale = (self.k_scale, self.v_scale) if scaled else (0.0, 0.0)
        ops.reshape_and_cache(
            key, value, key_cache, value_cache, meta.slot_mapping[self.kv_group], k_scale, v_scale
        )
        fp8_scales = scaled and key_cache.dtype == torch.uint8  # (the CPU's fp8 cache)
        out = torch.empty_like(query)
        ops.paged_attention(
            out,
            query,
            key_cache,
            value_cache,
            meta.block_tables[self.kv_group],
            meta.seq_lens,
            meta.query_start_loc,
            self.scale * k_scale if fp8_scales else self.scale,
            self.sliding_window,
            self.logit_soft_cap,
            meta.max_seq_len,
            meta.max_query_len,
            self.sinks,
            self.attention_chunk,
        )
        return out.mul_(v_scale) if fp8_scales else out
