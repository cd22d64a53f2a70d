"""The adapters the LoRA tests share: a tiny llama, four peft adapters of it, and peft's
greedy tokens for each."""

from __future__ import annotations

import pytest
import torch
from helpers.hf_reference import hf_greedy
from helpers.lora import ALL_MODULES, NEW_TOKENS, PROMPTS, make_adapter
from helpers.tiny_models import make_checkpoint

from pyengine import LoRARequest

pytest.importorskip("peft")


@pytest.fixture(scope="module")
def family(tmp_path_factory: pytest.TempPathFactory) -> dict[str, object]:
    """A tiny llama, six adapters of it (one of q/v only, one rsLoRA of rank 16, one of
    the embedding and the LM head with q, one of the head and down), and peft's greedy
    tokens for each."""
    root = tmp_path_factory.mktemp("lora")
    make_checkpoint("llama", root / "base")
    specs = {
        "a": (1, 8, ALL_MODULES, False),
        "b": (2, 4, ["q_proj", "v_proj"], False),
        "c": (3, 16, ALL_MODULES, True),
        "d": (4, 8, ["gate_proj", "down_proj"], False),
        "e": (5, 8, ["q_proj", "embed_tokens", "lm_head"], False),
        "f": (6, 4, ["lm_head", "down_proj"], False),
    }
    expected: dict[str, list[list[int]]] = {}
    peft_models: dict[str, torch.nn.Module] = {}
    requests: dict[str, LoRARequest] = {}
    for name, (seed, rank, modules, rslora) in specs.items():
        base = make_checkpoint("llama", root / "scratch")  # a fresh copy of the same weights
        model = make_adapter(base, root / name, seed, rank, modules, rslora).eval()
        expected[name] = [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
        peft_models[name] = model
        requests[name] = LoRARequest(name, seed, str(root / name))
    base = make_checkpoint("llama", root / "scratch").eval()
    expected["base"] = [hf_greedy(base, p, NEW_TOKENS) for p in PROMPTS]
    return {"root": root, "expected": expected, "requests": requests, "peft": peft_models}
