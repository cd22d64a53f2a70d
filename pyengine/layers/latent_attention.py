"""Multi-head latent attention's kernel step (DeepSeek's MLA): the step's latent vectors
into their cache slots, then every query token's heads against its request's cached
latents (ops.mla_attention, the absorbed form). The projections into and out of the
latent space are the model's (models/deepseek.py)."""

from __future__ import annotations

import torch

from pyengine import ops
from pyengine.layers.attention import AttentionMetadata, KVCache


class LatentAttention:
    """One layer's: `rank` numbers of each latent vector are its value (c_kv), the
    rest its rotated key part (k_pe)."""

    # (as PagedAttention's, for the KV-cache groups: latent attention sees every position)
    sliding_window = 0
    attention_chunk = 0

    def __init__(self, num_heads: int, rank: int, rope_dim: int, scale: float) -> None:
        self.num_heads, self.rank, self.rope_dim, self.scale = num_heads, rank, rope_dim, scale
        self.kv_group = 0  # (the model runner sets it from the model's KVLayout)

    def __call__(
        self,
        query: torch.Tensor,  # [num_tokens, num_heads, rank + rope_dim]
        latent: torch.Tensor,  # [num_tokens, rank + rope_dim]
        cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Each token's heads' outputs in the latent space, [num_tokens, num_heads, rank]."""
        latents = cache[0]  # [num_blocks, block_size, rank + rope_dim]
        flat = latents.view(-1, latents.shape[-1])
        slots = meta.slot_mapping[self.kv_group]
        written = slots >= 0  # (-1: a padding row writes nothing)
        flat.index_copy_(0, slots[written], latent[written].to(flat.dtype))
        if query.dtype not in (torch.float32, latents.dtype):
            query = query.to(latents.dtype)
        out = torch.empty(query.shape[0], self.num_heads, self.rank, dtype=query.dtype,
                          device=query.device)  # fmt: skip
        ops.mla_attention(out, query.contiguous(), latents, meta.block_tables[self.kv_group],
                          meta.seq_lens, meta.query_start_loc, self.scale, self.rank)  # fmt: skip
        return out
