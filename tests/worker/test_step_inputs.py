"""StepInputs: a step's scheduler arrays packed at fixed offsets and copied in one piece.
On a GPU the copy goes to the device; the packing, the views and a graph's padding rows
are the same code on the CPU, checked here against the scheduler's own arrays."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.tiny_models import TINY_LLAMA

from pyengine import LLM, SamplingParams, Scheduler, StepBuffers
from pyengine.worker.cuda_graphs import DecodeGraphs
from pyengine.worker.model_runner import ModelRunner
from pyengine.worker.step_inputs import DeviceStep, StepInputs

BLOCK = 4
MAX_LEN = 64
MAX_BLOCKS = MAX_LEN // BLOCK


def scheduler(budget: int = 48, max_seqs: int = 8) -> Scheduler:
    return Scheduler(
        64,
        BLOCK,
        enable_prefix_caching=True,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=MAX_LEN,
        enable_chunked_prefill=True,
        long_prefill_token_threshold=0,
        max_loras=0,
        policy="fcfs",
    )


def inputs(budget: int = 48, max_seqs: int = 8) -> StepInputs:
    return StepInputs(torch.device("cpu"), budget, max_seqs, MAX_BLOCKS)


def assert_holds(step: DeviceStep, b: StepBuffers) -> None:
    np.testing.assert_array_equal(step.input_ids.numpy(), b.input_ids)
    np.testing.assert_array_equal(step.positions.numpy(), b.positions)
    np.testing.assert_array_equal(step.slot_mapping.numpy(), b.group_slot_mapping)
    np.testing.assert_array_equal(step.query_start_loc.numpy(), b.query_start_loc)
    np.testing.assert_array_equal(step.seq_lens.numpy(), b.seq_lens)
    np.testing.assert_array_equal(step.logits_indices.numpy(), b.logits_indices)
    np.testing.assert_array_equal(step.block_tables.numpy(), b.group_block_tables)
    assert step.slot_mapping.dtype == torch.int64 and step.input_ids.dtype == torch.int32
    assert step.block_tables.shape == (1, len(b.seq_lens), MAX_BLOCKS)


def test_prefill_and_decode_steps_arrive_whole() -> None:
    rng = np.random.default_rng(1)
    s, staged = scheduler(), inputs()
    for i, n in enumerate((5, 13, 2, 30)):
        s.add_request(f"r{i}", rng.integers(0, 1000, n).astype(np.int32), max_tokens=6)
    steps = 0
    while s.has_unfinished_requests():
        s.schedule()
        b = s.buffers
        assert_holds(staged.upload(b), b)
        s.update(rng.integers(0, 1000, b.num_sampled).astype(np.int32))
        steps += 1
    assert steps >= 6


def test_a_padded_decode_step_leaves_safe_rows_after_a_prefill_dirtied_them() -> None:
    rng = np.random.default_rng(2)
    s, staged = scheduler(), inputs()
    for i in range(3):
        s.add_request(f"r{i}", rng.integers(0, 1000, 11).astype(np.int32), max_tokens=4)
    s.schedule()  # one prefill step of 33 tokens: every token row up to 33 written
    staged.upload(s.buffers)
    s.update(rng.integers(0, 1000, 3).astype(np.int32))
    s.schedule()
    b = s.buffers
    assert b.num_tokens == 3  # a decode step
    step = staged.upload(b, padded_reqs=8)
    real = DeviceStep(*(getattr(step, f)[:3] for f in step.__dataclass_fields__))
    real.query_start_loc = step.query_start_loc[:4]
    real.slot_mapping, real.block_tables = step.slot_mapping[:, :3], step.block_tables[:, :3]
    assert_holds(real, b)
    assert step.input_ids.shape == (8,) and step.block_tables.shape == (1, 8, MAX_BLOCKS)
    assert step.slot_mapping[0, 3:].tolist() == [-1] * 5  # padding writes no K/V
    assert step.positions[3:].tolist() == [0] * 5
    assert step.input_ids[3:].tolist() == [0] * 5
    assert step.seq_lens[3:].tolist() == [1] * 5
    assert step.query_start_loc.tolist() == list(range(9))
    # What a graph of 8 rows reads from the buffer is what the upload returned.
    again = staged.views(8, 8, 8)
    for name in step.__dataclass_fields__:
        if name != "logits_indices":
            assert torch.equal(getattr(again, name), getattr(step, name)), name


def test_a_verifying_step_pads_to_as_many_tokens_as_rows() -> None:
    """A step of 2 requests and 5 tokens (a token and drafts) padded to a program of 8:
    padding rows of one token each until the tokens are 8, then of none."""
    staged = inputs()
    b = SimpleNamespace(
        input_ids=np.arange(1, 6, dtype=np.int32),
        positions=np.array([4, 5, 6, 9, 10], dtype=np.int32),
        slot_mapping=np.array([[4, 5, 6, 9, 10]], dtype=np.int64),
        query_start_loc=np.array([0, 3, 5], dtype=np.int32),
        seq_lens=np.array([7, 11], dtype=np.int32),
        logits_indices=np.arange(5, dtype=np.int32),
        block_tables=np.zeros((1, 2, 2), dtype=np.int32),
    )
    step = staged.upload(b, padded_reqs=8)  # type: ignore[arg-type]
    assert step.input_ids.tolist() == [1, 2, 3, 4, 5, 0, 0, 0]
    assert step.slot_mapping.tolist() == [[4, 5, 6, 9, 10, -1, -1, -1]]
    assert step.query_start_loc.tolist() == [0, 3, 5, 6, 7, 8, 8, 8, 8]
    assert step.seq_lens.tolist() == [7, 11] + [1] * 6
    staged.reset()
    assert staged.views(8, 8, 8).query_start_loc.tolist() == list(range(9))
    assert staged.views(8, 8, 8).slot_mapping.tolist() == [[-1] * 8]


def test_fresh_buffers_hold_safe_values_for_graph_capture() -> None:
    step = inputs().views(8, 8, 8)
    assert step.slot_mapping.tolist() == [[-1] * 8]
    assert step.seq_lens.tolist() == [1] * 8
    assert step.query_start_loc.tolist() == list(range(9))
    assert not step.block_tables.any() and not step.input_ids.any()


def test_fields_start_on_64_byte_boundaries() -> None:
    staged = StepInputs(torch.device("cpu"), 37, 5, 3)
    assert all(offset % 16 == 0 for offset in staged.offsets.values())
    step = staged.views(37, 5, 5)
    base = staged.buffer.data_ptr()
    for name in step.__dataclass_fields__:
        assert (getattr(step, name).data_ptr() - base) % 64 == 0, name


def test_bad_sizes_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="positive capacities"):
        StepInputs(torch.device("cpu"), 0, 8, 4)
    rng = np.random.default_rng(3)
    s = scheduler(budget=48, max_seqs=8)
    s.add_request("a", rng.integers(0, 1000, 40).astype(np.int32), max_tokens=2)
    s.schedule()
    with pytest.raises(ValueError, match="larger than the inputs' capacity"):
        inputs(budget=16).upload(s.buffers)
    with pytest.raises(ValueError, match="as many tokens as rows"):
        inputs().upload(s.buffers, padded_reqs=4)
    s.update(np.array([7], dtype=np.int32))
    s.schedule()
    with pytest.raises(ValueError, match="as many tokens as rows, up to 8"):
        inputs().upload(s.buffers, padded_reqs=9)
    wide = StepInputs(torch.device("cpu"), 48, 8, MAX_BLOCKS - 1)
    with pytest.raises(ValueError, match="block tables of shape"):
        wide.upload(s.buffers)


def test_a_graph_larger_than_the_token_budget_pads_safely() -> None:
    """max_num_batched_tokens below max_num_seqs: a decode step of 4 requests padded to a
    graph of 8 rows still has 8 token rows, all of the padding safe."""
    rng = np.random.default_rng(4)
    s, staged = scheduler(budget=4, max_seqs=8), inputs(budget=4, max_seqs=8)
    assert staged.max_num_batched_tokens == 8
    for i in range(4):
        s.add_request(f"r{i}", rng.integers(0, 1000, 1).astype(np.int32), max_tokens=3)
    s.schedule()
    staged.upload(s.buffers)
    s.update(rng.integers(0, 1000, 4).astype(np.int32))
    s.schedule()
    step = staged.upload(s.buffers, padded_reqs=8)
    assert step.slot_mapping.shape == (1, 8) and step.slot_mapping[0, 4:].tolist() == [-1] * 4
    assert step.seq_lens[4:].tolist() == [1] * 4
    with pytest.raises(ValueError, match="capacity is 8 tokens"):
        staged.views(9, 8, 8)


class EagerGraphs(DecodeGraphs):
    """DecodeGraphs whose replay runs the forward it would have captured, eagerly: the
    graphs' data path (padded uploads, views of the fixed buffer, the real rows'
    logits) on the CPU, where CUDA graphs cannot be captured."""

    def __init__(self, runner: ModelRunner, inputs: StepInputs, sizes: list[int]) -> None:
        self.model, self.caches, self.inputs = runner.model, runner.caches, inputs
        self.sizes, self.split_context = sizes, runner.split_context
        self.device_bytes = 0
        self.replayed: list[int] = []

    def replay(self, size: int) -> torch.Tensor:
        self.replayed.append(size)
        return self._forward(size)


def test_the_gpu_data_path_gives_the_cpu_path_tokens(tmp_path: Path) -> None:
    """A runner fed through StepInputs, decode steps through (eagerly replayed) graphs
    padded to a ladder of sizes: the same greedy tokens as the plain CPU path, prefix
    caching and chunked prefill included."""
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 512, 40).tolist()
    prompts = [shared + rng.integers(0, 512, n).tolist() for n in (3, 50, 17, 90, 1, 33, 7)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def generate(through_inputs: bool) -> tuple[list[list[int]], list[int]]:
        llm = LLM(str(tmp_path), load_format="dummy", dtype="float32", max_model_len=256,
                  max_num_batched_tokens=64, max_num_seqs=8)  # fmt: skip
        runner = llm.llm_engine.executor.driver_worker.model_runner
        graphs = None
        if through_inputs:
            runner.inputs = StepInputs(torch.device("cpu"), 64, 8, 256 // 16)
            graphs = EagerGraphs(runner, runner.inputs, [1, 2, 4, 8])
            runner.graphs = graphs
        tokens = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
        return tokens, [] if graphs is None else graphs.replayed

    plain, _ = generate(False)
    through, replayed = generate(True)
    assert through == plain
    assert 8 in replayed and 4 in replayed  # 7 requests padded to 8, and fewer at the end
