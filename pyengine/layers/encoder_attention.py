"""An encoder's self-attention (BERT's, XLM-R's): each request's tokens attend to all of
its tokens, before and after. An encoder's prompt runs whole in one step (the pooling
runner schedules no chunks), so its keys and values are the step's own and nothing is
cached: its layers have no KV-cache pages (NO_CACHE_SPEC)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pyengine.layers.attention import AttentionMetadata, KVCache


class EncoderAttention:
    # (what the KV-cache layout asks of an attention layer: it has no window)
    sliding_window = 0
    attention_chunk = 0

    def __init__(self, num_heads: int, head_size: int) -> None:
        self.num_heads = num_heads
        self.head_size = head_size

    def __call__(
        self,
        q: torch.Tensor,  # [tokens, heads, head_size]
        k: torch.Tensor,
        v: torch.Tensor,
        cache: KVCache,  # (none: an encoder caches nothing)
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """[tokens, heads, head_size]: each request's queries over its own keys."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        bounds = meta.query_start_loc.tolist()
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            if end > start:
                # [1, heads, rows, size]: the 4-d form torch's fused CPU kernel takes
                qs, ks, vs = (t[start:end].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
                out[start:end] = F.scaled_dot_product_attention(qs, ks, vs)[0].transpose(0, 1)
        return out
