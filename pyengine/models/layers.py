"""Pieces shared by the model files."""

from __future__ import annotations

import torch

from torch import nn

def parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class DenseWeight:
    """A [out, in] weight prepared for x [tokens, in] -> [tokens, out] on the CPU: stored
    as [in, out], the dense right operand, with which a decode step's few rows multiply
    1.2-1.7x faster than through F.linear's transposed weight. (MKL's packed layout is
    faster still while the weights sit in cache, but slower when a step streams them all
    from memory, as decode does.)"""

    def __init__(self, weight: torch.Tensor) -> None:
        self.out_features, self.in_features = weight.shape
        self.transposed = weight.t().contiguous()

    def __call__(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if bias is None:
            return torch.mm(x, self.transposed)
        return torch.addmm(bias, x, self.transposed)


def prepare_dense(model: nn.Module, names: dict[str, str], tied_head: bool) -> int:
    """Replaces each named [out, in] parameter by a DenseWeight attribute (parameter name ->
    attribute name, on the same module), the head too (a head tied to the embeddings gets
    its own). Returns the model's number of parameters (a tied head counted once)."""
    count = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    with torch.no_grad():
        for name, attribute in names.items():
            owner_name, _, leaf = name.rpartition(".")
            owner = model.get_submodule(owner_name) if owner_name else model
            setattr(owner, attribute, DenseWeight(getattr(owner, leaf).data))
            delattr(owner, leaf)
        head = model.get_parameter("embed_tokens" if tied_head else "lm_head")
        model.head = DenseWeight(head.data)  # type: ignore[assignment]
        if not tied_head:
            del model.lm_head
    return count
