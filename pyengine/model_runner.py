"""Runs the model on one scheduled step: the step's flat buffers in, the logits of the
rows that sample out. Owns the model and its paged KV cache."""

from __future__ import annotations

import numpy as np
import torch

from pyengine import StepBuffers, ops
from pyengine.attention import AttentionMetadata, KVCache
from pyengine.config import LLAMA_LIKE, EngineConfig
from pyengine.cuda_graphs import DecodeGraphs
from pyengine.host_memory import huge_page_tensor
from pyengine.loader.resolve import LoadedModel
from pyengine.models.gpt import LearnedPositionDecoder
from pyengine.models.layers import Placement
from pyengine.models.llama import LlamaForCausalLM

CausalLM = LlamaForCausalLM | LearnedPositionDecoder


def build_model(
    loaded: LoadedModel, max_positions: int, seed: int, placement: Placement
) -> CausalLM:
    config = loaded.config
    model: CausalLM
    with torch.device(placement.device):  # the parameters are made (and loaded) there
        if config.architecture in LLAMA_LIKE:
            model = LlamaForCausalLM(config, max_positions, placement)
        else:
            model = LearnedPositionDecoder(config, placement)
    if loaded.weights is None:  # load_format="dummy": random weights of the right scale
        generator = torch.Generator(placement.device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    p.normal_(0.0, 0.02, generator=generator)
        model.prepare_for_inference()
    elif isinstance(model, LlamaForCausalLM):
        model.load_weights(loaded.weights, loaded.block_quantized)
    else:
        model.load_weights(loaded.weights)
    return model.eval()


def allocate_kv_pool(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The KV cache's memory, zero-filled. On a GPU, one allocation. On the CPU, on
    transparent huge pages where the OS offers them (host_memory): attention reads 4 KB
    tiles from wherever their blocks lie in the pool, and with 2 MB pages those reads stop
    missing the TLB (decode attention of 32 requests whose blocks are scattered over a
    2 GiB pool: 9% faster on the 2-core dev machine; no change while a fresh pool hands out
    neighbouring blocks). Pages are committed as blocks are first written, 2 MB at a
    time."""
    if device.type != "cpu":
        return torch.zeros(numel, dtype=dtype, device=device)
    return huge_page_tensor(numel, dtype)


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        c = loaded.config
        self.placement = Placement(torch.device(config.device), getattr(torch, config.dtype))
        self.block_size = config.block_size
        tile = c.num_key_value_heads * c.head_dim * config.block_size  # per layer and block
        self.block_numel = 2 * c.num_hidden_layers * tile  # K and V of every layer
        self.cache_dtype = getattr(torch, config.cache_dtype)
        self.block_bytes = self.block_numel * (torch.finfo(self.cache_dtype).bits // 8)
        min_blocks = -(-config.max_model_len // config.block_size)
        on_cpu = self.placement.device.type == "cpu"
        cpu_blocks = config.kv_cache_memory // self.block_bytes
        if on_cpu and cpu_blocks < min_blocks:
            raise ValueError(
                f"kv_cache_memory ({config.kv_cache_memory} bytes) holds "
                f"{cpu_blocks} blocks of {config.block_size} tokens; "
                f"one max_model_len request needs {min_blocks} (at least "
                f"{min_blocks * self.block_bytes} bytes, or lower max_model_len)"
            )
        self.model = build_model(loaded, config.max_model_len, config.seed, self.placement)
        kv_bytes = config.kv_cache_memory if on_cpu else self._gpu_kv_cache_bytes(config)
        self.num_blocks = kv_bytes // self.block_bytes
        if self.num_blocks < min_blocks:
            raise ValueError(
                f"gpu_memory_utilization {config.gpu_memory_utilization} leaves "
                f"{max(kv_bytes, 0)} bytes for the KV cache after the weights and a forward "
                f"pass: {self.num_blocks} blocks of {config.block_size} tokens, and one "
                f"max_model_len request needs {min_blocks} (raise gpu_memory_utilization or "
                "lower max_model_len or max_num_batched_tokens)"
            )
        self.caches = self._allocate_caches(self.num_blocks)
        # Captured after the KV cache takes its budget; their memory is on top of it.
        self.graphs = None
        if not on_cpu and not config.enforce_eager:
            self.graphs = DecodeGraphs(
                self.model, self.caches, config.max_num_seqs, config.max_model_len,
                config.block_size,
            )  # fmt: skip

    def _allocate_caches(self, num_blocks: int) -> list[KVCache]:
        """Per layer, views of one new pool (allocate_kv_pool): keys [blocks, kv_heads,
        head, block] (transposed), values [blocks, kv_heads, block, head]."""
        c = self.model.config
        pool = allocate_kv_pool(
            num_blocks * self.block_numel, self.cache_dtype, self.placement.device
        )
        halves = pool.view(c.num_hidden_layers, 2, -1)
        shape = (num_blocks, c.num_key_value_heads)
        return [
            (
                halves[i, 0].view(*shape, c.head_dim, self.block_size),
                halves[i, 1].view(*shape, self.block_size, c.head_dim),
            )
            for i in range(c.num_hidden_layers)
        ]

    @torch.inference_mode()
    def _gpu_kv_cache_bytes(self, config: EngineConfig) -> int:
        """gpu_memory_utilization of the device's memory, less what the process needs
        besides the KV cache: what is not torch's (the CUDA context, other processes),
        the weights, and the peak of a forward pass of the largest step
        (max_num_batched_tokens tokens, in prompts of at most max_model_len, logits for
        max_num_seqs rows). Prompt logprobs, which take logits for every prompt row, are
        not in that peak."""
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
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(device),
            block_tables=torch.from_numpy(np.minimum(tables, blocks - 1).astype(np.int32)).to(
                device
            ),
            seq_lens=torch.tensor(lengths, dtype=torch.int32, device=device),
            query_start_loc=torch.tensor(
                [0, *np.cumsum(lengths)], dtype=torch.int32, device=device
            ),
            max_seq_len=max(lengths),
            max_query_len=max(lengths),
        )
        positions = torch.from_numpy(np.concatenate([np.arange(n) for n in lengths])).to(device)
        input_ids = torch.zeros(tokens, dtype=torch.long, device=device)
        hidden = self.model(input_ids, positions, caches, meta)
        self.model.compute_logits(hidden[-min(tokens, config.max_num_seqs) :])
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - blocks * self.block_bytes
        del caches, hidden
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        not_torch = total - free - torch.cuda.memory_reserved(device)
        return int(total * config.gpu_memory_utilization) - not_torch - peak

    @torch.inference_mode()
    def execute(
        self, b: StepBuffers, extra_rows: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [num_sampling_rows, vocab] of the step in `b`, on the model's device, and
        those of `extra_rows` (token rows of the step; prompt logprobs), on the CPU in
        float32."""
        if b.block_copies:
            mapping = torch.tensor(b.block_copies, dtype=torch.int64)
            ops.copy_blocks([k for k, _ in self.caches], [v for _, v in self.caches], mapping)
        if self.graphs is not None and not extra_rows:
            logits = self.graphs.run(b)
            if logits is not None:
                return logits, None
        meta = AttentionMetadata(
            slot_mapping=self._on_device(b.slot_mapping),
            block_tables=self._on_device(b.block_tables),
            seq_lens=self._on_device(b.seq_lens),
            query_start_loc=self._on_device(b.query_start_loc),
            max_seq_len=int(b.seq_lens.max()) if len(b.seq_lens) else 0,
            max_query_len=int(np.diff(b.query_start_loc).max()) if len(b.seq_lens) else 0,
        )
        input_ids = self._on_device(b.input_ids)
        positions = self._on_device(b.positions)
        hidden = self.model(input_ids, positions, self.caches, meta)
        rows = self._on_device(b.logits_indices).long()
        extra = None
        if extra_rows:
            extra_logits = self.model.compute_logits(hidden[self._on_device(extra_rows)])
            extra = extra_logits.to("cpu", torch.float32)
        # On the model's device: a batch of plain greedy rows sends back only its argmax.
        return self.model.compute_logits(hidden[rows]), extra

    def _on_device(self, values: np.ndarray | list[int]) -> torch.Tensor:
        host = torch.from_numpy(np.asarray(values))
        if self.placement.device.type == "cpu":
            return host
        # Through pinned memory, asynchronously: torch's caching host allocator keeps the
        # staging buffer until the copy has run.
        return host.pin_memory().to(self.placement.device, non_blocking=True)
