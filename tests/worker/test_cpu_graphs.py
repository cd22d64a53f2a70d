"""Recorded decode steps on the CPU (worker/cpu_graphs.py, ops.recording): a program
replays its kernels on what its tensors hold now, keeps them alive, and a model's
recorded steps give the eager steps' tokens and logprobs bit for bit (Qwen3's per-head
norms included); a model that computes outside the kernels is found out and runs eagerly."""

from __future__ import annotations

import gc
import json
import logging
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from helpers.replays import count_replays
from helpers.tiny_models import TINY_LLAMA, make_checkpoint

from pyengine import _C, LLM, SamplingParams, ops
from pyengine.utils import host_memory
from pyengine.worker import cpu_graphs
from pyengine.worker.cpu_graphs import CPU_CAPTURE_SIZES, KernelGraphs, cpu_capture_sizes


def test_capture_sizes_stop_at_max_num_seqs() -> None:
    assert cpu_capture_sizes(1) == [1]
    assert cpu_capture_sizes(3) == [1, 2, 3]
    assert cpu_capture_sizes(20) == [1, 2, 3, 4, 5, 6, 7, 8, 16]
    assert cpu_capture_sizes(256) == list(CPU_CAPTURE_SIZES)


def test_past_a_few_rows_a_step_pads_a_quarter_of_its_program_at_most() -> None:
    graphs = object.__new__(KernelGraphs)
    graphs.sizes, graphs.max_query_len = [1, 2, 4, 8, 16, 32], 1
    for n, size in ((1, 1), (3, 4), (5, 8), (9, None), (12, 16), (16, 16), (23, None),
                    (24, 32), (32, 32), (33, None)):  # fmt: skip
        rows = np.arange(n)
        step = SimpleNamespace(seq_lens=rows, input_ids=rows,
                               query_start_loc=np.arange(n + 1), logits_indices=rows)  # fmt: skip
        assert graphs.size_for(step) == size, n  # type: ignore[arg-type]


def test_a_verifying_step_runs_the_program_of_its_tokens() -> None:
    """With drafts, a step of requests of 1 to max_query_len tokens each (a token and its
    drafts) runs the smallest program that holds its tokens; a longer request (a prefill
    chunk) runs eagerly."""
    graphs = object.__new__(KernelGraphs)
    graphs.sizes, graphs.max_query_len = cpu_capture_sizes(8, 20), 5
    assert graphs.sizes == [1, 2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 20]

    def step(query_lens: list[int]) -> SimpleNamespace:
        n, tokens = len(query_lens), sum(query_lens)
        return SimpleNamespace(seq_lens=np.ones(n), input_ids=np.zeros(tokens),
                               query_start_loc=np.concatenate([[0], np.cumsum(query_lens)]),
                               logits_indices=np.arange(tokens))  # fmt: skip

    assert graphs.size_for(step([5])) == 5  # type: ignore[arg-type]
    assert graphs.size_for(step([3, 1, 5])) == 10  # type: ignore[arg-type]
    assert graphs.size_for(step([5, 5, 5, 4])) == 20  # type: ignore[arg-type]
    assert graphs.size_for(step([6])) is None  # type: ignore[arg-type]
    assert graphs.size_for(step([5] * 5)) is None  # type: ignore[arg-type]


def test_a_program_replays_its_calls_on_what_its_tensors_hold_now() -> None:
    rng = np.random.default_rng()
    x = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    residual = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    weight = torch.rand(64) + 0.5
    packed = torch.empty(_C.packed_weight_size(64, 40))
    w_t = torch.randn(64, 40)
    _C.pack_weight(packed, w_t)
    first_residual = residual.clone()
    program = _C.KernelProgram()
    with ops.recording(program):
        h = x.clone()
        ops.fused_add_rms_norm(h, residual, weight, 1e-6)
        out = torch.empty(3, 40)
        ops.dense(out, h, packed, None, 40)
        total = torch.empty(3, 40)
        ops.add(total, out, out)
    assert len(program) == 3  # (the clone is torch's)
    h_ref = torch.nn.functional.rms_norm(x + first_residual, (64,), weight, 1e-6)
    torch.testing.assert_close(total, 2 * (h_ref @ w_t), rtol=1e-5, atol=1e-5)
    # New values in the recorded tensors: the replay computes from them.
    del out  # the program keeps what it recorded alive
    gc.collect()
    x2 = torch.from_numpy(rng.standard_normal((3, 64)).astype(np.float32))
    h.copy_(x2)
    before = residual.clone()
    program.run()
    expected = 2 * (torch.nn.functional.rms_norm(x2 + before, (64,), weight, 1e-6) @ w_t)
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(residual, x2 + before)


def test_a_program_profiles_each_call_by_its_kernel_name() -> None:
    a, b = torch.randn(4, 32), torch.randn(4, 32)
    weight = torch.rand(32) + 0.5
    total, normed = torch.empty(4, 32), torch.empty(4, 32)
    program = _C.KernelProgram()
    with ops.recording(program):
        ops.add(total, a, b)
        ops.rms_norm(normed, total, weight, 1e-6)
    profile = program.profile(3)
    assert [name for name, _ in profile] == ["add", "rms_norm"]
    assert all(seconds > 0 for _, seconds in profile)
    # The profiled runs are runs: they compute what run() does.
    a.fill_(1.0)
    program.profile(1)
    torch.testing.assert_close(total, 1.0 + b)
    with pytest.raises(ValueError, match="repeats must be at least 1, got 0"):
        program.profile(0)


def test_recording_does_not_nest_and_ends_with_its_block() -> None:
    program = _C.KernelProgram()
    inner = _C.KernelProgram()
    with (
        ops.recording(program),
        pytest.raises(RuntimeError, match="being recorded"),
        ops.recording(inner),
    ):
        pass
    a = torch.randn(2, 8)
    ops.add(torch.empty(2, 8), a, a)  # after the block: not recorded
    assert len(program) == 0
    with pytest.raises(ValueError, match="add"), ops.recording(program):
        ops.add(torch.empty(2, 8), a, torch.randn(2, 4))  # a bad call is refused as eagerly
    assert len(program) == 0


def test_a_replayed_call_checks_its_inputs_again() -> None:
    """A program's kernels check what their tensors hold at each run: a bad token id
    written into a recorded input is a clear error, not a read out of bounds."""
    weight, ids = torch.randn(10, 16), torch.tensor([1, 2], dtype=torch.int32)
    program = _C.KernelProgram()
    with ops.recording(program):
        ops.embedding(torch.empty(2, 16), weight, ids)
    ids[1] = 10
    with pytest.raises(ValueError, match=r"ids\[1\] is 10, outside \[0, 10\)"):
        program.run()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_add_and_embedding_match_torch(dtype: torch.dtype) -> None:
    a, b = torch.randn(5, 33).to(dtype), torch.randn(5, 33).to(dtype)
    out = torch.empty_like(a)
    ops.add(out, a, b)
    assert torch.equal(out, a + b)
    table = torch.randn(50, 24).to(dtype)
    for ids in (torch.tensor([3, 0, 49, 3]), torch.tensor([7, 7], dtype=torch.int32)):
        rows = torch.empty(len(ids), 24, dtype=dtype)
        ops.embedding(rows, table, ids)
        assert torch.equal(rows, torch.nn.functional.embedding(ids, table))
    with pytest.raises(ValueError, match="disagree in shape"):
        ops.add(out, a, b[:4])
    with pytest.raises(ValueError, match=r"ids\[0\] is -1"):
        ops.embedding(torch.empty(1, 24, dtype=dtype), table, torch.tensor([-1]))


def generate(
    folder: Path, enforce_eager: bool, prompts: list[list[int]], **kwargs: object
) -> tuple[list[tuple[object, object]], bool, list[tuple[int, int | None]]]:
    llm = LLM(str(folder), max_model_len=256, max_num_seqs=8, enforce_eager=enforce_eager,
              **kwargs)  # fmt: skip
    graphs = llm.llm_engine.executor.driver_worker.model_runner.graphs
    replays: list[tuple[int, int | None]] = []
    if graphs is not None:
        assert isinstance(graphs, KernelGraphs)
        replays = count_replays(graphs)
    # Requests that end at different steps: steps of 4, 3 (padded to 4), 2 and 1 rows.
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3)
              for n in (12, 9, 6, 3)]  # fmt: skip
    outputs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
    del llm
    return [(o.token_ids, o.logprobs) for o in outputs], graphs is not None, replays


PROMPTS = [[5, 9, 2], list(range(30, 70)), [1], [200, 7, 7, 7, 9]]


@pytest.mark.parametrize("options", [{}, {"kv_cache_dtype": "int8"}, {"dtype": "bfloat16"}])
def test_recorded_steps_give_the_eager_tokens_and_logprobs(
    tmp_path: Path, options: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A ladder without 3, so that a step of 3 requests replays the program of 4 padded.
    monkeypatch.setattr(cpu_graphs, "CPU_CAPTURE_SIZES", (1, 2, 4, 8))
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    kwargs = {"load_format": "dummy", **options}
    eager, eager_recorded, _ = generate(tmp_path, True, PROMPTS, **kwargs)
    recorded, was_recorded, replays = generate(tmp_path, False, PROMPTS, **kwargs)
    assert was_recorded and not eager_recorded
    assert (4, 4) in replays, "no decode step of the 4 requests replayed"
    assert {(3, 4), (2, 2), (1, 1)} <= set(replays), replays
    assert recorded == eager


def test_a_model_computing_outside_the_kernels_runs_eagerly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """GPT-2's layer norms and position embeddings are torch's: a replay would read stale
    values, so the check finds it out and the steps run eagerly."""
    pytest.importorskip("transformers")
    make_checkpoint("gpt2", tmp_path)
    with caplog.at_level(logging.INFO, logger="pyengine"):
        _, was_recorded, _ = generate(tmp_path, False, PROMPTS)
    assert not was_recorded
    assert "differs from the eager one" in caplog.text


def test_qwen3_per_head_norms_are_recorded(tmp_path: Path) -> None:
    """Qwen3's q/k norms per head run as rms_norm over [tokens, heads, head_size] rows, so
    its steps are recorded too, and give the eager steps' tokens and logprobs bit for bit."""
    pytest.importorskip("transformers")
    make_checkpoint("qwen3", tmp_path)
    eager, _, _ = generate(tmp_path, True, PROMPTS)
    recorded, was_recorded, replays = generate(tmp_path, False, PROMPTS)
    assert was_recorded and (4, 4) in replays
    assert recorded == eager


def test_the_checks_leave_the_kv_cache_zero_and_uncommitted(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    llm = LLM(str(tmp_path), load_format="dummy", max_model_len=256, max_num_seqs=8)
    runner = llm.llm_engine.executor.driver_worker.model_runner
    assert runner.graphs is not None
    assert all(not k.any() and not v.any() for k, v in runner.caches)
    del llm, runner
    pool = host_memory.huge_page_tensor(3 << 20, torch.float32)
    pool[:: 1 << 18] = 1.0
    host_memory.decommit(pool[5:])  # (the whole storage of any view)
    assert not pool.any()
