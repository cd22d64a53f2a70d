"""pyengine: a high-throughput LLM inference and serving engine.

The native core (KV-cache manager, prefix hashing, cache kernels) lives in the C++
extension ``pyengine._C``; this package re-exports it under stable names.
"""

from pathlib import Path

try:
    from pyengine import _C  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on how pyengine was installed
    raise ImportError(
        f"pyengine's native extension pyengine._C is missing from {Path(__file__).parent}: "
        "this looks like the source tree rather than an installed pyengine. Install it "
        "(pip install .) and run from another folder, or install it editable (pip install -e .)"
    ) from error

from pyengine._C import (
    BlockPool,
    ComputedBlocks,
    KVCacheManager,
    KVCacheStats,
    Scheduler,
    SchedulerStats,
    StepBuffers,
    StepResults,
    built_with_cuda,
    compute_block_keys,
    copy_blocks,
    paged_attention,
    replay_requests,
    reshape_and_cache,
    swap_blocks,
    xxhash64,
)
from pyengine.lora.request import LoRARequest
from pyengine.outputs import CompletionOutput, RequestOutput
from pyengine.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "BeamSearchParams",
    "LoRARequest",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "StructuredOutputsParams",
    "BlockPool",
    "ComputedBlocks",
    "KVCacheManager",
    "KVCacheStats",
    "Scheduler",
    "SchedulerStats",
    "StepBuffers",
    "StepResults",
    "built_with_cuda",
    "compute_block_keys",
    "copy_blocks",
    "paged_attention",
    "replay_requests",
    "reshape_and_cache",
    "swap_blocks",
    "xxhash64",
]


def __getattr__(name: str) -> object:
    # LLM needs torch: `import pyengine` stays light for users of the native core alone.
    if name == "LLM":
        from pyengine.entrypoints.llm import LLM

        return LLM
    if name == "BeamSearchParams":
        from pyengine.entrypoints.beam_search import BeamSearchParams

        return BeamSearchParams
    raise AttributeError(f"module 'pyengine' has no attribute {name!r}")
