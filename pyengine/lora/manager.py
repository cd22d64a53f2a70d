"""The worker's adapters: max_loras slots in every adapted layer on the model's device,
and up to max_cpu_loras adapters read into host memory, each dropped least recently
used first. Before a step, every adapter the step's requests name is made resident (the
scheduler puts at most max_loras distinct ones in a step), evicting the least recently
used slot the step does not need, and each token row is told its slot. The embedding
and the LM head have their own rows' slots, -1 where a row's adapter leaves them out:
the embedding's the step's token rows, the head's the rows it scores
(select_logit_rows)."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import torch

from pyengine.config import LoRAConfig, ModelConfig
from pyengine.faults import RequestFault
from pyengine.lora.adapter import MODEL_LAYER, LoRAAdapter, load_adapter
from pyengine.lora.layers import LoRABatch, LoRAEmbeddingSlots, LoRASlots, _Part
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
        max_logit_rows: int,
    ) -> None:
        """max_tokens: the most token rows of a step (max_num_batched_tokens);
        max_logit_rows: the most the LM head scores at once (a step's logits rows)."""
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
        # (the first pipeline stage's embedding, the last's head)
        self.embedding: LoRAEmbeddingSlots | None = None
        self.embedding_batch = LoRABatch(max_tokens, device)
        embed_tokens = getattr(model, "embed_tokens", None)
        if embed_tokens is not None:
            self.embedding = LoRAEmbeddingSlots(
                model_config.vocab_size, model_config.hidden_size, self.embedding_batch,
                config.max_loras, config.max_lora_rank, embed_tokens.row_dtype, device,
            )  # fmt: skip
            embed_tokens.adapter = self.embedding
        self.head: LoRASlots | None = None
        self.head_batch = LoRABatch(max_logit_rows, device)
        lm_head = getattr(model, "lm_head", None)
        if lm_head is not None:
            rows = lm_head.output_size_per_partition
            part = _Part("lm_head", 0, rows, slice(lm_head.start, lm_head.start + rows))
            self.head = LoRASlots(
                MODEL_LAYER, [part], False, lm_head.input_size_per_partition, self.head_batch,
                config.max_loras, config.max_lora_rank, dtype, device,
            )  # fmt: skip
            lm_head.adapter = self.head
        self._head_slots = np.zeros(0, dtype=np.int64)  # each token row's, for the head
        self.host: OrderedDict[int, LoRAAdapter] = OrderedDict()  # least recently used first
        self.slots: list[int | None] = [None] * config.max_loras  # adapter id per slot
        self.slot_adapters: list[LoRAAdapter | None] = [None] * config.max_loras
        self.slot_used: list[int] = [0] * config.max_loras  # the step it last ran in
        self.steps = 0
        self.stats = LoRAStats()

    @property
    def replays_in_place(self) -> bool:
        """Whether every hook a recorded step runs is a kernel reading its rows' slots in
        place (the CPU's), so that recorded decode steps may hold adapters."""
        embedding = self.embedding is None or self.embedding.kernel
        return embedding and all(hook.kernel for hook in self.layers)

    def adapter(self, request: LoRARequest) -> LoRAAdapter:
        """`request`'s adapter, read from its folder unless held in host memory."""
        held = self.host.get(request.lora_int_id)
        if held is not None and held.request == request:
            self.host.move_to_end(request.lora_int_id)
            return held
        try:
            adapter = load_adapter(request, self.model_config, self.config.max_lora_rank)
        except (ValueError, OSError) as error:  # (checked when added: its files changed)
            raise RequestFault(str(error), lora_int_ids=(request.lora_int_id,)) from error
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
            for layer in self._hooks():
                layer.load(slot, adapter)
            self.slots[slot], self.slot_adapters[slot] = adapter_id, adapter
            slot_of[adapter_id] = slot
            self.stats.swapped_in += 1
            logger.debug("LoRA adapter %s into slot %d", adapter.request.lora_name, slot)
        for slot in slot_of.values():
            self.slot_used[slot] = self.steps
        row_slots = np.array([slot_of.get(int(a), -1) for a in adapter_ids], dtype=np.int64)
        token_slots = np.repeat(row_slots, np.diff(query_start_loc))
        self.batch.set_rows(token_slots)
        self.embedding_batch.set_rows(self._slots_adapting(token_slots, "embed_tokens"))
        self._head_slots = self._slots_adapting(token_slots, "lm_head")
        self.head_batch.clear()

    def select_logit_rows(self, token_rows: np.ndarray) -> None:
        """The LM head's next rows are these token rows of the step (int [rows])."""
        if self.head is not None:
            self.head_batch.set_rows(self._head_slots[token_rows])

    def _slots_adapting(self, token_slots: np.ndarray, module: str) -> np.ndarray:
        """token_slots, -1 where the slot's adapter has no delta of `module`."""
        adapts = [a is not None and a.adapts(module) for a in self.slot_adapters]
        keep = np.array([*adapts, False])  # (index -1: no adapter)
        return np.where(keep[token_slots], token_slots, -1)

    def _hooks(self) -> list[LoRASlots | LoRAEmbeddingSlots]:
        extra = [h for h in (self.embedding, self.head) if h is not None]
        return [*self.layers, *extra]
