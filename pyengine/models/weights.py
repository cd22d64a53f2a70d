"""WeightRouter: from checkpoint tensor names to the layers that load them.

A model lists where each checkpoint name goes (a linear layer's part, an embedding, a
plain parameter); the router then walks a checkpoint, hands each tensor to its loader
(which narrows it to the rank's shard), hands block-quantized forms to the layers that
keep them, and refuses what the model cannot hold: a tensor past the last layer, a tensor
of a linear layer that it has no place for, or a checkpoint that lacks one."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from pyengine.layers.block_quantized import BlockQuantized
from pyengine.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    check_shape,
    copy_checked,
)
from pyengine.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding
from pyengine.utils.lazy_weights import CheckpointTensor, LazyWeights, materialize

# A checkpoint name and tensor as the model's routes know them, or None: not a weight.
Normalize = Callable[[str, CheckpointTensor], "tuple[str, CheckpointTensor] | None"]


@dataclass
class _Route:
    load: Callable[[CheckpointTensor], None]
    # Where the receiver keeps a GGUF block form: it takes the blocks instead of `load`.
    blocks: Callable[[BlockQuantized], None] | None = None
    shape: tuple[int, ...] = ()  # of the whole checkpoint tensor (every rank's shards)


class WeightRouter:
    def __init__(
        self, num_layers: int, layer_prefix: str, layer_range: tuple[int, int] | None = None
    ) -> None:
        """`layer_range`: [start, end) of the layers this pipeline stage holds; the
        checkpoint's other layers are skipped (the other stages load them)."""
        self.num_layers, self.layer_prefix = num_layers, layer_prefix
        self.layer_range = layer_range or (0, num_layers)
        self._routes: dict[str, _Route] = {}
        self._ignored: set[str] = set()
        # Sets of routes of which a checkpoint holds one (the same weights in two forms).
        self._alternatives: list[tuple[frozenset[str], ...]] = []
        self._linear_modules: set[str] = set()  # checkpoint modules of linear layers

    def linear(
        self,
        name: str,
        layer: ColumnParallelLinear | RowParallelLinear,
        kind: str = "weight",
        part: int = 0,
    ) -> None:
        """Part `part` of `layer`'s weight or bias (kind)."""
        self._linear_modules.add(name.rpartition(".")[0])
        keeps_blocks = kind == "weight" and layer.method.keeps_blocks
        blocks = (lambda b: layer.load_part_blocks(b, part)) if keeps_blocks else None
        rows = layer.output_sizes[part] if isinstance(layer, ColumnParallelLinear) else None
        shape = _linear_shape(rows or layer.output_size, layer.input_size, kind)
        if kind not in ("weight", "bias"):
            shape = ()  # a quantized form's: no random weights of it
        self._routes[name] = _Route(
            lambda t: layer.weight_loader(name, kind, t, part), blocks, shape
        )

    def linear_weight(
        self,
        module: str,
        layer: ColumnParallelLinear | RowParallelLinear,
        part: int = 0,
    ) -> None:
        """Part `part` of `layer`'s weight, checkpoint module `module`: its `.weight`, or
        the tensors a quantized format stores instead (the method's weight_kinds)."""
        for kind in layer.method.weight_kinds:
            self.linear(f"{module}.{kind}", layer, kind, part)

    def fused(self, name: str, layer: ColumnParallelLinear, kind: str) -> None:
        """Every stacked part of a layer in one checkpoint tensor (q, k and v; gate and
        up)."""
        self._linear_modules.add(name.rpartition(".")[0])
        shape = _linear_shape(sum(layer.output_sizes), layer.input_size, kind)
        blocks = layer.load_fused_blocks if kind == "weight" and layer.method.keeps_blocks else None
        self._routes[name] = _Route(lambda t: layer.load_fused(name, kind, t), blocks, shape)

    def vocab(self, name: str, module: VocabParallelEmbedding | ParallelLMHead) -> None:
        if isinstance(module, ParallelLMHead):
            shape = (module.vocab_size, module.input_size)
        else:
            shape = (module.vocab_size, module.embedding_size)
        blocks = module.load_vocab_blocks if module.keeps_blocks else None
        self._routes[name] = _Route(lambda t: module.weight_loader(name, t), blocks, shape)

    def plain(self, name: str, parameter: torch.Tensor) -> None:
        """A replicated parameter (a norm's weight, learned positions)."""

        def load(tensor: CheckpointTensor) -> None:
            copy_checked(name, parameter.data, tensor)

        self._routes[name] = _Route(load, shape=tuple(parameter.shape))

    def plus_one(self, name: str, parameter: torch.Tensor) -> None:
        """A norm's weight w where the norm scales by 1 + w (Gemma's, Qwen3-Next's),
        loaded as 1 + w, so that the plain RMSNorm kernels run it."""

        def load(name: str, tensor: CheckpointTensor) -> None:
            copy_checked(name, parameter.data, materialize(tensor).float() + 1)

        self.tensor(name, tuple(parameter.shape), load)

    def scale(self, name: str, factor: float | torch.Tensor) -> None:
        """Multiplies the routed tensor `name` by `factor` (a number, or one a row) as it
        loads: a model's constant multipliers folded into its weights (Falcon-H1's)."""
        route = self._routes[name]
        if route.blocks is not None:
            raise ValueError(f"weight {name}: a multiplier folds into float weights only")
        load = route.load

        def scaled(tensor: CheckpointTensor) -> None:
            t = materialize(tensor)
            if isinstance(factor, torch.Tensor) and (t.dim() == 0 or len(t) != len(factor)):
                load(t)  # (the wrong shape: the loader's check names it)
                return
            by = factor if isinstance(factor, float) else factor.view(-1, *[1] * (t.dim() - 1))
            load((t.float() * by).to(t.dtype))

        route.load = scaled

    def sections(self, name: str, into: torch.Tensor, sections: list[tuple[int, int, int]]) -> None:
        """A tensor whose rows are sections, each split over the ranks (a short
        convolution's q, k and v channels): (whole rows, this rank's first, its count)
        of each, in order; `into` holds this rank's rows of every section."""
        shape = (sum(whole for whole, _, _ in sections), *into.shape[1:])

        def load(name: str, tensor: CheckpointTensor) -> None:
            tensor = materialize(tensor).reshape(shape)
            offset = local = 0
            for whole, start, count in sections:
                copy_checked(name, into.narrow(0, local, count),
                             tensor.narrow(0, offset + start, count))  # fmt: skip
                offset, local = offset + whole, local + count

        self._routes[name] = _Route(lambda t: load(name, t), shape=shape)

    def shard(self, name: str, into: torch.Tensor, dim: int, start: int, whole: int) -> None:
        """A rank's slice of a tensor it does not hold whole: entries [start, start +
        into.shape[dim]) along `dim`, of `whole` there (each expert's intermediate rows or
        columns, under tensor parallelism)."""
        shape = list(into.shape)
        shape[dim] = whole

        def load(name: str, tensor: CheckpointTensor) -> None:
            copy_checked(name, into, tensor.narrow(dim, start, into.shape[dim]))

        self.tensor(name, tuple(shape), load)

    def tensor(
        self,
        name: str,
        shape: tuple[int, ...],
        load: Callable[[str, CheckpointTensor], None],
        blocks: Callable[[BlockQuantized], None] | None = None,
    ) -> None:
        """A tensor of `shape` that `load` takes with its name (checked against the shape
        first); `blocks`: where the receiver keeps a GGUF block form, which takes the
        blocks instead (a stack of matrices as one: [n * rows, columns])."""

        def checked(tensor: CheckpointTensor) -> None:
            check_shape(name, tensor, shape)
            load(name, tensor)

        flat = (shape[0] * shape[1], shape[2]) if len(shape) == 3 else shape
        self._routes[name] = _Route(checked, blocks, flat if blocks else shape)

    def either(self, *forms: list[str]) -> None:
        """The checkpoint holds the routes of one of `forms` (the same weights in other
        tensors: an expert at a time, or all experts in one): the others are not missing.
        Random weights take the first form."""
        self._alternatives.append(tuple(frozenset(form) for form in forms))

    def scalar(self, name: str, into: torch.Tensor) -> None:
        """A one-value tensor (a per-tensor scale), stored as [] or [1], into `into` [1]."""

        def load(tensor: CheckpointTensor) -> None:
            if tuple(tensor.shape) not in ((), (1,)):
                raise ValueError(f"weight {name}: shape {tuple(tensor.shape)}, one value expected")
            into.copy_(materialize(tensor).reshape(1))

        self._routes[name] = _Route(load, shape=(1,))

    def shapes(self) -> dict[str, tuple[int, ...]]:
        """The whole shape of every checkpoint tensor the model loads (on this stage), in
        the first of each set of alternative forms."""
        others = {n for forms in self._alternatives for form in forms[1:] for n in form}
        others -= {n for forms in self._alternatives for n in forms[0]}
        return {name: route.shape for name, route in self._routes.items() if name not in others}

    def ignore(self, name: str) -> None:
        self._ignored.add(name)

    def load(
        self,
        weights: Mapping[str, CheckpointTensor],
        block_quantized: Mapping[str, BlockQuantized],
        normalize: Normalize | None = None,
    ) -> None:
        """Loads `weights` (block forms by the same names); raises ValueError naming the
        first tensor the model has no place for, or what the checkpoint lacks. Of
        LazyWeights that read regions, each loader reads only its shard."""
        if isinstance(weights, LazyWeights):
            weights = weights.sliced()
        loaded = set()
        for name in weights:
            # (a tensor is read only where its float form is loaded: a layer that takes
            # GGUF blocks never has its tensor dequantized, unless normalize must see it)
            key, value = name, None
            if normalize is not None:
                normalized = normalize(name, weights[name])
                if normalized is None:
                    continue
                key, value = normalized
            route = self._routes.get(key)
            if route is None:
                self._check_unrouted(name, key)
                continue
            if route.blocks is None:
                route.load(weights[name] if value is None else value)
            elif name in block_quantized:
                blocks = block_quantized[name]
                check_shape(name, blocks, route.shape)
                route.blocks(blocks)
            else:
                raise ValueError(f"weight {name}: its layer takes GGUF blocks, and it has none")
            loaded.add(key)
        unloaded = set(self._routes) - loaded
        for forms in self._alternatives:
            # The form the checkpoint holds (the most complete): the others' routes are
            # not missing.
            held = max(forms, key=lambda form: len(form & loaded))
            unloaded -= {n for form in forms if form is not held for n in form} - held
        missing = sorted(unloaded)
        if missing:
            raise ValueError(f"the checkpoint lacks {len(missing)} weights, e.g. {missing[:3]}")

    def _check_unrouted(self, name: str, key: str) -> None:
        """Tensors outside the layers that no route takes are not weights (rotary caches
        and the like); inside, they must name a layer the model has."""
        if key in self._ignored or not key.startswith(self.layer_prefix):
            return
        index = key[len(self.layer_prefix) :].partition(".")[0]
        if not index.isdigit() or int(index) >= self.num_layers:
            raise ValueError(
                f"weight {name}: the model has no such tensor (the model has layers 0 to "
                f"{self.num_layers - 1}: num_layers)"
            )
        if not self.layer_range[0] <= int(index) < self.layer_range[1]:
            return  # another pipeline stage's
        if key.rpartition(".")[0] in self._linear_modules:
            raise ValueError(
                f"weight {name}: this model has no such tensor (a bias the config does not "
                "declare, or a quantized checkpoint's scale)"
            )


def _linear_shape(rows: int, columns: int, kind: str) -> tuple[int, ...]:
    return (rows, columns) if kind == "weight" else (rows,)
