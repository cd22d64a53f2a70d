"""Tensor- and pipeline-parallel places: which shard of each weight and which layers a
worker holds, and the collectives and transfers that join them."""

from pyengine.distributed.parallel_state import CommStats, TensorParallelGroup
from pyengine.distributed.pipeline import IntermediateTensors, PipelineStage, stage_layer_ranges

__all__ = [
    "CommStats",
    "IntermediateTensors",
    "PipelineStage",
    "TensorParallelGroup",
    "stage_layer_ranges",
]
