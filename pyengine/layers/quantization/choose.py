"""LinearMethods: which LinearMethod each linear layer of a model gets, when the model is
built. A quantized checkpoint's layers (all but the head) get its method's (registry.py);
a weight whose parts all came as GGUF blocks keeps them where the placement can multiply
them (gguf.py); every other weight is float, in the dense form the placement calls for
(unquantized.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pyengine.config import QuantizationConfig
from pyengine.layers.placement import Placement
from pyengine.layers.quantization.base import LinearMethod
from pyengine.layers.quantization.gguf import gguf_method
from pyengine.layers.quantization.registry import quantization_method
from pyengine.layers.quantization.unquantized import TorchLinearMethod, dense_method


@dataclass(frozen=True)
class LinearMethods:
    """Chooses each layer's method from the placement and the checkpoint."""

    placement: Placement = Placement()
    # Checkpoint weight names that came with a GGUF block form.
    block_quantized: frozenset[str] = frozenset()
    # A quantized checkpoint's (GPTQ, AWQ, compressed-tensors): its layers' weights (all
    # but the head) are integers.
    quantization: QuantizationConfig | None = None
    # EngineArgs.quantized_activations: which block-quantized layers take int8 rows.
    quantized_activations: str = "float32"
    # Every step is whole prompts (the pooling runner's): a bfloat16 weight is torch's
    # matmul's (oneDNN's, AMX where the CPU has it), faster at thousands of rows than the
    # panels, which are made for decode steps of a few.
    prompts_only: bool = False

    def choose(self, checkpoint_names: Sequence[str], many_rows: bool = True) -> LinearMethod:
        """The method of a layer made of `checkpoint_names` (its parts, in order);
        many_rows: whether it multiplies every token of a step (the head sees only the
        sampled rows: it keeps no split form, and stays float in a quantized checkpoint)."""
        int8_activations = self.quantized_activations == "int8"
        if self.quantization is not None and many_rows:
            method = quantization_method(self.quantization.method)
            return method.linear_method(self.quantization, self.placement, int8_activations)
        names = list(checkpoint_names)
        has_blocks = bool(names) and all(name in self.block_quantized for name in names)
        if has_blocks and self.placement.keeps_gguf_blocks:
            return gguf_method(self.placement, int8_activations)
        if self.prompts_only and self.placement.packs_bf16_weights:
            return TorchLinearMethod(self.placement)
        return dense_method(self.placement, many_rows)
