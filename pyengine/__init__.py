"""pyengine: a high-throughput LLM inference and serving engine.

The native core (KV-cache manager, prefix hashing, cache kernels) lives in the C++
extension ``pyengine._C``; this package re-exports it under stable names.
"""

from pyengine._C import (
    BlockPool,
    ComputedBlocks,
    KVCacheManager,
    KVCacheStats,
    built_with_cuda,
    replay_requests,
    compute_block_keys,
    copy_blocks,
    xxhash64,
)

__version__ = "0.1.0"

__all__ = [
    "BlockPool",
    "ComputedBlocks",
    "KVCacheManager",
    "KVCacheStats",
    "built_with_cuda",
    "replay_requests",
    "compute_block_keys",
    "copy_blocks",
    "xxhash64",
]
