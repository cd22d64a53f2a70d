"""A draft model's proposals, made by the worker in the very step that verifies them
(speculative decoding, method draft_model). Before the target runs, the draft reads each
decoding request's last token and proposes its drafts one forward at a time, greedily;
they replace the step's placeholders (Scheduler.reserve_draft_tokens) and the target
verifies them as any drafts, so the tokens are the target's whatever the draft says.

The draft's KV cache has the target's blocks, and each step's block tables and slots
serve both. A separate draft model keeps its own cache in step with the target's by
running every token the target computes (prompt chunks too, and its own last draft,
which it proposes but would not otherwise read). The self-speculative draft
(draft_layers) is the target's own first layers, whose KV the target writes anyway: it
runs only each decoding request's last token and its drafts, in the target's cache (the
target's step then writes the same KV there again).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch

from pyengine import _C, ops
from pyengine.config import EngineConfig
from pyengine.layers.attention import AttentionMetadata, KVCache
from pyengine.layers.linear import LayerContext
from pyengine.loader.model_loader import build_model
from pyengine.loader.resolve import load_model
from pyengine.sample.common import row_argmax
from pyengine.sample.logits_processors import apply_token_bitmasks
from pyengine.spec_decode.config import SpeculativeConfig
from pyengine.spec_decode.draft_model import check_draft_vocabulary
from pyengine.step_values import SchedulerOutput
from pyengine.worker.model_runner import (
    ModelRunner,
    allocate_caches,
    kv_block_numel,
    resident_bytes,
)

logger = logging.getLogger("pyengine")


@dataclass
class _Rows:
    """One forward of the draft: each row's tokens, positions and slots, flat."""

    requests: list[int]  # the step's request index of each row
    tokens: list[np.ndarray]
    positions: list[np.ndarray]
    slots: list[np.ndarray]


class DraftRunner:
    def __init__(self, spec: SpeculativeConfig, target: ModelRunner, config: EngineConfig) -> None:
        self.target = target
        self.placement = target.placement
        self.block_size = config.block_size
        target_config = target.model.config
        self.num_layers: int | None = spec.draft_layers
        if spec.draft_layers is not None:
            if spec.draft_layers >= target_config.num_layers:
                raise ValueError(
                    f"speculative_config: draft_layers {spec.draft_layers} must be fewer than "
                    f"the target's {target_config.num_layers} layers"
                )
            if config.lora is not None:  # (the adapters' rows are the target step's)
                raise ValueError("speculative_config: draft_layers cannot run with enable_lora")
            self.model = target.model
            self.mirrors = False
            logger.info("draft: the target's first %d layers", spec.draft_layers)
        else:
            assert spec.model is not None  # (SpeculativeConfig: one of the two)
            loaded = load_model(
                spec.model, read_tokenizer=False,
                keep_block_quantized=self.placement.keeps_gguf_blocks,
            )  # fmt: skip
            check_draft_vocabulary(spec.model, loaded.config.vocab_size, target_config.vocab_size)
            if loaded.config.head_size not in _C.attention_head_sizes():
                raise ValueError(
                    f"speculative_config: the draft's attention head size "
                    f"{loaded.config.head_size} is not one paged attention runs"
                )
            if target.kv_layout.groups[0][0] != "full":
                raise ValueError(
                    "speculative_config: a draft model's KV cache shares the target's block "
                    "tables, and every layer of the target attends within a window (its "
                    "released blocks would be gone): use draft_layers, ngram or suffix"
                )
            context = LayerContext(
                self.placement, quantized_activations=config.quantized_activations
            )
            self.model = build_model(loaded, config.max_model_len, config.seed, context)
            self.mirrors = True
            logger.info(
                "draft: %s, %d layers, %.1f MiB", spec.model, loaded.config.num_layers,
                resident_bytes(self.model) / 2**20,
            )  # fmt: skip
        self.caches: list[KVCache] = []
        # What the draft adds to the KV cache's budget: a block of its own cache beside
        # each of the target's, and its weights on a GPU (the budget measured before them).
        self.block_bytes = 0
        self.weight_bytes = 0
        if self.mirrors:
            c = self.model.config
            numel = kv_block_numel(c.num_layers, c.num_kv_heads, c.head_size, self.block_size)
            self.block_bytes = numel * self.placement.dtype.itemsize
            if self.placement.device.type != "cpu":
                self.weight_bytes = resident_bytes(self.model)

    def initialize_cache(self, num_blocks: int) -> None:
        """The draft's KV cache: as many blocks as the target's (a separate draft's own,
        in the budget beside the target's: ModelRunner.share_kv_budget), or the target's
        first layers'."""
        if not self.mirrors:
            self.caches = self.target.caches[: self.num_layers]
            return
        c = self.model.config
        self.caches = allocate_caches(
            num_blocks, c.num_layers, c.num_kv_heads, c.head_size, self.block_size,
            self.placement.dtype, self.placement.device,
        )  # fmt: skip

    @torch.inference_mode()
    def propose(self, step: SchedulerOutput) -> tuple[SchedulerOutput, list[int]]:
        """The step with its placeholders replaced by the draft's proposals, and those,
        row after row. A constrained request's first draft is among the tokens its
        grammar allows (step.draft_masks), its later ones the draft's argmax (the
        engine's grammars stay in the engine): the target's token after a draft its
        grammar refuses is never kept (docs/architecture.md)."""
        assert step.num_draft_tokens is not None
        counts = step.num_draft_tokens.astype(np.int64)
        if step.block_copies:  # (before the draft reads them)
            caches = self.caches if self.mirrors else self.target.pages
            mapping = torch.tensor(step.block_copies, dtype=torch.int64)
            ops.copy_blocks([k for k, _ in caches], [v for _, v in caches], mapping)
            if not self.mirrors:  # (done for the target: its caches are these)
                step = replace(step, block_copies=[])
        # (a decoding row: its last token before its drafts' places)
        last = step.query_start_loc[1:].astype(np.int64) - counts - 1
        first = self._first_forward(step, counts)
        proposals = np.zeros((len(counts), int(counts.max(initial=0))), dtype=np.int32)
        proposing = [i for i in first.requests if counts[i] > 0]
        if first.requests:  # (a separate draft's forward also keeps its cache in step)
            ends = np.cumsum([len(t) for t in first.tokens]) - 1
            wanted = [int(e) for e, i in zip(ends, first.requests, strict=True) if counts[i] > 0]
            made = self._run(step, first, wanted, [step.draft_masks.get(i) for i in proposing])
            if proposing:
                proposals[proposing, 0] = made
        # Draft j at its place; a separate draft also reads its last, so that its cache
        # holds every token the target verifies (the target's own cache holds them anyway).
        for j in range(1, proposals.shape[1] + (1 if self.mirrors else 0)):
            rows = [i for i in proposing if counts[i] >= j]
            proposes = [k for k, i in enumerate(rows) if counts[i] > j]
            at = [int(last[i]) + j for i in rows]  # the token rows of draft j
            one = _Rows(rows, [proposals[i, j - 1 : j] for i in rows],
                        [step.positions[t : t + 1] for t in at],
                        [step.slot_mapping[:, t : t + 1] for t in at])  # fmt: skip
            made = self._run(step, one, proposes)
            if proposes:
                proposals[[rows[k] for k in proposes], j] = made
        filled = step.input_ids.copy()
        flat: list[int] = []
        for i in proposing:
            d = int(counts[i])
            filled[last[i] + 1 : last[i] + 1 + d] = proposals[i, :d]
            flat += proposals[i, :d].tolist()
        return replace(step, input_ids=filled), flat

    def _first_forward(self, step: SchedulerOutput, counts: np.ndarray) -> _Rows:
        """The draft's first forward: each decoding request's last token; for a separate
        draft, every token the target computes in the step but its drafts."""
        rows = _Rows([], [], [], [])
        starts = step.query_start_loc.astype(np.int64)
        for i in range(len(counts)):
            start, end = int(starts[i]), int(starts[i + 1] - counts[i])
            if start == end or not (self.mirrors or counts[i] > 0):
                continue  # (nothing to compute: a sample forked in this step)
            if not self.mirrors:
                start = end - 1
            rows.requests.append(i)
            rows.tokens.append(step.input_ids[start:end])
            rows.positions.append(step.positions[start:end])
            rows.slots.append(step.slot_mapping[:, start:end])
        return rows

    def _run(
        self,
        step: SchedulerOutput,
        rows: _Rows,
        wanted: list[int],
        masks: list[np.ndarray | None] | None = None,
    ) -> np.ndarray:
        """The draft's argmax at the flat token rows `wanted` of one forward over `rows`
        (each request's context through its last token there), among each row's allowed
        tokens where `masks` gives them."""
        device = self.placement.device
        lengths = [len(t) for t in rows.tokens]
        seq_lens = np.array([int(p[-1]) + 1 for p in rows.positions], dtype=np.int32)
        meta = AttentionMetadata(
            # Every KV-cache group's: the target's first layers read their own; a separate
            # draft's layers read group 0's, a full one (checked at start).
            slot_mapping=_on(np.concatenate(rows.slots, axis=1).astype(np.int64), device),
            block_tables=_on(np.ascontiguousarray(step.block_tables[:, rows.requests]), device),
            seq_lens=_on(seq_lens, device),
            query_start_loc=_on(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32), device),
            max_seq_len=int(seq_lens.max()),
            max_query_len=max(lengths),
        )
        input_ids = _on(np.concatenate(rows.tokens).astype(np.int32), device)
        positions = _on(np.concatenate(rows.positions).astype(np.int32), device)
        if self.num_layers is None:
            hidden = self.model(input_ids, positions, self.caches, meta)
        else:
            hidden = self.model(input_ids, positions, self.caches, meta, None, self.num_layers)
        assert isinstance(hidden, torch.Tensor)
        if not wanted:
            return np.zeros(0, dtype=np.int32)
        logits = self.model.compute_logits(hidden[_on(np.asarray(wanted, np.int64), device)])
        if masks is not None:
            apply_token_bitmasks(logits, masks)
        return row_argmax(logits).cpu().numpy().astype(np.int32)


def _on(values: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(values)).to(device)
