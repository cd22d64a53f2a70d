"""The worker's adapters: max_loras slots in every adapted layer on the model's device,
and up to max_cpu_loras adapters read into host memory, each dropped least recently
used first. Before a step, every adapter the step's requests name is made resident (the
scheduler puts at most max_loras distinct ones in a step), evicting the least recently
used slot the step does not need, and each token row is told its slot."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from pyengine.config import LoRAConfig, ModelConfig
from pyengine.lora.adapter import LoRAAdapter, load_adapter
from pyengine.lora.layers import LoRABatch, LoRASlots, _Part
from pyengine.lora.request import LoRARequest

logger = logging.getLogger("pyengine")


@dataclass
class LoRAStats:
    loaded: int = 0  # adapters read from their folders
    swapped_in: int = 0  # adapters written into a device slot
    evicted: int = 0  # from host memory (max_cpu_loras)


def _column_parts(layer: object, modules: list[str]) -> list[_Part]:
    offsets = layer.local_offsets  # type: ignore[attr-defined]
    shards = layer.shard_offsets  # type: ignore[attr-defined]
    return [
        _Part(module, offset, length, slice(start, start + length))
        for module, offset, (start, length) in zip(modules, offsets, shards, strict=True)
    ]


def _row_part(layer: object, module: str) -> _Part:
    start = layer.input_start  # type: ignore[attr-defined]
    local = layer.input_size_per_partition  # type: ignore[attr-defined]
    return _Part(module, 0, layer.output_size_per_partition, slice(start, start + local))  # type: ignore[attr-defined]


class LoRAManager:
    def __init__(
        self,
        model: object,
        config: LoRAConfig,
        model_config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        max_tokens: int,
    ) -> None:
        """max_tokens: the most token rows of a step (max_num_batched_tokens)."""
        self.config, self.model_config = config, model_config
        self.batch = LoRABatch(max_tokens, device)
        self.layers: list[LoRASlots] = []
        # (a pipeline stage's other layers are placeholders: indices stay the model's)
        decoders = [
            (i, m) for i, m in enumerate(getattr(model, "layers", [])) if hasattr(m, "self_attn")
        ]
        if not decoders or not all(
            hasattr(m.self_attn, "qkv_proj") and hasattr(m.mlp, "gate_up_proj") for _, m in decoders
        ):
            raise ValueError(
                f"enable_lora: {model_config.architecture} has no llama-style projections "
                "(q/k/v/o, gate/up/down) to adapt"
            )
        for index, decoder in decoders:
            attn, mlp = decoder.self_attn, decoder.mlp
            qkv, gate_up = attn.qkv_proj, mlp.gate_up_proj
            hooks = (
                (qkv, _column_parts(qkv, ["q_proj", "k_proj", "v_proj"]), False),
                (attn.o_proj, [_row_part(attn.o_proj, "o_proj")], True),
                (gate_up, _column_parts(gate_up, ["gate_proj", "up_proj"]), False),
                (mlp.down_proj, [_row_part(mlp.down_proj, "down_proj")], True),
            )
            for layer, parts, row in hooks:
                slots = LoRASlots(
                    index, parts, row, layer.input_size_per_partition, self.batch,
                    config.max_loras, config.max_lora_rank, dtype, device,
                )  # fmt: skip
                layer.adapter = slots
                self.layers.append(slots)
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slots: list[int | None] = [None] * config.max_loras  # adapter id per slot
        self.slot_used: list[int] = [0] * config.max_loras  # the step it last ran in
        self.steps = 0
        self.stats = LoRAStats()

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """`request`'s adapter, read from its folder unless held in host memory."""
        held = self.host.get(request.lora_int_id)
        if held is not None and held.request == request:
            self.host.move_to_end(request.lora_int_id)
            return held
        adapter = load_adapter(request, self.model_config, self.config.max_lora_rank)
        self.stats.loaded += 1
        logger.info(
            "LoRA adapter %s (id %d): rank %d, %d projections, %.1f MiB, from %s",
            request.lora_name, request.lora_int_id, adapter.rank, len(adapter.weights),
            adapter.nbytes / 2**20, request.lora_path,
        )  # fmt: skip
        self.host[request.lora_int_id] = adapter
        while len(self.host) > self.config.host_capacity:
            self.host.popitem(last=False)
            self.stats.evicted += 1
        return adapter

    def prepare(
        self,
        adapter_ids: np.ndarray,
        requests: dict[int, LoRARequest],
        query_start_loc: np.ndarray,
    ) -> None:
        """Makes the step's adapters resident and tells each token row its slot.
        adapter_ids: int [num_reqs], each request's adapter (0: none); requests: the
        step's adapters by id."""
        self.steps += 1
        needed = [int(a) for a in np.unique(adapter_ids) if a != 0]
        if len(needed) > len(self.slots):
            raise ValueError(f"a step names {len(needed)} adapters; max_loras is {len(self.slots)}")
        slot_of: dict[int, int] = {}
        for adapter_id in needed:
            if adapter_id in self.slots:
                slot_of[adapter_id] = self.slots.index(adapter_id)
        for adapter_id in needed:
            if adapter_id in slot_of:
                continue
            adapter = self.adapter(requests[adapter_id])
            free = [s for s in range(len(self.slots)) if s not in slot_of.values()]
            slot = min(free, key=lambda s: (self.slots[s] is not None, self.slot_used[s]))
            for layer in self.layers:
                layer.load(slot, adapter)
            self.slots[slot] = adapter_id
            slot_of[adapter_id] = slot
            self.stats.swapped_in += 1
            logger.debug("LoRA adapter %s into slot %d", adapter.request.lora_name, slot)
        for slot in slot_of.values():
            self.slot_used[slot] = self.steps
        row_slots = np.array([slot_of.get(int(a), -1) for a in adapter_ids], dtype=np.int64)
        token_slots = np.repeat(row_slots, np.diff(query_start_loc))
        self.batch.set_rows(token_slots)
