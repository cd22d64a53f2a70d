"""pyengine's kernels as torch.library custom ops (``torch.ops.pyengine.*``).

Registered as custom ops, the kernels are visible to ``torch.compile`` and to CUDA graph
capture, and one wheel serves any torch version: tensors cross into ``pyengine._C``
through DLPack, never through libtorch's C++ ABI. Importing this module needs torch.

Shapes (see cpp/include/pyengine/attention.h):
    key_cache:   [num_blocks, num_kv_heads, head_size, block_size]   (keys transposed)
    value_cache: [num_blocks, num_kv_heads, block_size, head_size]

Example::

    import torch
    from pyengine import ops

    ops.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)
    ops.paged_attention(out, query, key_cache, value_cache, block_tables, seq_lens,
                        query_start_loc, scale=head_size**-0.5)
"""

from __future__ import annotations

import torch

from pyengine import _C


@torch.library.custom_op("pyengine::reshape_and_cache", mutates_args=("key_cache", "value_cache"))
def reshape_and_cache(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_size]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # int64 [num_tokens], -1: skip
) -> None:
    """Writes each new token's key and value into its cache slot."""
    _C.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping)


@reshape_and_cache.register_fake
def _(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    return None


@torch.library.custom_op("pyengine::paged_attention", mutates_args=("out",))
def paged_attention(
    out: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    query: torch.Tensor,  # [num_tokens, num_q_heads, head_size]
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # int32 [num_reqs, max_blocks_per_req]
    seq_lens: torch.Tensor,  # int32 [num_reqs]
    query_start_loc: torch.Tensor,  # int32 [num_reqs + 1]
    scale: float,
    sliding_window: int = 0,
    logit_soft_cap: float = 0.0,
) -> None:
    """Causal attention of each request's query tokens to its cached context, into out."""
    _C.paged_attention(
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        sliding_window,
        logit_soft_cap,
    )


@paged_attention.register_fake
def _(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    logit_soft_cap: float = 0.0,
) -> None:
    return None


@torch.library.custom_op("pyengine::copy_blocks", mutates_args=("key_caches", "value_caches"))
def copy_blocks(
    key_caches: list[torch.Tensor],
    value_caches: list[torch.Tensor],
    block_mapping: torch.Tensor,  # int64 [num_pairs, 2] (src, dst), on the CPU
) -> None:
    """Copy-on-write: block dst of every layer's caches becomes a copy of block src."""
    _C.copy_blocks([*key_caches, *value_caches], block_mapping)


@copy_blocks.register_fake
def _(
    key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor
) -> None:
    return None


@torch.library.custom_op("pyengine::swap_blocks", mutates_args=("dst",))
def swap_blocks(
    src: torch.Tensor,
    dst: torch.Tensor,
    block_mapping: torch.Tensor,  # int64 [num_pairs, 2] (src block, dst block), on the CPU
) -> None:
    """Copies blocks between two caches (a device cache and a host pool, say)."""
    _C.swap_blocks(src, dst, block_mapping)


@swap_blocks.register_fake
def _(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    return None
