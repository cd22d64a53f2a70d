"""What the tests of hybrid models' GGUF files share: a transformers model's tensors
written as llama.cpp's conversion writes them (matrices in Q8_0 blocks, the model then
holding their dequantized values), and a Mamba-2 layer's tensors with the changes its
conversion makes (A as -exp(A_log) [heads, 1], D as [heads, 1], the convolution
squeezed, the norm's weight per group)."""

from __future__ import annotations

from typing import Any

import torch

from helpers.gguf_writing import add_q8_0


class TensorWriter:
    """A GGUF writer's tensors from a transformers model's parameters."""

    def __init__(self, writer: Any, model: torch.nn.Module) -> None:
        self.writer = writer
        self.params = dict(model.named_parameters())

    def floats(self, name: str, values: torch.Tensor) -> None:
        self.writer.add_tensor(name, values.detach().float().contiguous().numpy().copy())

    def matrix(self, name: str, hf_name: str) -> None:
        """A parameter in Q8_0 blocks (the parameter then holding their values)."""
        add_q8_0(self.writer, name, self.params[hf_name])

    def blocks(self, name: str, view: torch.Tensor) -> None:
        """A view of a parameter in Q8_0 blocks (the view then holding their values)."""
        add_q8_0(self.writer, name, view)

    def experts(self, i: int, module: str) -> None:
        """Layer i's experts as transformers holds them (gate_up_proj [experts, 2 * size,
        hidden], the gate's rows first; down_proj) in a tensor per part, with their
        router (float32, as llama.cpp keeps it)."""
        gate_up = self.params[f"{module}.experts.gate_up_proj"]
        size = gate_up.shape[1] // 2
        self.blocks(f"blk.{i}.ffn_gate_exps.weight", gate_up[:, :size])
        self.blocks(f"blk.{i}.ffn_up_exps.weight", gate_up[:, size:])
        self.blocks(f"blk.{i}.ffn_down_exps.weight", self.params[f"{module}.experts.down_proj"])
        self.param(f"blk.{i}.ffn_gate_inp.weight", f"{module}.gate.weight")

    def param(self, name: str, hf_name: str) -> None:
        self.floats(name, self.params[hf_name])

    def mamba_layer(self, i: int, module: str, groups: int, projections: bool = True) -> None:
        """Layer i's Mamba-2 mixer under `module` (its biases where the model has them;
        its input and output projections unless the caller writes them)."""
        p = self.params
        if projections:
            self.matrix(f"blk.{i}.ssm_in.weight", f"{module}.in_proj.weight")
            self.matrix(f"blk.{i}.ssm_out.weight", f"{module}.out_proj.weight")
        self.floats(f"blk.{i}.ssm_conv1d.weight", p[f"{module}.conv1d.weight"].squeeze(1))
        if f"{module}.conv1d.bias" in p:
            self.param(f"blk.{i}.ssm_conv1d.bias", f"{module}.conv1d.bias")
        self.param(f"blk.{i}.ssm_dt.bias", f"{module}.dt_bias")
        with torch.no_grad():
            self.floats(f"blk.{i}.ssm_a", -torch.exp(p[f"{module}.A_log"].float())[:, None])
        self.floats(f"blk.{i}.ssm_d", p[f"{module}.D"][:, None])
        if f"{module}.norm.weight" in p:
            self.floats(f"blk.{i}.ssm_norm.weight", p[f"{module}.norm.weight"].view(groups, -1))
