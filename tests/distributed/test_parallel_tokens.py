"""Tensor and pipeline parallelism on the CPU (gloo, a process per rank): the same greedy
float32 tokens as one rank, under prefix caching, chunked prefill, n > 1 and a KV pool
small enough to force preemption; no KV block left in use afterwards."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from pyengine import LLM, SamplingParams
from pyengine.outputs import RequestOutput

pytestmark = pytest.mark.slow

SHARED = list(range(30, 70))  # a prefix the prompts share: prefix-cache hits
TINY_PROMPTS = [SHARED + [5, 6, 7], SHARED + [9], [1, 2, 3, 4, 5], list(range(100, 190))]
GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
# n > 1, seeded: drawn on the output rank from the same logits as one rank draws from.
SAMPLED = SamplingParams(temperature=0.8, n=2, seed=7, max_tokens=10, ignore_eos=True)


def generate(llm: LLM, prompts: list[list[int]]) -> list[list[list[int]]]:
    params = [GREEDY] * (len(prompts) - 1) + [SAMPLED]
    outputs: list[RequestOutput] = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False
    )
    return [[list(s.token_ids) for s in out.outputs] for out in outputs]


def run(model: str, prompts: list[list[int]], **engine_args: Any) -> tuple[list[Any], LLM]:
    llm = LLM(model, **engine_args)
    try:
        tokens = generate(llm, prompts)
        for scheduler in llm.llm_engine.schedulers:
            assert scheduler.kv_cache.stats().num_used_blocks == 0, "blocks leaked"
        return tokens, llm
    finally:
        llm.llm_engine.shutdown()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    from helpers.tiny_models import make_checkpoint

    folders = {}
    for kind in ("llama", "qwen2", "gpt2"):
        folders[kind] = tmp_path_factory.mktemp(kind)
        make_checkpoint(kind, folders[kind])
    return folders


# dtype float32: the exact mode, in which every split gives one rank's tokens
TINY = dict(max_model_len=256, max_num_batched_tokens=48, kv_cache_memory=2**22, dtype="float32")


@pytest.mark.parametrize("kind", ["llama", "qwen2", "gpt2"])
def test_tiny_models_split_every_way_give_one_rank_tokens(
    checkpoints: dict[str, Path], kind: str
) -> None:
    model = str(checkpoints[kind])
    expected, _ = run(model, TINY_PROMPTS, **TINY)
    for tp, pp in [(2, 1), (1, 2), (2, 2)]:
        got, llm = run(model, TINY_PROMPTS, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                       **TINY)  # fmt: skip
        assert got == expected, f"{kind} at TP={tp} PP={pp}"
        assert len(llm.llm_engine.schedulers) == pp  # a step in flight per stage


@pytest.mark.parametrize("kind", ["qwen2_moe", "mixtral", "olmoe"])
def test_mixtures_of_experts_over_ranks_give_one_rank_tokens(tmp_path: Path, kind: str) -> None:
    """Every expert split by its intermediate size over TP=2 ranks, and whole experts on
    each rank (expert parallelism); Qwen2-MoE's shared expert split either way; OLMoE's
    q/k norms over whole projections that the ranks hold parts of (at TP=4 too, its 2 kv
    heads each held by two ranks)."""
    pytest.importorskip("transformers")
    from helpers.tiny_moe import moe_checkpoint, save_fused

    model = moe_checkpoint(kind, tmp_path / "per-expert")
    save_fused(model, tmp_path / "per-expert", tmp_path / "fused")
    expected, _ = run(str(tmp_path / "per-expert"), TINY_PROMPTS, **TINY)
    for form in ("per-expert", "fused"):  # (each rank reads its slices of either)
        for expert_parallel in (False, True):
            got, _ = run(str(tmp_path / form), TINY_PROMPTS, tensor_parallel_size=2,
                         enable_expert_parallel=expert_parallel, **TINY)  # fmt: skip
            assert got == expected, f"{kind}, {form}, expert parallel: {expert_parallel}"
    if kind == "olmoe":
        got, _ = run(str(tmp_path / "fused"), TINY_PROMPTS, tensor_parallel_size=4, **TINY)
        assert got == expected, "olmoe at TP=4"
    if kind == "mixtral":  # (6 experts)
        with pytest.raises(ValueError, match=r"num_experts \(6\) is not divisible by tensor_"):
            LLM(str(tmp_path / "fused"), tensor_parallel_size=4, enable_expert_parallel=True,
                **TINY)  # fmt: skip


def test_more_ranks_than_kv_heads_replicate_them(checkpoints: dict[str, Path]) -> None:
    """Tiny Llama has 2 kv heads: at TP=4 each is held by two ranks."""
    model = str(checkpoints["llama"])
    expected, _ = run(model, TINY_PROMPTS, **TINY)
    got, _ = run(model, TINY_PROMPTS, tensor_parallel_size=4, **TINY)
    assert got == expected


def test_preemption_under_a_pipeline_keeps_the_tokens(checkpoints: dict[str, Path]) -> None:
    """A pool of a few blocks per scheduler: requests are preempted and recomputed."""
    model = str(checkpoints["llama"])
    prompts = [[(i + j) % 256 for j in range(60)] for i in range(0, 240, 40)]
    small = dict(max_model_len=96, max_num_batched_tokens=48, block_size=16, dtype="float32")
    # Tiny Llama: 2 layers x 2 kv heads x 32 x 16 x 2 (K, V) x 4 bytes a block; a stage of
    # PP=2 holds one layer, so the same memory holds twice the blocks (half per scheduler).
    memory = 8 * 2 * 2 * 32 * 16 * 2 * 4
    expected, _ = run(model, prompts, kv_cache_memory=memory, **small)
    got, llm = run(model, prompts, pipeline_parallel_size=2, kv_cache_memory=memory, **small)
    assert llm.llm_engine.executor.num_blocks == 16
    assert got == expected
    assert llm.llm_engine.stats().num_preemptions > 0, "the small pool was meant to preempt"
    # Swapped out to a host tier instead (each stage's own, a range per scheduler): the
    # same tokens, at TP=2 and PP=2 (a rank holds half the heads of one layer).
    got, llm = run(model, prompts, pipeline_parallel_size=2, tensor_parallel_size=2,
                   kv_cache_memory=memory // 2, kv_offload_gb=0.001, preemption_mode="swap",
                   **small)  # fmt: skip
    assert got == expected
    assert llm.llm_engine.stats().num_swapped_preemptions > 0, "meant to swap"
    for scheduler in llm.llm_engine.schedulers:
        assert scheduler.kv_cache.stats().num_host_used_blocks == 0


def test_a_split_the_model_does_not_allow_is_refused_at_start(checkpoints: dict[str, Path]) -> None:
    model = str(checkpoints["llama"])  # 4 heads, 2 kv heads, 2 layers
    with pytest.raises(
        ValueError, match="4 attention heads are not divisible by tensor_parallel_size 3"
    ):
        LLM(model, tensor_parallel_size=3, **TINY)
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 exceeds the model's 2 layers"):
        LLM(model, pipeline_parallel_size=3, **TINY)
    with pytest.raises(ValueError, match="'uni' runs one rank"):
        LLM(model, tensor_parallel_size=2, distributed_executor_backend="uni", **TINY)
    with pytest.raises(ValueError, match="distributed_executor_backend must be one of"):
        LLM(model, tensor_parallel_size=2, distributed_executor_backend="mpi", **TINY)


@pytest.fixture(scope="module")
def default_model() -> tuple[str, list[list[int]]]:
    from helpers.smollm2 import make_prompts

    from pyengine.loader.resolve import default_model_path, load_model

    try:
        default_model_path()
    except FileNotFoundError as error:
        pytest.skip(str(error))
    tokenizer = load_model("SmolLM2-135M-Instruct", load_format="dummy").tokenizer
    return "SmolLM2-135M-Instruct", make_prompts(tokenizer)


# The default model: 30 layers, 9 heads, 3 kv heads of 64; one rank's block is 360 KiB.
SMOLLM = dict(max_model_len=1024, max_num_batched_tokens=128, dtype="float32")
SMOLLM_BLOCK_BYTES = 2 * 30 * 3 * 64 * 16 * 4


def test_the_default_model_at_tp3_and_pp2_gives_one_rank_tokens(
    default_model: tuple[str, list[list[int]]],
) -> None:
    model, prompts = default_model
    prompts = prompts[::2]  # the long one among them
    expected, _ = run(model, prompts, **SMOLLM)
    for tp, pp in [(3, 1), (1, 2)]:
        got, _ = run(model, prompts, tensor_parallel_size=tp, pipeline_parallel_size=pp, **SMOLLM)
        assert got == expected, f"TP={tp} PP={pp}"


def test_the_default_model_preempted_at_tp3_gives_one_rank_tokens(
    default_model: tuple[str, list[list[int]]],
) -> None:
    """80 blocks of one rank's size: a third of a block per rank at TP=3, so the same
    count is 80 * block / 3 bytes there."""
    model, prompts = default_model
    expected, one = run(model, prompts, kv_cache_memory=80 * SMOLLM_BLOCK_BYTES, **SMOLLM)
    got, llm = run(model, prompts, tensor_parallel_size=3,
                   kv_cache_memory=80 * SMOLLM_BLOCK_BYTES // 3, **SMOLLM)  # fmt: skip
    assert got == expected
    assert llm.llm_engine.executor.num_blocks == 80
    assert llm.llm_engine.stats().num_preemptions > 0, "the small pool was meant to preempt"


def test_the_default_model_refuses_tp2(default_model: tuple[str, list[list[int]]]) -> None:
    """9 query heads and 3 kv heads: TP=2 divides neither (as vLLM refuses it)."""
    with pytest.raises(
        ValueError, match="9 attention heads are not divisible by tensor_parallel_size 2"
    ):
        LLM(default_model[0], tensor_parallel_size=2, **SMOLLM)


NO_RAY = """
import sys
sys.modules["ray"] = None  # as if Ray were not installed
from pyengine import LLM
try:
    LLM(sys.argv[1], tensor_parallel_size=2, distributed_executor_backend="ray",
        load_format="dummy", max_model_len=128, kv_cache_memory=2**22)
except ValueError as error:
    print(error)
"""


def test_the_ray_backend_without_ray_is_a_clear_error(checkpoints: dict[str, Path]) -> None:
    import subprocess
    import sys
    import tempfile

    out = subprocess.run(
        [sys.executable, "-c", NO_RAY, str(checkpoints["llama"])], capture_output=True,
        text=True, timeout=120, cwd=tempfile.gettempdir(),
    )  # fmt: skip
    assert "needs Ray, which is not installed: pip install 'pyengine[ray]'" in out.stdout, out


def test_one_rank_in_a_process_of_its_own_gives_the_in_process_tokens(model: str) -> None:
    """The `mp` executor at world size 1 (as on one GPU): a worker process, no groups."""
    from helpers.tiny_models import greedy_tokens

    args = dict(load_format="dummy", max_model_len=128, kv_cache_memory=2**22)
    expected = greedy_tokens(LLM(model, **args))
    llm = LLM(model, distributed_executor_backend="mp", **args)
    try:
        assert len(llm.llm_engine.executor.ranks) == 1  # type: ignore[attr-defined]
        assert greedy_tokens(llm) == expected
    finally:
        llm.llm_engine.shutdown()
