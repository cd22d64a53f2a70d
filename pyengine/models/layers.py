"""Pieces shared by the model files."""

from __future__ import annotations

import torch
from torch import nn


def parameter(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


def dense(x: torch.Tensor, weight_t: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [tokens, in] @ weight_t [in, out] (+ bias)."""
    return torch.mm(x, weight_t) if bias is None else torch.addmm(bias, x, weight_t)


def transpose_for_inference(model: nn.Module, names: list[str], tied_head: bool) -> None:
    """Stores each named [out, in] weight as [in, out]: the matmul of a decode step (a few
    rows) runs 1.2-1.7x faster on the CPU with the weight as the dense right operand.
    A head tied to the embeddings gets its own transposed copy."""
    with torch.no_grad():
        for name in names:
            p = model.get_parameter(name)
            p.data = p.data.t().contiguous()
        if tied_head:
            embeddings = model.get_parameter("embed_tokens")
            model.lm_head = nn.Parameter(embeddings.data.t().contiguous(), requires_grad=False)
        else:
            head = model.get_parameter("lm_head")
            head.data = head.data.t().contiguous()
