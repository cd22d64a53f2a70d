"""Runs the model on one scheduled step: the step's flat buffers in, the logits of the
rows that sample out. Owns the model and its paged KV cache."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch

from pyengine import _C, ops
from pyengine.config import CACHE_STORAGE, INT8_SCALE_BYTES, EngineConfig
from pyengine.distributed import IntermediateTensors, PipelineStage, TensorParallelGroup
from pyengine.layers.attention import AttentionMetadata, KVCache
from pyengine.layers.linear import LayerContext
from pyengine.layers.moe.layer import FusedMoE
from pyengine.layers.placement import Placement
from pyengine.layers.pooler import Pooler
from pyengine.loader.model_loader import build_model
from pyengine.loader.resolve import LoadedModel
from pyengine.lora.manager import LoRAManager
from pyengine.sample.sampler import Sampler, heaviest_rows
from pyengine.step_values import SchedulerOutput
from pyengine.utils import host_memory
from pyengine.utils.host_memory import huge_page_tensor
from pyengine.worker.cpu_graphs import KernelGraphs, cpu_capture_sizes, record_decode_steps
from pyengine.worker.cuda_graphs import MAX_SPLIT_CONTEXT, DecodeGraphs, capture_sizes
from pyengine.worker.host_kv_tier import HostKVTier
from pyengine.worker.kv_layout import assign_kv_groups, plan_kv_layout
from pyengine.worker.state_pool import (
    allocate_states,
    copy_states,
    slot_bytes,
    slots_within,
    state_layers,
)
from pyengine.worker.step_inputs import DeviceStep, StepInputs

logger = logging.getLogger("pyengine")

# The cache of a layer that does not attend (a recurrent one): no pages.
NO_PAGES: KVCache = (torch.empty(0), torch.empty(0))


def resident_bytes(model: Any) -> int:
    """Bytes the model's weights hold: its parameters and buffers, and the forms its
    layers' methods made (held_tensors; each tensor once)."""
    tensors = list(model.parameters()) + list(model.buffers())
    for module in model.modules():
        held = getattr(module, "held_tensors", None)
        if callable(held):
            tensors += held()
    unique = {id(t): t for t in tensors}.values()
    return sum(t.numel() * t.element_size() for t in unique)


def expert_bytes(model: Any) -> int:
    """Bytes of its mixture-of-experts layers' weights (part of resident_bytes)."""
    return sum(resident_bytes(m) for m in model.modules() if isinstance(m, FusedMoE))


def weight_forms(model: Any) -> str:
    """How many layers (linear and mixture-of-experts) hold each form: "210 4-bit blocks,
    1 8-bit blocks"."""
    forms: dict[str, int] = {}
    for module in model.modules():
        describe = getattr(module, "weight_form", None)
        if not callable(describe):
            continue  # not a linear layer
        form = describe()
        if form is not None:
            forms[form] = forms.get(form, 0) + 1
    return ", ".join(f"{count} {form}" for form, count in forms.items()) or "no linear layers"


def allocate_kv_pool(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The KV cache's memory, zero-filled. On a GPU, one allocation. On the CPU, on
    transparent huge pages where the OS offers them (host_memory): attention reads 4 KB
    tiles from wherever their blocks lie in the pool, and with 2 MB pages those reads stop
    missing the TLB (it shows once the blocks of running requests are scattered). Pages
    are committed as blocks are first written, 2 MB at a time."""
    if device.type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    return huge_page_tensor(numel, dtype)


def kv_block_numel(
    num_layers: int, num_kv_heads: int, head_size: int, block_size: int, halves: int = 2
) -> int:
    """Elements of one KV block: the K and V of every layer, block_size tokens each (one
    half, a latent vector a token, for latent attention)."""
    return halves * num_layers * num_kv_heads * head_size * block_size


def allocate_caches(
    num_blocks: int,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    halves: int = 2,
) -> list[KVCache]:
    """Per layer, views of one new pool (allocate_kv_pool), as kv_views lays them out."""
    numel = kv_block_numel(num_layers, num_kv_heads, head_size, block_size, halves) * num_blocks
    pool = allocate_kv_pool(numel, dtype, device)
    return kv_views(pool, num_blocks, num_layers, num_kv_heads, head_size, block_size, halves)


def kv_views(
    pool: torch.Tensor,
    num_blocks: int,
    num_layers: int,
    num_kv_heads: int,
    head_size: int,
    block_size: int,
    halves: int = 2,
) -> list[KVCache]:
    """Per layer, views of `pool`: keys [blocks, kv_heads, head, block] (transposed),
    values [blocks, kv_heads, block, head] (an int8 cache's head dims longer by the
    scales: head_size counts them); with one half, latent attention's cache, [blocks,
    block, head] as both."""
    if halves == 1:
        latents = pool.view(num_layers, -1)
        views = [latents[i].view(num_blocks, block_size, head_size) for i in range(num_layers)]
        return [(latent, latent) for latent in views]
    halves_of = pool.view(num_layers, 2, -1)
    shape = (num_blocks, num_kv_heads)
    return [
        (
            halves_of[i, 0].view(*shape, head_size, block_size),
            halves_of[i, 1].view(*shape, block_size, head_size),
        )
        for i in range(num_layers)
    ]


class ModelRunner:
    """Built in two steps: __init__ makes the model and measures how many KV blocks its
    memory holds (num_blocks); initialize_cache allocates the number the executor
    settles on (the least over the ranks), split between the virtual engines."""

    def __init__(
        self,
        loaded: LoadedModel,
        config: EngineConfig,
        tp: TensorParallelGroup | None = None,
        pp: PipelineStage | None = None,
    ) -> None:
        c = loaded.config
        head_sizes = _C.attention_head_sizes()
        # Latent attention (DeepSeek's MLA) caches one vector a token and layer, whole on
        # every rank; its kernel takes any size.
        latent = c.family.latent_cache_dim()
        # The model's KV-cache groups (a model that never attends has no pages, and no
        # heads for paged attention to run).
        self.kv_layout = plan_kv_layout(c.kv_specs())
        # (refused now, not at the first request)
        if self.kv_layout.num_slots and not latent and c.head_size not in head_sizes:
            raise ValueError(
                f"the model's attention head size {c.head_size} is not one paged attention "
                f"runs ({', '.join(map(str, head_sizes))})"
            )
        self.placement = Placement(torch.device(config.device), getattr(torch, config.dtype))
        self.block_size = config.block_size
        self.tp = tp or TensorParallelGroup()
        self.pp = pp or PipelineStage()
        # This rank's share of the kv heads and of the layers: its cache holds only those.
        self.num_kv_heads = 1 if latent else self.tp.kv_head_shard(c.num_kv_heads)[1]
        start, end = self.pp.layer_range(c.num_layers)
        self.num_layers = end - start
        # The page slots of a block this stage's layers write (one a layer where the
        # model has one attention kind).
        self.layers = range(start, end)
        self.kv_slots = self.kv_layout.slots_of(self.layers)
        self.cache_dtype = getattr(torch, CACHE_STORAGE.get(config.cache_dtype, config.cache_dtype))
        latent_dtypes = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)
        if latent and self.cache_dtype == torch.uint8 and self.placement.device.type != "cpu":
            raise ValueError("kv_cache_dtype fp8: latent attention's fp8 cache runs on the CPU")
        if latent and self.cache_dtype not in latent_dtypes:
            raise ValueError(
                f"kv_cache_dtype {config.cache_dtype}: latent attention's cache is float32, "
                "float16, bfloat16 or fp8 (e4m3)"
            )
        # An int8 cache's head dims hold each token's scale too.
        self.cache_head_size = latent or c.head_size + (
            INT8_SCALE_BYTES if self.cache_dtype == torch.int8 else 0
        )
        self.kv_halves = 1 if latent else 2
        self.block_numel = kv_block_numel(
            len(self.kv_slots), self.num_kv_heads, self.cache_head_size, config.block_size,
            self.kv_halves,
        )  # fmt: skip
        self.block_bytes = self.block_numel * int(self.cache_dtype.itemsize)
        max_blocks = -(-config.max_model_len // config.block_size)  # a block table's
        min_blocks = self.kv_layout.max_blocks_held(
            config.max_model_len, config.max_num_batched_tokens, config.block_size
        )
        on_cpu = self.placement.device.type == "cpu"
        # (a model of recurrent layers alone has blocks that hold nothing)
        cpu_blocks = config.kv_cache_memory // max(self.block_bytes, 1)
        if on_cpu and cpu_blocks < min_blocks:
            raise ValueError(
                f"kv_cache_memory ({config.kv_cache_memory} bytes) holds "
                f"{cpu_blocks} blocks of {config.block_size} tokens; "
                f"one max_model_len request needs {min_blocks} (at least "
                f"{min_blocks * self.block_bytes} bytes, or lower max_model_len)"
            )
        self.model = build_model(
            loaded, config.max_model_len, config.seed,
            LayerContext(self.placement, self.tp, self.pp,
                         quantized_activations=config.quantized_activations,
                         adapters=config.lora is not None,
                         expert_parallel=config.parallel.enable_expert_parallel,
                         prompts_only=config.pooler is not None),
        )  # fmt: skip
        assign_kv_groups(self.model, self.kv_layout, self.layers)
        # A hybrid model's recurrent layers keep their states in slots of their own.
        self.state_layers = state_layers(self.model)
        recurrent = len(set(c.state_layers()) & set(self.layers))
        if len(self.state_layers) != recurrent:
            raise ValueError(
                f"the model has {len(self.state_layers)} recurrent layers where its config "
                f"names {recurrent}"
            )
        for index, layer in enumerate(self.state_layers):
            layer.state_index = index
        if self.state_layers and not on_cpu:
            raise ValueError(
                f"{c.architecture} has recurrent-state layers, which run on the CPU only "
                "(their CUDA kernels have not run on a GPU yet)"
            )
        # The pooling runner's: one vector per finished prompt instead of logits.
        self.pooler = None if config.pooler is None else Pooler(self.model, config.pooler)
        self.lora: LoRAManager | None = None
        # The most logits rows of a step: one a request, and one a draft token.
        spec = config.speculative
        max_logit_rows = config.max_num_seqs * (1 + (spec.num_speculative_tokens if spec else 0))
        if config.lora is not None:
            self.lora = LoRAManager(
                self.model, config.lora, c, self.placement.dtype, self.placement.device,
                config.max_num_batched_tokens, max_logit_rows,
            )  # fmt: skip
        self.min_blocks = min_blocks
        self.weight_bytes = resident_bytes(self.model)
        if on_cpu:
            host_memory.release_free_heap()  # what loading freed
        q = c.quantization
        experts = expert_bytes(self.model)
        logger.info(
            "weights: %s, %.1f MiB resident (%s)%s",
            q.describe() if q else str(self.placement.dtype).removeprefix("torch."),
            self.weight_bytes / 2**20,
            weight_forms(self.model),
            f", of which {experts / 2**20:.1f} MiB the experts'" if experts else "",
        )
        # The step's inputs in one copy, which the decode graphs read in place (CUDA
        # graphs on a GPU, recorded kernel calls on the CPU); without graphs on the CPU,
        # the scheduler's buffers themselves.
        self.inputs: StepInputs | None = None
        self.capture_sizes: list[int] = []
        self.graph_bytes_expected = 0  # what the KV budget leaves the graphs
        # Captured for one rank alone: collectives and stage transfers run eagerly; so do
        # adapters but through ops.lora_add on the CPU (a recorded step's call reads each
        # row's slot in place, as it reads the step inputs).
        adapters_replay = self.lora is None or (on_cpu and self.lora.replays_in_place)
        # (latent attention writes its cache and projects its heads with torch operations)
        # (and recurrent layers with torch operations between their kernels)
        # (and a pooling runner's steps, which are all prompts)
        eager = (config.enforce_eager or self.tp.world_size > 1 or self.pp.world_size > 1
                 or not adapters_replay or latent > 0 or bool(self.state_layers)
                 or self.pooler is not None)  # fmt: skip
        # On the CPU, steps that verify drafts replay too: up to 1 + k tokens a request.
        self.max_query_len = 1 + spec.num_speculative_tokens if spec and on_cpu else 1
        if not eager:
            if on_cpu:
                verify_tokens = 0 if spec is None else min(
                    config.max_num_batched_tokens,
                    spec.drafting_batch_size(config.max_num_seqs, "cpu") * self.max_query_len,
                )  # fmt: skip
                self.capture_sizes = cpu_capture_sizes(config.max_num_seqs, verify_tokens)
            else:
                self.capture_sizes = capture_sizes(config.max_num_seqs)
        if not on_cpu or not eager:
            # (a program of n tokens has n request rows)
            rows = max(config.max_num_seqs, *self.capture_sizes, 1)
            self.inputs = StepInputs(
                self.placement.device, config.max_num_batched_tokens, rows, max_blocks,
                max_logit_rows, len(self.kv_layout.groups),
            )  # fmt: skip
        self.split_context = min(config.max_model_len, MAX_SPLIT_CONTEXT)
        kv_bytes = config.kv_cache_memory if on_cpu else self._gpu_kv_cache_bytes(config)
        # The recurrent states: a slot per request each scheduler may run (fewer where
        # they would take more than half the budget), out of the KV cache's budget.
        # With prefix caching, as many checkpoints as slots beside them (hits resume
        # states from these); with speculative decoding, a snapshot of each slot after
        # them (a verifying step's state from before it, put back where a draft was
        # rejected).
        engines = config.parallel.pipeline_parallel_size
        checkpoints, snapshots = config.enable_prefix_caching, config.speculative is not None
        per_request = 1 + checkpoints + snapshots
        self.num_state_slots = slots_within(
            self.state_layers, config.max_num_seqs, kv_bytes // per_request
        )
        self.num_state_checkpoints = self.num_state_slots * checkpoints
        self.num_state_snapshots = self.num_state_slots * snapshots
        total = self.num_state_slots + self.num_state_checkpoints + self.num_state_snapshots
        self.state_bytes = total * slot_bytes(self.state_layers) * engines
        kv_bytes -= self.state_bytes
        if self.num_state_slots:
            logger.info(
                "recurrent states: %d slots of %.2f MiB (%d layers), %d checkpoints, "
                "%d snapshots", self.num_state_slots, slot_bytes(self.state_layers) / 2**20,
                len(self.state_layers), self.num_state_checkpoints, self.num_state_snapshots,
            )  # fmt: skip
        if self.block_bytes:
            self.num_blocks = kv_bytes // self.block_bytes
        else:  # (blocks that hold nothing: as many as every request could fill)
            self.num_blocks = min_blocks * config.max_num_seqs
        if self.num_blocks < min_blocks and on_cpu:  # (the recurrent states took the rest)
            raise ValueError(
                f"kv_cache_memory ({config.kv_cache_memory} bytes) less the recurrent states "
                f"of {self.num_state_slots} requests ({self.state_bytes} bytes) holds "
                f"{self.num_blocks} blocks of {config.block_size} tokens; one max_model_len "
                f"request needs {min_blocks} (raise kv_cache_memory, or lower max_model_len "
                "or max_num_seqs)"
            )
        if self.num_blocks < min_blocks:
            raise ValueError(
                f"gpu_memory_utilization {config.gpu_memory_utilization} leaves "
                f"{max(kv_bytes, 0)} bytes for the KV cache after the weights, a forward "
                f"pass and the CUDA graphs: {self.num_blocks} blocks of {config.block_size} "
                f"tokens, and one max_model_len request needs {min_blocks} (raise "
                "gpu_memory_utilization, or lower max_model_len, max_num_batched_tokens or "
                "max_num_seqs)"
            )
        self.caches_by_virtual_engine: list[list[KVCache]] = []
        self.graphs: DecodeGraphs | KernelGraphs | None = None
        # The host tier (kv_offload_gb): its blocks, allocated by initialize_cache (none
        # where no layer attends: nothing to offload).
        block = self.block_bytes
        self.num_host_blocks = config.kv_offload_bytes // block if block else 0
        if block and config.kv_offload_bytes and self.num_host_blocks == 0:
            raise ValueError(
                f"kv_offload_gb ({config.kv_offload_bytes} bytes) holds no KV block of "
                f"{self.block_bytes} bytes"
            )
        self.kv_offload_dir = config.kv_offload_dir
        self.host_tier: HostKVTier | None = None

    def share_kv_budget(self, draft_block_bytes: int, draft_weight_bytes: int) -> None:
        """Leaves a draft model room in the KV cache's budget: its weights where they
        took device memory after the budget was measured, and a block of its own cache
        beside each of this runner's (the draft's cache has the same blocks)."""
        budget = max(0, self.num_blocks * self.block_bytes - draft_weight_bytes)
        self.num_blocks = budget // (self.block_bytes + draft_block_bytes)
        if self.num_blocks < self.min_blocks:
            raise ValueError(
                f"the KV cache's budget ({budget} bytes after the draft model's weights), "
                f"shared with the draft model's cache, holds {self.num_blocks} blocks of "
                f"{self.block_size} tokens; one max_model_len request needs "
                f"{self.min_blocks} (raise kv_cache_memory or gpu_memory_utilization, or "
                "lower max_model_len)"
            )

    @property
    def caches(self) -> list[KVCache]:
        """The KV cache of the first virtual engine (of the only one without a pipeline)."""
        return self.caches_by_virtual_engine[0]

    @property
    def pages(self) -> list[KVCache]:
        """The first virtual engine's cache a page slot at a time (caches, a layer at a
        time, repeats a slot's pages for each group that writes it)."""
        return self.pages_by_virtual_engine[0]

    def initialize_cache(
        self, num_blocks: int, num_virtual_engines: int = 1, num_host_blocks: int = 0
    ) -> None:
        """Allocates `num_blocks` blocks (at most num_blocks), an equal range of them for
        each virtual engine, and the host tier's num_host_blocks (at most
        num_host_blocks), then captures the CUDA graphs in what the budget left."""
        if not 0 <= num_host_blocks <= self.num_host_blocks:
            raise ValueError(
                f"{num_host_blocks} host KV blocks asked for; this rank holds "
                f"{self.num_host_blocks}"
            )
        if not 1 <= num_blocks <= self.num_blocks:
            raise ValueError(f"{num_blocks} KV blocks asked for; this rank holds {self.num_blocks}")
        per_engine = num_blocks // num_virtual_engines
        if per_engine < self.min_blocks:
            raise ValueError(
                f"{num_blocks} KV blocks shared by {num_virtual_engines} pipeline steps in "
                f"flight leave {per_engine} each, and one max_model_len request needs "
                f"{self.min_blocks} (more KV cache memory, or a lower max_model_len)"
            )
        self.num_blocks = num_blocks
        flat = allocate_kv_pool(
            self.block_numel * num_blocks, self.cache_dtype, self.placement.device
        )
        pages = kv_views(
            flat, num_blocks, len(self.kv_slots), self.num_kv_heads, self.cache_head_size,
            self.block_size, self.kv_halves,
        ) if self.kv_slots else []  # fmt: skip
        self.host_tier = None
        if num_host_blocks > 0:
            self.host_tier = HostKVTier(
                num_host_blocks, len(self.kv_slots), self.block_bytes, self.placement.device,
                self.kv_offload_dir, self.kv_halves,
            )  # fmt: skip
            # The pool's bytes laid out as the tier's (layer, K or V, block, the rest): it
            # copies a block of every layer at once.
            self.kv_pool_blocks = flat.view(torch.uint8).view(
                *self.host_tier.blocks.shape[:2], num_blocks, -1
            )
        # Each virtual engine's range of blocks, a page slot at a time (what block copies
        # run on), and as each layer reads them.
        self.pages_by_virtual_engine = [
            [(k[i * per_engine : (i + 1) * per_engine], v[i * per_engine : (i + 1) * per_engine])
             for k, v in pages]
            for i in range(num_virtual_engines)
        ]  # fmt: skip
        # Each virtual engine's recurrent states (a scheduler's slots are its own).
        self.states_by_virtual_engine = [
            allocate_states(
                self.state_layers,
                self.num_state_slots + self.num_state_checkpoints + self.num_state_snapshots,
                self.placement.device,
            )
            for _ in range(num_virtual_engines)
        ]
        self.caches_by_virtual_engine = [
            self._layer_caches(p) for p in self.pages_by_virtual_engine
        ]
        if self.inputs is not None and self.capture_sizes and self.placement.device.type == "cpu":
            self.graphs = record_decode_steps(
                self.model, self.caches, self.inputs, self.capture_sizes, self.max_query_len
            )
            if self.graphs is None:  # eager steps read the scheduler's buffers themselves
                self.inputs = None
        # Captured after the KV cache takes its budget, which left room for them.
        elif self.inputs is not None and self.capture_sizes:
            self.graphs = DecodeGraphs(
                self.model, self.caches, self.inputs, self.capture_sizes, self.split_context
            )
            logger.info(
                "CUDA graphs of %d decode batch sizes (1 to %d): %.0f MiB, %.0f MiB expected",
                len(self.capture_sizes), self.capture_sizes[-1], self.graphs.device_bytes / 2**20,
                self.graph_bytes_expected / 2**20,
            )  # fmt: skip

    def _layer_caches(self, pages: list[KVCache]) -> list[KVCache]:
        """Each layer's cache: its slot's pages (none, NO_PAGES, for a layer that does
        not attend: its states come with the step)."""
        page_of = {slot: pages[i] for i, slot in enumerate(self.kv_slots)}
        return [
            NO_PAGES if self.kv_layout.is_recurrent(i)
            else page_of[self.kv_layout.layer_slots[i][1]]
            for i in self.layers
        ]  # fmt: skip

    def _allocate_caches(self, num_blocks: int) -> list[KVCache]:
        return self._layer_caches(allocate_caches(
            num_blocks, len(self.kv_slots), self.num_kv_heads, self.cache_head_size,
            self.block_size, self.cache_dtype, self.placement.device, self.kv_halves,
        ))  # fmt: skip

    def _move_between_tiers(self, step: SchedulerOutput) -> None:
        """The step's copies between the device cache and the host tier: out, then in."""
        tier = self.host_tier
        if tier is None:
            raise RuntimeError("a step moves KV blocks to a host tier this worker does not have")
        virtual_engines = len(self.caches_by_virtual_engine)
        offsets = (
            step.virtual_engine * (self.num_blocks // virtual_engines),
            step.virtual_engine * (tier.num_blocks // virtual_engines),
        )
        if step.kv_to_host:
            tier.copy_out(self.kv_pool_blocks, step.kv_to_host, offsets)
        if step.kv_to_device:
            tier.copy_in(self.kv_pool_blocks, step.kv_to_device, offsets)

    @torch.inference_mode()
    def _gpu_kv_cache_bytes(self, config: EngineConfig) -> int:
        """gpu_memory_utilization of the device's memory, less what the process needs
        besides the KV cache: what is not torch's (the CUDA context, other processes),
        the weights, the peak of a forward pass of the largest step
        (max_num_batched_tokens tokens, in prompts of at most max_model_len, logits for
        max_num_seqs rows and the sampler's work on them), and the CUDA graphs' memory
        (graph_bytes_expected). Prompt logprobs take logits max_num_seqs rows at a time
        too."""
        device = self.placement.device
        tokens = config.max_num_batched_tokens
        lengths = [min(config.max_model_len, tokens - start)
                   for start in range(0, tokens, config.max_model_len)]  # fmt: skip
        per_prompt = [-(-n // self.block_size) for n in lengths]
        first_block = np.concatenate([[0], np.cumsum(per_prompt)[:-1]])
        blocks = sum(per_prompt)
        tables = first_block[:, None] + np.arange(max(per_prompt))[None]
        slots = np.concatenate(
            [b * self.block_size + np.arange(n) for b, n in zip(first_block, lengths, strict=True)]
        )
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        caches = self._allocate_caches(blocks)
        groups = len(self.kv_layout.groups)  # (every group's tables the same here)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(np.tile(slots, (groups, 1))).to(device),
            block_tables=torch.from_numpy(
                np.tile(np.minimum(tables, blocks - 1).astype(np.int32), (groups, 1, 1))
            ).to(device),
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(
                [0, *np.cumsum(lengths)], dtype=torch.int32, device=device
            ),
            max_seq_len=max(lengths),
            max_query_len=max(lengths),
        )
        positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])).to(device)
        input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        hidden = self.model(input_ids, positions, caches, meta, self._zero_intermediate(tokens))
        if isinstance(hidden, torch.Tensor):  # the last stage: logits and the sampler
            logits = self.model.compute_logits(hidden[-min(tokens, config.max_num_seqs) :])
            # The sampler's float32 copies of a whole batch of logits are in the peak too.
            Sampler(0, device)(logits, heaviest_rows(len(logits), config.max_logprobs))
            del logits
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - blocks * self.block_bytes
        del hidden
        self.graph_bytes_expected = self._graph_bytes(caches)
        del caches
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        not_torch = total - free - torch.cuda.memory_reserved(device)
        budget = int(total * config.gpu_memory_utilization)
        return budget - not_torch - peak - self.graph_bytes_expected

    def _graph_bytes(self, caches: list[KVCache]) -> int:
        """The device memory the decode graphs will take: the largest one captured now
        (on the profiling caches) and released, plus the outputs of the smaller ones,
        which keep their own memory; their temporaries reuse the largest's. On the
        safe side: what the probe leaves allocated (cuBLAS's workspace for the capture
        stream, CUDA's pool of graph allocations) is counted again as not torch's."""
        if not self.capture_sizes or self.inputs is None:
            return 0
        largest = self.capture_sizes[-1]
        probe = DecodeGraphs(self.model, caches, self.inputs, [largest], self.split_context)
        device_bytes, hidden = probe.device_bytes, probe.hidden[largest]
        outputs = hidden.element_size() * hidden.shape[1] * sum(self.capture_sizes[:-1])
        del probe, hidden
        return device_bytes + outputs

    def _zero_intermediate(self, tokens: int) -> IntermediateTensors | None:
        """What a stage after the first takes, as zeros (the memory profile's input)."""
        if self.pp.is_first:
            return None
        shape = (tokens, self.model.config.hidden_size)
        device, dtype = self.placement.device, self.placement.dtype
        return {n: torch.zeros(shape, dtype=dtype, device=device)
                for n in self.model.intermediate_names}  # fmt: skip

    @torch.inference_mode()
    def execute(
        self, step: SchedulerOutput, extra_rows: list[int] | None = None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Logits [num_sampling_rows, vocab] of `step` (a pooling runner's: its pooled
        outputs [num_sampling_rows, size], Pooler), and the final hidden states of
        `extra_rows` (token rows of the step; prompt logprobs, for `logits`
        to score a slice at a time), both on the model's device. A stage before the
        last sends its output on and returns (None, None)."""
        caches = self.caches_by_virtual_engine[step.virtual_engine]
        if step.kv_to_host or step.kv_to_device:
            self._move_between_tiers(step)
        if step.block_copies and self.kv_slots:  # (blocks of no pages copy nothing)
            mapping = torch.tensor(step.block_copies, dtype=torch.int64)
            pages = self.pages_by_virtual_engine[step.virtual_engine]
            ops.copy_blocks([k for k, _ in pages], [v for _, v in pages], mapping)
        graph = None
        if self.graphs is not None and not extra_rows:
            graph = self.graphs.size_for(step)
        tensors = self._step_tensors(step, graph)
        if self.lora is not None and step.adapter_ids is not None:
            self.lora.prepare(step.adapter_ids, step.adapters, step.query_start_loc)
            self.lora.select_logit_rows(step.logits_indices)
        if self.graphs is not None and graph is not None:
            # Eagerly, for the sampled rows only: one [rows, vocab] buffer per graph would
            # hold gigabytes at a large vocabulary.
            replayed = self.graphs.replay(graph)[: len(step.input_ids)]
            return self.model.compute_logits(replayed[tensors.logits_indices.long()]), None
        meta = AttentionMetadata(
            slot_mapping=tensors.slot_mapping,
            block_tables=tensors.block_tables,
            seq_lens=tensors.seq_lens,
            query_start_loc=tensors.query_start_loc,
            max_seq_len=int(step.seq_lens.max()) if len(step.seq_lens) else 0,
            max_query_len=int(np.diff(step.query_start_loc).max()) if len(step.seq_lens) else 0,
        )
        if step.state_slots is not None and step.has_state is not None:
            meta.states = self.states_by_virtual_engine[step.virtual_engine]
            copy_states(meta.states, step.state_loads)  # (prefix hits' checkpoints)
            meta.state_slots = torch.from_numpy(step.state_slots)
            meta.has_state = torch.from_numpy(step.has_state)
        intermediate = None
        if not self.pp.is_first:
            shape = (len(step.input_ids), self.model.config.hidden_size)
            intermediate = self.pp.recv(
                self.model.intermediate_names, shape, self.placement.dtype, self.placement.device
            )
        hidden = self.model(tensors.input_ids, tensors.positions, caches, meta, intermediate)
        # A sample forked in this step starts from its parent's state, complete now.
        copy_states(self.states_by_virtual_engine[step.virtual_engine], step.state_copies)
        if not isinstance(hidden, torch.Tensor):
            self.pp.send(hidden)
            return None, None
        if self.pooler is not None:  # (whose steps score no prompt tokens)
            return self.pooler(hidden, step.query_start_loc, step.logits_indices), None
        extra = hidden[self._on_device(extra_rows)] if extra_rows else None
        # On the model's device: a batch of plain greedy rows sends back only its argmax.
        return self.model.compute_logits(hidden[tensors.logits_indices.long()]), extra

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, token_rows: list[int]) -> torch.Tensor:
        """Logits [rows, vocab] of final hidden states [rows, hidden] from `execute`, of
        these token rows of its step (whose adapters score them)."""
        if self.lora is not None:
            self.lora.select_logit_rows(np.asarray(token_rows, dtype=np.int64))
        return self.model.compute_logits(hidden)

    def _step_tensors(self, step: SchedulerOutput, graph: int | None) -> DeviceStep:
        """The step's arrays as tensors: the scheduler's buffers themselves on the CPU;
        on a GPU, one upload (padded to the graph's rows where one runs the step)."""
        if self.inputs is not None:
            return self.inputs.upload(step, graph or 0)
        return DeviceStep(
            input_ids=torch.from_numpy(step.input_ids),
            positions=torch.from_numpy(step.positions),
            slot_mapping=torch.from_numpy(step.slot_mapping),
            query_start_loc=torch.from_numpy(step.query_start_loc),
            seq_lens=torch.from_numpy(step.seq_lens),
            logits_indices=torch.from_numpy(step.logits_indices),
            block_tables=torch.from_numpy(step.block_tables),
        )

    def _on_device(self, values: np.ndarray | list[int]) -> torch.Tensor:
        host = torch.from_numpy(np.asarray(values))
        if self.placement.device.type == "cpu":
            return host
        # Through pinned memory, asynchronously: torch's caching host allocator keeps the
        # staging buffer until the copy has run.
        return host.pin_memory().to(self.placement.device, non_blocking=True)
