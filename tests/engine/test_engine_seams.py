"""The engine's seams: a step crosses the executor as a plain value (a pickled copy gives
the same tokens), RequestOutputs are snapshots later steps leave alone, the sampler takes
other logits processors, models come from the registry, and LLM's arguments are
EngineArgs'."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import TypeVar

import numpy as np
import pytest
import torch

from pyengine import LLM, SamplingParams
from pyengine.executor import Executor
from pyengine.executor.abstract import Done, Pending
from pyengine.models.registry import ARCHITECTURES, model_class
from pyengine.sample.sampler import Sampler
from pyengine.step_values import (
    ExecuteOutput,
    GrammarMasks,
    SampledTokens,
    SamplingRow,
    SchedulerOutput,
)

T = TypeVar("T")

TINY = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 128,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path: Path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(TINY))
    return path


def tiny_llm(folder: Path) -> LLM:
    return LLM(str(folder), load_format="dummy", max_model_len=128, kv_cache_memory=2**24)


def through_pickle(value: T) -> T:
    """`value` as a process that unpickles it would see it."""
    copy: T = pickle.loads(pickle.dumps(value))
    return copy


class PicklingExecutor(Executor):
    """Sends every step, and its result, through pickle: as a worker in another process
    would see them."""

    def __init__(self, inner: Executor) -> None:
        self.inner = inner
        self.steps = 0

    @property
    def num_blocks(self) -> int:
        return self.inner.num_blocks

    @property
    def num_parameters(self) -> int:
        return self.inner.num_parameters

    @property
    def kv_groups(self) -> tuple[tuple[str, int], ...]:
        return self.inner.kv_groups

    def execute_model(self, step: SchedulerOutput) -> Pending[ExecuteOutput]:
        self.steps += 1
        return Done(through_pickle(self.inner.execute_model(through_pickle(step)).result()))

    def sample_tokens(
        self, virtual_engine: int, masks: GrammarMasks | None
    ) -> Pending[SampledTokens]:
        answer = self.inner.sample_tokens(virtual_engine, through_pickle(masks))
        return Done(through_pickle(answer.result()))

    def redraw(
        self, virtual_engine: int, rows: list[int], masks: np.ndarray
    ) -> Pending[SampledTokens]:
        answer = self.inner.redraw(virtual_engine, rows, through_pickle(masks))
        return Done(through_pickle(answer.result()))

    def shutdown(self) -> None:
        self.inner.shutdown()


def test_a_step_is_a_plain_value_the_executor_can_send_anywhere(folder: Path) -> None:
    prompts = [[1, 2, 3, 4, 5], [9, 8, 7], list(range(20, 60))]
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2),
        SamplingParams(temperature=0.8, seed=3, n=2, max_tokens=6, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, repetition_penalty=1.3, max_tokens=6,
                       min_tokens=3, seed=11, ignore_eos=True),
    ]  # fmt: skip
    local, remote = tiny_llm(folder), tiny_llm(folder)
    pickling = PicklingExecutor(remote.llm_engine.core.executor)
    remote.llm_engine.core.executor = pickling
    want = local.generate(prompts, params, use_tqdm=False)
    got = remote.generate(prompts, params, use_tqdm=False)
    assert pickling.steps > 0
    for w, g in zip(want, got, strict=True):
        assert [o.token_ids for o in g.outputs] == [o.token_ids for o in w.outputs]
        assert g.prompt_logprobs == w.prompt_logprobs
        assert [o.logprobs for o in g.outputs] == [o.logprobs for o in w.outputs]
    assert remote.llm_engine.scheduler.kv_cache.stats().num_used_blocks == 0


def test_outputs_are_snapshots_that_later_steps_leave_alone(folder: Path) -> None:
    llm = tiny_llm(folder)
    engine = llm.llm_engine
    engine.add_request("r", [1, 2, 3], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    seen = []
    while engine.has_unfinished_requests():
        seen += [(len(o.outputs[0].token_ids), o) for o in engine.step()]
    assert [n for n, _ in seen] == [1, 2, 3, 4, 5]
    for n, out in seen:
        assert len(out.outputs[0].token_ids) == n  # as it was when handed out
    assert seen[0][1].metrics.finished_time is None and seen[-1][1].finished


def test_the_sampler_runs_the_logits_processors_it_is_given() -> None:
    def ban_zero(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
        logits[:, 0] = float("-inf")

    logits = torch.zeros(4, 8)
    logits[:, 0] = 10.0  # the argmax, unless banned
    rows = [SamplingRow(SamplingParams(temperature=0, logit_bias={1: 1.0}), [5], [], None)] * 4
    assert Sampler(0)(logits, rows).token_ids == [0] * 4
    assert Sampler(0, processors=[ban_zero])(logits, rows).token_ids == [1] * 4


def test_the_registry_names_a_class_for_each_architecture() -> None:
    for architecture in ARCHITECTURES:
        assert model_class(architecture).__name__.endswith(
            ("ForCausalLM", "Decoder", "Encoder", "ForSequenceClassification")
        )
    with pytest.raises(ValueError, match="architecture Mamba is not supported"):
        model_class("Mamba")


def test_llm_takes_engine_args_by_name(folder: Path) -> None:
    with pytest.raises(TypeError, match="max_num_seq"):
        LLM(str(folder), load_format="dummy", max_num_seq=4)
