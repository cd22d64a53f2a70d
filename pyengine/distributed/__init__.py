"""Tensor-parallel groups: which shard of each weight a worker holds, and the collectives
that join the shards' results."""

from pyengine.distributed.parallel_state import TensorParallelGroup

__all__ = ["TensorParallelGroup"]
