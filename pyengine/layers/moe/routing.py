"""How a mixture-of-experts layer chooses each token's experts and their weights, from
the router's logits, as each model family does it. A method is a registry entry
(ROUTING_METHODS), chosen by the checkpoint's config (routing_config): a new family's
routing is a function and a name here, not a branch in the layer.

- "softmax": softmax over all experts, the top k, renormalised over them or not
  (Mixtral and gpt-oss always; Qwen2/3-MoE, OLMoE by `norm_topk_prob`).
- "grouped_sigmoid": DeepSeek-V3's: sigmoid scores plus a correction bias choose the
  top `topk_group` groups (each group scored by its two best), then the top k experts
  within them; the weights are the scores without the bias, renormalised by
  `norm_topk_prob`, times `routed_scaling_factor`.
- "sigmoid_on_input": Llama 4's: the top k logits through a sigmoid, which scale each
  token's input to the expert (not its output).
- "grouped_softmax": DeepSeek-V2's: softmax over all experts; with groups
  (`group_limited_greedy`), only the top `topk_group` groups (each scored by its best)
  may give the top k; renormalised by `norm_topk_prob`, times `routed_scaling_factor`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from pyengine import ops


@dataclass(frozen=True)
class RoutingConfig:
    method: str
    top_k: int
    num_experts: int
    renormalize: bool = False
    num_groups: int = 1  # grouped_sigmoid: groups of experts, and how many a token takes
    topk_groups: int = 1
    scaling_factor: float = 1.0

    def __post_init__(self) -> None:
        if self.method not in ROUTING_METHODS:
            raise ValueError(
                f"routing method {self.method!r} is not one of {', '.join(ROUTING_METHODS)}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"top_k {self.top_k} must be in [1, num_experts] ({self.num_experts} experts)"
            )
        if self.num_groups < 1 or self.num_experts % self.num_groups:
            raise ValueError(
                f"{self.num_experts} experts do not split into {self.num_groups} groups"
            )
        per_group = self.num_experts // self.num_groups
        if (
            not 1 <= self.topk_groups <= self.num_groups
            or self.topk_groups * per_group < self.top_k
        ):
            raise ValueError(
                f"topk_group {self.topk_groups} of {self.num_groups} groups of {per_group} "
                f"experts cannot hold top_k {self.top_k}"
            )


@dataclass(frozen=True)
class Routing:
    """Each token's experts, [tokens, top_k] int64 (int32 from the kernels), and their
    weights, float32; with on_input, the weights scale the token's input to the expert
    instead of its output."""

    expert_ids: torch.Tensor
    weights: torch.Tensor
    on_input: bool = False


RoutingMethod = Callable[[torch.Tensor, RoutingConfig, "torch.Tensor | None"], Routing]


def softmax_topk(logits: torch.Tensor, config: RoutingConfig, bias: torch.Tensor | None) -> Routing:
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, config.top_k, dim=-1)
    if config.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return Routing(ids, weights)


def grouped_sigmoid_topk(
    logits: torch.Tensor, config: RoutingConfig, bias: torch.Tensor | None
) -> Routing:
    scores = logits.float().sigmoid()
    choice = scores if bias is None else scores + bias.float()
    tokens, per_group = scores.shape[0], config.num_experts // config.num_groups
    group_scores = choice.view(tokens, config.num_groups, per_group).topk(2, dim=-1)[0].sum(-1)
    groups = torch.topk(group_scores, config.topk_groups, dim=-1, sorted=False)[1]
    allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    allowed = allowed.unsqueeze(-1).expand(-1, -1, per_group).reshape(tokens, -1)
    ids = torch.topk(choice.masked_fill(~allowed, float("-inf")), config.top_k, dim=-1)[1]
    weights = scores.gather(1, ids)
    if config.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(ids, weights * config.scaling_factor)


def sigmoid_on_input(
    logits: torch.Tensor, config: RoutingConfig, bias: torch.Tensor | None
) -> Routing:
    values, ids = torch.topk(logits, config.top_k, dim=-1)
    return Routing(ids, torch.sigmoid(values.float()), on_input=True)


def grouped_softmax_topk(
    logits: torch.Tensor, config: RoutingConfig, bias: torch.Tensor | None
) -> Routing:
    scores = torch.softmax(logits.float(), dim=-1)
    if config.num_groups > 1:
        tokens, per_group = scores.shape[0], config.num_experts // config.num_groups
        group_scores = scores.view(tokens, config.num_groups, per_group).max(dim=-1).values
        groups = torch.topk(group_scores, config.topk_groups, dim=-1, sorted=False)[1]
        allowed = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
        allowed = allowed.unsqueeze(-1).expand(-1, -1, per_group).reshape(tokens, -1)
        scores = scores.masked_fill(~allowed, 0.0)
    weights, ids = torch.topk(scores, config.top_k, dim=-1)
    if config.renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routing(ids, weights * config.scaling_factor)


ROUTING_METHODS: dict[str, RoutingMethod] = {
    "softmax": softmax_topk,
    "grouped_softmax": grouped_softmax_topk,
    "grouped_sigmoid": grouped_sigmoid_topk,
    "sigmoid_on_input": sigmoid_on_input,
}


def _softmax_kernel(
    logits: torch.Tensor, config: RoutingConfig, bias: torch.Tensor | None
) -> Routing:
    ids, weights = _outputs(logits, config)
    ops.moe_softmax_topk(ids, weights, logits, config.renormalize)
    return Routing(ids, weights)


def _grouped_sigmoid_kernel(
    logits: torch.Tensor, config: RoutingConfig, bias: torch.Tensor | None
) -> Routing:
    ids, weights = _outputs(logits, config)
    ops.moe_grouped_topk(ids, weights, logits, None if bias is None else bias.float(),
                         config.num_groups, config.topk_groups, config.renormalize,
                         config.scaling_factor)  # fmt: skip
    return Routing(ids, weights)


def _sigmoid_on_input_kernel(
    logits: torch.Tensor, config: RoutingConfig, bias: torch.Tensor | None
) -> Routing:
    ids, weights = _outputs(logits, config)
    ops.moe_sigmoid_topk(ids, weights, logits)
    return Routing(ids, weights, on_input=True)


def _outputs(logits: torch.Tensor, config: RoutingConfig) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, device = logits.shape[0], logits.device
    ids = torch.empty(tokens, config.top_k, dtype=torch.int32, device=device)
    return ids, torch.empty(tokens, config.top_k, dtype=torch.float32, device=device)


# The same methods by pyengine's CPU kernels (float32 or bfloat16 logits), which a
# recorded decode step holds; the results are the functions' above (to float32's
# rounding of the sigmoid).
ROUTING_KERNELS: dict[str, RoutingMethod] = {
    "softmax": _softmax_kernel,
    "grouped_sigmoid": _grouped_sigmoid_kernel,
    "sigmoid_on_input": _sigmoid_on_input_kernel,
}
# Those whose kernel also runs on CUDA tensors (float32, float16 or bfloat16 logits).
CUDA_ROUTING_KERNELS = frozenset({"softmax"})


def kernel_route(
    logits: torch.Tensor, config: RoutingConfig, bias: torch.Tensor | None = None
) -> Routing:
    """route()'s result by the method's kernel where it has one for these logits (CPU
    float32 or bfloat16; on CUDA, CUDA_ROUTING_KERNELS'), else by route(); the kernels
    give int32 ids."""
    kernel = ROUTING_KERNELS.get(config.method)
    on_cpu = logits.is_cpu and logits.dtype in (torch.float32, torch.bfloat16)
    on_cuda = logits.is_cuda and config.method in CUDA_ROUTING_KERNELS
    if kernel is None or not (on_cpu or on_cuda):
        return route(logits, config, bias)
    return kernel(logits, config, bias)


def route(logits: torch.Tensor, config: RoutingConfig, bias: torch.Tensor | None = None) -> Routing:
    """The tokens' experts and weights from the router's logits [tokens, num_experts]
    (bias: grouped_sigmoid's correction bias, [num_experts])."""
    if logits.dim() != 2 or logits.shape[1] != config.num_experts:
        raise ValueError(
            f"router logits must be [tokens, {config.num_experts}], got {list(logits.shape)}"
        )
    return ROUTING_METHODS[config.method](logits, config, bias)


def routing_config(hf: Any) -> RoutingConfig:
    """The routing a Hugging Face config describes (its architecture's family, by the
    fields it has); ValueError where it names none."""
    architectures = getattr(hf, "architectures", None) or []
    name = " ".join(architectures) + " " + str(getattr(hf, "model_type", ""))
    top_k = int(hf.num_experts_per_tok)
    if "Llama4" in name or "llama4" in name:
        return RoutingConfig("sigmoid_on_input", top_k, int(hf.num_local_experts))
    if "GptOss" in name or "gpt_oss" in name:  # (a softmax of its top k's logits: the same)
        return RoutingConfig("softmax", top_k, int(hf.num_local_experts), renormalize=True)
    if getattr(hf, "n_group", None) is not None and getattr(hf, "topk_group", None) is not None:
        return RoutingConfig(
            "grouped_sigmoid", top_k, int(hf.n_routed_experts),
            renormalize=bool(getattr(hf, "norm_topk_prob", True)),
            num_groups=int(hf.n_group), topk_groups=int(hf.topk_group),
            scaling_factor=float(getattr(hf, "routed_scaling_factor", 1.0)),
        )  # fmt: skip
    experts = getattr(hf, "num_local_experts", None) or getattr(hf, "num_experts", None)
    if experts is None:
        raise ValueError(f"the config of {name.strip()!r} names no experts")
    # Mixtral renormalises always (its config has no norm_topk_prob).
    renormalize = bool(getattr(hf, "norm_topk_prob", "Mixtral" in name or "mixtral" in name))
    return RoutingConfig("softmax", top_k, int(experts), renormalize=renormalize)
