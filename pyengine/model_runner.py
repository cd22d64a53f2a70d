"""Runs the model on one scheduled step: the step's flat buffers in, the logits of the
rows that sample out. Owns the model and its paged KV cache."""

from __future__ import annotations

import mmap

import torch

from pyengine import StepBuffers, ops
from pyengine.attention import AttentionMetadata, KVCache
from pyengine.config import LLAMA_LIKE, EngineConfig
from pyengine.loader.resolve import LoadedModel
from pyengine.models.gpt import LearnedPositionDecoder
from pyengine.models.llama import LlamaForCausalLM

CausalLM = LlamaForCausalLM | LearnedPositionDecoder


def build_model(loaded: LoadedModel, max_positions: int, seed: int) -> CausalLM:
    config = loaded.config
    model: CausalLM
    if config.architecture in LLAMA_LIKE:
        model = LlamaForCausalLM(config, max_positions)
    else:
        model = LearnedPositionDecoder(config)
    if loaded.weights is None:  # load_format="dummy": random weights of the right scale
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.fill_(1.0 if name.endswith("weight") else 0.0)
                else:
                    p.normal_(0.0, 0.02, generator=generator)
        model.prepare_for_inference()
    else:
        model.load_weights(loaded.weights)
    return model.eval()


def allocate_kv_pool(floats: int) -> torch.Tensor:
    """The KV cache's memory, zero-filled, on transparent huge pages where the OS offers
    them: attention reads 4 KB tiles from wherever their blocks lie in the pool, and with
    2 MB pages those reads stop missing the TLB (decode attention of 32 requests whose
    blocks are scattered over a 2 GiB pool: 9% faster on the 2-core dev machine; no
    change while a fresh pool hands out neighbouring blocks). Pages are committed as
    blocks are first written, 2 MB at a time."""
    if not hasattr(mmap, "MAP_ANONYMOUS") or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.zeros(floats)
    buffer = mmap.mmap(-1, floats * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=torch.float32, count=floats)  # keeps buffer alive


class ModelRunner:
    def __init__(self, loaded: LoadedModel, config: EngineConfig) -> None:
        c = loaded.config
        self.block_size = config.block_size
        block_bytes = (
            2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * config.block_size * 4
        )
        self.num_blocks = config.kv_cache_memory // block_bytes
        min_blocks = -(-config.max_model_len // config.block_size)
        if self.num_blocks < min_blocks:
            raise ValueError(
                f"kv_cache_memory ({config.kv_cache_memory} bytes) holds {self.num_blocks} blocks "
                f"of {config.block_size} tokens; one max_model_len request needs {min_blocks} "
                f"(at least {min_blocks * block_bytes} bytes, or lower max_model_len)"
            )
        self.model = build_model(loaded, config.max_model_len, config.seed)
        layer_floats = self.num_blocks * c.num_key_value_heads * c.head_dim * config.block_size
        pool = allocate_kv_pool(2 * c.num_hidden_layers * layer_floats)
        halves = pool.view(c.num_hidden_layers, 2, layer_floats)
        shape = (self.num_blocks, c.num_key_value_heads)
        self.caches: list[KVCache] = [
            (
                halves[i, 0].view(*shape, c.head_dim, config.block_size),
                halves[i, 1].view(*shape, config.block_size, c.head_dim),
            )
            for i in range(c.num_hidden_layers)
        ]

    @torch.inference_mode()
    def execute(
        self, b: StepBuffers, extra_rows: list[int] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [num_sampling_rows, vocab] of the step in `b`, and those of `extra_rows`
        (token rows of the step; prompt logprobs)."""
        if b.block_copies:
            mapping = torch.tensor(b.block_copies, dtype=torch.int64)
            ops.copy_blocks([k for k, _ in self.caches], [v for _, v in self.caches], mapping)
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(b.slot_mapping),
            block_tables=torch.from_numpy(b.block_tables),
            seq_lens=torch.from_numpy(b.seq_lens),
            query_start_loc=torch.from_numpy(b.query_start_loc),
        )
        input_ids = torch.from_numpy(b.input_ids)
        positions = torch.from_numpy(b.positions)
        hidden = self.model(input_ids, positions, self.caches, meta)
        rows = torch.from_numpy(b.logits_indices).long()
        extra = None
        if extra_rows:
            extra = self.model.compute_logits(hidden[torch.tensor(extra_rows)])
        return self.model.compute_logits(hidden[rows]), extra
