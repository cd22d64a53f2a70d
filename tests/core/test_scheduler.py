"""The scheduler driven by a deterministic fake model that reads the paged KV cache.

Every request that is not aborted must finish with exactly the tokens it generates
alone, however it was batched, chunked, preempted and recomputed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import pytest
from helpers.fake_model import FakeModel, Limits, next_token, run_alone
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pyengine import Scheduler


class Driver:
    """Runs a scheduler step by step with the fake model, checking the step limits."""

    def __init__(self, scheduler: Scheduler, block_size: int, budget: int, max_seqs: int) -> None:
        self.s = scheduler
        self.model = FakeModel(block_size)
        self.budget, self.max_seqs = budget, max_seqs
        self.tokens: dict[str, list[int]] = {}
        self.outputs: dict[str, list[int]] = {}
        self.finished: dict[str, str] = {}

    def add(self, request_id: str, prompt: list[int], limits: Limits, **kwargs: object) -> None:
        self.s.add_request(
            request_id,
            prompt,
            max_tokens=limits.max_tokens,
            min_tokens=limits.min_tokens,
            eos_token_id=limits.eos_token_id,
            stop_token_ids=list(limits.stop_token_ids),
            ignore_eos=limits.ignore_eos,
            **kwargs,  # type: ignore[arg-type]
        )
        n = int(kwargs.get("n", 1))  # type: ignore[call-overload]
        for k in range(n):
            sample = request_id if k == 0 else Scheduler.sample_id(request_id, k)
            self.tokens[sample] = list(prompt)
            self.outputs[sample] = []

    def schedule(self) -> None:
        self.s.schedule()
        b = self.s.buffers
        assert 0 < b.num_tokens <= self.budget
        assert b.num_reqs <= self.max_seqs
        assert b.query_start_loc[-1] == b.num_tokens

    def finish_step(self) -> None:
        sampled = self.model.step(self.s, self.tokens)
        self.s.update(sampled)
        self.take_outputs()

    def take_outputs(self) -> None:
        """The last update()'s new tokens (several a row where drafts were accepted)."""
        for request_id, token, reason in self.s.outputs():
            if token is not None:
                self.tokens[request_id].append(token)
                self.outputs[request_id].append(token)
            if reason is not None:
                self.finished[request_id] = reason

    def run(self, max_steps: int = 10_000) -> None:
        for _ in range(max_steps):
            if not self.s.has_unfinished_requests():
                return
            self.schedule()
            self.finish_step()
        raise AssertionError("requests did not finish")


# The rest of the Scheduler's arguments, which the binding no longer defaults: the values
# it defaulted to; a test overrides them through make()'s kwargs.
OPTIONS: dict[str, object] = {
    "enable_prefix_caching": True,
    "enable_chunked_prefill": True,
    "long_prefill_token_threshold": 0,
    "max_loras": 0,
    "policy": "fcfs",
}


def make(
    num_blocks: int = 64,
    block_size: int = 4,
    budget: int = 32,
    max_seqs: int = 8,
    max_model_len: int = 128,
    **kwargs: object,
) -> Driver:
    scheduler = Scheduler(
        num_blocks,
        block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max_seqs,
        max_model_len=max_model_len,
        **(OPTIONS | kwargs),
    )  # type: ignore[arg-type]
    return Driver(scheduler, block_size, budget, max_seqs)


def test_requests_finish_as_they_would_alone() -> None:
    d = make()
    rng = np.random.default_rng()
    limits = {f"r{i}": Limits(max_tokens=int(rng.integers(1, 20))) for i in range(6)}
    prompts = {r: rng.integers(0, 50, int(rng.integers(1, 40))).tolist() for r in limits}
    for r in limits:
        d.add(r, prompts[r], limits[r])
    d.run()
    for r in limits:
        assert (d.outputs[r], d.finished[r]) == run_alone(prompts[r], limits[r], 128)
    assert d.s.kv_cache.num_free_blocks == 64


def test_stop_conditions() -> None:
    prompt = [1, 2, 3]
    alone, _ = run_alone(prompt, Limits(max_tokens=10), 128)
    eos = alone[4]
    cases = {
        "eos": Limits(max_tokens=10, eos_token_id=eos),
        "eos ignored": Limits(max_tokens=10, eos_token_id=eos, ignore_eos=True),
        "stop token": Limits(max_tokens=10, stop_token_ids=(alone[2],)),
        "min_tokens": Limits(max_tokens=10, min_tokens=6, eos_token_id=alone[1]),
        "max_tokens": Limits(max_tokens=3),
    }
    d = make()
    for name, limits in cases.items():
        d.add(name, prompt, limits)
    d.add(
        "max_model_len",
        prompt,
        Limits(max_tokens=100),
    )
    d.s.abort_request("max_model_len")
    d.run()
    for name, limits in cases.items():
        assert (d.outputs[name], d.finished[name]) == run_alone(prompt, limits, 128), name
    assert d.finished["eos"] == "stop" and len(d.outputs["eos"]) == 5
    assert len(d.outputs["min_tokens"]) >= 6


def test_max_model_len_ends_a_request() -> None:
    d = make(max_model_len=12)
    d.add("a", list(range(10)), Limits(max_tokens=50))
    d.run()
    assert len(d.outputs["a"]) == 2 and d.finished["a"] == "length"


def test_chunked_prefill_of_a_prompt_ten_times_the_budget_beside_decodes() -> None:
    budget = 16
    d = make(num_blocks=128, budget=budget, max_model_len=256)
    rng = np.random.default_rng()
    short = {f"s{i}": rng.integers(0, 100, 5).tolist() for i in range(3)}
    for r, prompt in short.items():
        d.add(r, prompt, Limits(max_tokens=30))
    d.schedule()
    d.finish_step()
    long_prompt = rng.integers(0, 100, 10 * budget).tolist()
    d.add("long", long_prompt, Limits(max_tokens=5))
    chunks = 0
    while "long" not in d.finished:
        d.schedule()
        b = d.s.buffers
        rows = dict(zip(b.request_ids, b.num_scheduled_tokens.tolist(), strict=True))
        decodes = [r for r in short if r in rows and r not in d.finished]
        assert all(rows[r] == 1 for r in decodes)  # decodes keep going beside the chunks
        if "long" in rows and d.s.num_computed_tokens("long") <= len(long_prompt):
            chunks += 1
        d.finish_step()
    assert chunks >= 10
    d.run()
    assert (d.outputs["long"], d.finished["long"]) == run_alone(long_prompt, Limits(5), 256)
    for r, prompt in short.items():
        assert d.outputs[r] == run_alone(prompt, Limits(max_tokens=30), 256)[0]


@pytest.mark.parametrize("swap", [False, True])
def test_preemption_recomputes_or_swaps_and_loses_nothing(swap: bool) -> None:
    # 12 blocks of 4: three requests growing to 40 tokens cannot all stay.
    tier = {"num_host_blocks": 24, "preemption_mode": "swap"} if swap else {}
    d = make(num_blocks=12, budget=64, max_model_len=64, **tier)
    prompts = {f"r{i}": [i + 1] * 20 for i in range(3)}
    for r, prompt in prompts.items():
        d.add(r, prompt, Limits(max_tokens=20))
    d.run()
    stats = d.s.stats()
    assert stats.num_preemptions > 0
    assert stats.num_swapped_preemptions == (stats.num_preemptions if swap else 0)
    for r, prompt in prompts.items():
        assert d.outputs[r] == run_alone(prompt, Limits(max_tokens=20), 64)[0]
    assert d.s.kv_cache.num_free_blocks == 12
    assert d.s.kv_cache.stats().num_host_used_blocks == 0


def test_swap_preemption_needs_a_host_tier() -> None:
    with pytest.raises(ValueError, match="swap preemption needs a host tier"):
        make(preemption_mode="swap")
    with pytest.raises(ValueError, match="preemption_mode must be 'recompute' or 'swap'"):
        make(num_host_blocks=4, preemption_mode="evict")


def test_parallel_samples_share_the_prompt_and_diverge() -> None:
    d = make(num_blocks=64, budget=64)
    prompt = list(range(1, 11))  # 10 tokens: the last block is partly filled and shared
    d.add("p", prompt, Limits(max_tokens=12), n=3)
    samples = ["p", Scheduler.sample_id("p", 1), Scheduler.sample_id("p", 2)]
    assert d.s.status(samples[1]) == "fork_pending"
    d.schedule()
    b = d.s.buffers
    assert b.num_tokens == len(prompt)  # the prompt is computed once
    assert b.request_ids == samples and b.num_scheduled_tokens.tolist() == [10, 0, 0]
    assert b.logits_indices.tolist() == [9, 9, 9]
    tables = [d.s.kv_cache.block_table(r) for r in samples]
    assert tables[0] == tables[1] == tables[2]
    d.finish_step()
    d.schedule()
    assert len(d.s.buffers.block_copies) == 2  # two of three copy the shared block
    d.finish_step()
    d.run()
    for k, sample in enumerate(samples):
        expected = run_alone(prompt, Limits(max_tokens=12), 128, sample=k)
        assert (d.outputs[sample], d.finished[sample]) == expected
    assert len({tuple(d.outputs[r]) for r in samples}) == 3
    assert d.s.kv_cache.num_free_blocks == 64


def test_aborting_a_request_drops_its_unforked_samples() -> None:
    d = make()
    d.add("p", [1, 2, 3], Limits(), n=3)
    d.s.abort_request("p")
    assert not d.s.has_unfinished_requests()
    with pytest.raises(ValueError, match="n must be in"):
        d.s.add_request("q", [1], n=9)  # max_num_seqs is 8
    d.s.add_request("r#1", [1])
    with pytest.raises(ValueError, match="'r#1', is taken"):
        d.s.add_request("r", [1], n=2)
    assert not d.s.has_request("r")


def test_priority_policy_runs_urgent_requests_first() -> None:
    d = make(max_seqs=1, policy="priority")
    d.add("late", [1, 2], Limits(max_tokens=2), priority=5, arrival_time=0.0)
    d.add("urgent", [3, 4], Limits(max_tokens=2), priority=0, arrival_time=1.0)
    d.schedule()
    assert d.s.buffers.request_ids == ["urgent"]
    d.finish_step()
    d.run()
    assert set(d.finished) == {"late", "urgent"}


@pytest.mark.parametrize(("policy", "victim"), [("priority", "b"), ("fcfs", "c")])
def test_preemption_takes_the_last_running_request_in_policy_order(
    policy: str, victim: str
) -> None:
    """Three requests outgrow 12 blocks of 4: the first preempted is the lowest
    priority's (the highest value) under "priority", the latest arrival's under "fcfs"."""
    d = make(num_blocks=12, budget=64, max_model_len=64, policy=policy)
    for i, (request_id, priority) in enumerate([("a", 0), ("b", 9), ("c", 5)]):
        d.add(request_id, [i + 1] * 12, Limits(max_tokens=20), priority=priority,
              arrival_time=float(i))  # fmt: skip
    while d.s.stats().num_preemptions == 0:
        d.schedule()
        d.finish_step()
    statuses = {r: d.s.status(r) for r in "abc"}
    assert statuses == {r: "waiting" if r == victim else "running" for r in "abc"}
    d.run()
    assert len(d.finished) == 3


def test_abort_during_a_step() -> None:
    d = make()
    d.add("a", [1, 2, 3], Limits(max_tokens=5))
    d.add("b", [4, 5, 6], Limits(max_tokens=5))
    d.schedule()
    d.s.abort_request("a")
    d.finish_step()
    assert d.finished["a"] == "abort" and d.outputs["a"] == []
    assert not d.s.has_request("a")
    d.run()
    assert d.outputs["b"] == run_alone([4, 5, 6], Limits(max_tokens=5), 128)[0]
    assert d.s.kv_cache.num_free_blocks == 64


def test_requests_ended_during_a_step_report_their_reason() -> None:
    """Regression: the reason given to finish_request was reported as "abort", a request
    ended during a prefill chunk got no row at all, and re-adding its id before update()
    made the new request look ended."""
    d = make(budget=8)
    d.add("chunked", list(range(1, 21)), Limits())  # 20 tokens: a chunk of 8, no sample
    d.schedule()
    d.s.abort_request("chunked")
    with pytest.raises(ValueError, match="ended during the scheduled step"):
        d.s.add_request("chunked", [1, 2])
    d.finish_step()
    assert d.finished["chunked"] == "abort"
    d.add("chunked", [1, 2], Limits(max_tokens=2))  # after update(): a new request
    d.add("b", [3, 4], Limits())
    d.schedule()
    d.s.finish_request("b", "stop")  # a stop string seen by Python
    d.finish_step()
    assert d.finished["b"] == "stop" and d.outputs["b"] == []
    d.run()
    assert d.finished["chunked"] == "length" and len(d.outputs["chunked"]) == 2


def test_a_waiting_request_is_counted_once_in_prefix_cache_statistics() -> None:
    """Regression: every blocked step looked the head of the queue up again and counted
    its prompt each time."""
    d = make(max_seqs=1)
    d.add("a", [1] * 8, Limits(max_tokens=5))
    d.add("b", [1] * 8, Limits(max_tokens=5))
    d.run()
    kv = d.s.kv_cache.stats()
    assert kv.prefix_cache_queries == 16
    assert kv.prefix_cache_hits == 4  # b reuses a's first block of 4


def test_a_step_holds_at_most_max_loras_adapters_and_none_starves() -> None:
    """max_loras=2: a request for a third adapter waits, and from then on only requests
    without an adapter join, so that the running adapters drain and it starts."""
    d = make(max_seqs=8, max_loras=2)
    adapters = {"a1": 1, "a2": 2, "a3": 3, "base": 0, "a1-late": 1, "a2-late": 2}
    limits = {r: Limits(max_tokens=6 if r != "a1" else 3) for r in adapters}
    prompts = {r: [10 + i, 11, 12] for i, r in enumerate(adapters)}
    for r, adapter in adapters.items():
        d.add(r, prompts[r], limits[r], adapter_id=adapter)
    steps: list[set[int]] = []
    while d.s.has_unfinished_requests():
        d.schedule()
        ids = d.s.buffers.request_ids
        steps.append({adapters[r] for r in ids} - {0})
        first = len(steps) == 1
        if first:  # a3 waits, and so does every later request with an adapter
            assert set(ids) == {"a1", "a2", "base"}
        d.finish_step()
    assert all(len(step) <= 2 for step in steps)
    assert 3 in set().union(*steps)  # a3 ran
    for r in adapters:
        assert (d.outputs[r], d.finished[r]) == run_alone(prompts[r], limits[r], 128)
    assert d.s.kv_cache.num_free_blocks == 64
    with pytest.raises(ValueError, match="max_loras must be non-negative"):
        make(max_loras=-1)


def test_the_binding_takes_every_argument() -> None:
    """The engine's defaults live in EngineArgs alone, none in the binding."""
    with pytest.raises(TypeError):
        Scheduler(8, 16)  # type: ignore[call-arg]


def test_bad_input_is_rejected_and_changes_nothing() -> None:
    d = make(num_blocks=8, max_model_len=64)
    d.add("a", [1, 2], Limits())
    before = d.s.stats()
    with pytest.raises(ValueError, match="already exists"):
        d.s.add_request("a", [1])
    with pytest.raises(ValueError, match="prompt is empty"):
        d.s.add_request("b", [])
    with pytest.raises(ValueError, match="max_tokens must be at least 1"):
        d.s.add_request("b", [1], max_tokens=-3)
    with pytest.raises(ValueError, match="min_tokens"):
        d.s.add_request("b", [1], max_tokens=2, min_tokens=3)
    with pytest.raises(ValueError, match="more than max_model_len"):
        d.s.add_request("b", [1] * 65)
    with pytest.raises(ValueError, match="needs up to 16 KV-cache blocks, the pool has 8"):
        d.s.add_request("b", [1] * 60, max_tokens=4)
    with pytest.raises(ValueError, match="outside"):
        d.s.add_request("b", [1, -1])
    defaults = {  # the values the binding used to default to
        "block_size": 16,
        "max_num_batched_tokens": 2048,
        "max_num_seqs": 256,
        "max_model_len": 4096,
    } | OPTIONS
    with pytest.raises(ValueError, match="policy must be"):
        Scheduler(8, **(defaults | {"policy": "lifo"}))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_num_batched_tokens must be at least"):
        Scheduler(
            8,
            **(
                defaults
                | {
                    "max_num_batched_tokens": 16,
                    "max_model_len": 64,
                    "enable_chunked_prefill": False,
                }
            ),
        )  # type: ignore[arg-type]
    with pytest.raises(KeyError, match="unknown request id 'nobody'"):
        d.s.abort_request("nobody")
    with pytest.raises(RuntimeError, match="no step was scheduled"):
        d.s.update(np.zeros(0, np.int32))
    after = d.s.stats()
    assert (
        (after.num_waiting, after.num_running) == (before.num_waiting, before.num_running) == (1, 0)
    )
    d.s.schedule()
    with pytest.raises(ValueError, match="expected 1 sampled token ids"):
        d.s.update(np.zeros(3, np.int32))
    with pytest.raises(RuntimeError, match="has not been update"):
        d.s.schedule()
    d.finish_step()  # the step is still there to complete
    d.run()
    assert d.finished["a"] == "length"


MAX_MODEL_LEN = 48  # of the workload tests


@dataclass
class Arrival:
    step: int
    prompt: list[int]
    limits: Limits
    priority: int
    abort_at: int | None
    abort_mid_step: bool
    n: int


@st.composite
def arrivals(draw: st.DrawFn) -> Arrival:
    length = draw(st.integers(1, 32))
    prompt = draw(st.lists(st.integers(0, 4), min_size=length, max_size=length))
    max_tokens = draw(st.integers(1, 16))
    alone, _ = run_alone(prompt, Limits(max_tokens=max_tokens), MAX_MODEL_LEN)
    eos = draw(st.one_of(st.none(), st.sampled_from(alone)))
    limits = Limits(max_tokens=max_tokens, min_tokens=draw(st.integers(0, 2)), eos_token_id=eos)
    limits.min_tokens = min(limits.min_tokens, max_tokens)
    abort_at = draw(st.one_of(st.none(), st.none(), st.integers(0, 30)))
    n = draw(st.sampled_from([1, 1, 1, 2, 3]))
    return Arrival(
        draw(st.integers(0, 10)),
        prompt,
        limits,
        draw(st.integers(0, 2)),
        abort_at,
        draw(st.booleans()),
        n,
    )


@settings(
    max_examples=int(os.environ.get("PYENGINE_HYPOTHESIS_EXAMPLES", 100)),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(data=st.data())
def test_random_workloads_finish_exactly_as_alone(data: st.DataObject) -> None:
    block_size = data.draw(st.sampled_from([2, 4]), label="block_size")
    # Pools from "one full-length request" up: small enough that preemption is common.
    min_blocks = MAX_MODEL_LEN // block_size
    num_blocks = data.draw(st.integers(min_blocks, min_blocks + 6), label="num_blocks")
    budget = data.draw(st.integers(4, 40), label="budget")
    max_seqs = data.draw(st.integers(1, 8), label="max_num_seqs")
    policy = data.draw(st.sampled_from(["fcfs", "priority"]), label="policy")
    threshold = data.draw(st.sampled_from([0, 0, 5]), label="long_prefill_token_threshold")
    plan = data.draw(st.lists(arrivals(), min_size=2, max_size=16), label="requests")
    # A host tier, small or large, that evicted prefixes and swapped-out requests move to.
    num_host_blocks = data.draw(st.sampled_from([0, 0, 3, 12, 60]), label="num_host_blocks")
    preemption_mode = "swap" if num_host_blocks and data.draw(st.booleans()) else "recompute"
    d = run_workload(
        block_size, num_blocks, budget, max_seqs, policy, threshold, plan,
        num_host_blocks=num_host_blocks, preemption_mode=preemption_mode,
    )  # fmt: skip
    stats = d.s.stats()
    event("preempted" if stats.num_preemptions > 0 else "no preemption")
    event("swapped out" if stats.num_swapped_preemptions > 0 else "not swapped")
    event("host-tier hits" if d.s.kv_cache.stats().host_cache_hits > 0 else "no host hit")
    event("parallel samples" if any(a.n > 1 for a in plan) else "one sample each")


def test_a_preempted_step_does_not_leave_uncomputed_blocks_in_the_prefix_cache() -> None:
    """Regression: a request preempted after it was scheduled in the same step kept the
    prefix-cache entries made for that step's tokens, whose KV was never computed; a
    later request with the same prefix read garbage (found by the workload test)."""
    plan = [Arrival(0, [0], Limits(max_tokens=1), 0, None, False, 1) for _ in range(7)]
    plan += [
        Arrival(0, [0, 0, 0, 1] + [0] * 17, Limits(max_tokens=1), 0, None, False, 1),
        Arrival(2, [0] * 24, Limits(max_tokens=2), 0, None, False, 2),
        Arrival(3, [0] * 25, Limits(max_tokens=1), 0, None, False, 1),
    ]
    d = run_workload(4, 12, 14, 8, "fcfs", 5, plan)
    assert d.s.stats().num_preemptions > 0


def test_a_sample_swapped_out_in_its_copy_on_write_step_keeps_its_context() -> None:
    """Regression: a parallel sample whose shared last block was copied on write, then
    swapped out in the same step, copied out the block the copy had not filled yet (the
    step's swap-outs run before its block copies); it came back with a garbage block
    (found by the workload test)."""
    plan = [
        Arrival(0, [0], Limits(max_tokens=1), 0, None, False, 1),
        Arrival(0, [0] * 7 + [1] + [0] * 4, Limits(max_tokens=4), 0, None, False, 2),
        Arrival(2, [0] * 17, Limits(max_tokens=1), 0, None, False, 1),
        Arrival(0, [0, 0, 0, 1] + [0] * 17, Limits(max_tokens=2), 1, None, False, 2),
    ]
    d = run_workload(4, 14, 11, 5, "priority", 0, plan, num_host_blocks=12, preemption_mode="swap")
    assert d.s.stats().num_swapped_preemptions > 0


def run_workload(
    block_size: int,
    num_blocks: int,
    budget: int,
    max_seqs: int,
    policy: str,
    threshold: int,
    plan: list[Arrival],
    **options: object,
) -> Driver:
    """Runs `plan` to the end, checking every step and every output against running alone."""
    d = make(
        num_blocks,
        block_size,
        budget,
        max_seqs,
        MAX_MODEL_LEN,
        policy=policy,
        long_prefill_token_threshold=threshold,
        **options,
    )
    keys: dict[str, tuple[int, float, int]] = {}
    aborted: set[str] = set()

    def abort(request_id: str) -> None:
        if d.s.has_request(request_id):
            d.s.abort_request(request_id)
            aborted.add(request_id)

    for step in range(3000):
        for i, a in enumerate(plan):
            if a.step == step:
                d.add(
                    f"r{i}",
                    a.prompt,
                    a.limits,
                    priority=a.priority,
                    arrival_time=float(step),
                    n=min(a.n, max_seqs),
                )
                keys[f"r{i}"] = (a.priority if policy == "priority" else 0, float(step), i)
        for i, a in enumerate(plan):
            if a.abort_at == step and not a.abort_mid_step:
                abort(f"r{i}")
        if not d.s.has_unfinished_requests():
            if step > max(a.step for a in plan):
                break
            continue
        was_waiting = {r for r in keys if d.s.has_request(r) and d.s.status(r) == "waiting"}
        d.schedule()
        admitted = {r for r in was_waiting if d.s.status(r) == "running"}
        still_waiting = {r for r in was_waiting if d.s.status(r) == "waiting"}
        for r in admitted:  # FCFS within a priority: nobody earlier is left waiting
            assert all(keys[r] < keys[w] for w in still_waiting), (r, still_waiting)
        for i, a in enumerate(plan):
            if a.abort_at == step and a.abort_mid_step:
                abort(f"r{i}")
        d.finish_step()
    else:
        raise AssertionError("requests did not finish")

    for i, a in enumerate(plan):
        request_id = f"r{i}"
        for k in range(min(a.n, max_seqs)):
            sample = request_id if k == 0 else Scheduler.sample_id(request_id, k)
            if sample in aborted or d.finished.get(sample, "abort") == "abort":
                # Aborted itself, or with its parent before it was forked.
                assert request_id in aborted or sample in aborted
                continue
            expected = run_alone(a.prompt, a.limits, MAX_MODEL_LEN, sample=k)
            assert (d.outputs[sample], d.finished[sample]) == expected, sample
    assert d.s.kv_cache.num_free_blocks == num_blocks
    kv = d.s.kv_cache.stats()
    assert kv.num_used_blocks == kv.num_host_used_blocks == kv.num_swapped_requests == 0
    return d


def test_draft_tokens_verified_greedily_give_the_tokens_of_no_speculation() -> None:
    """Speculative decoding through the scheduler: each step proposes up to 4 draft tokens
    per decoding request, right or wrong at random; the fake model reads every row's
    context back through the KV cache (the drafts' lookahead slots included) and keeps the
    drafts that match its own tokens. Every request ends with the tokens it makes alone, in
    fewer steps than tokens, under preemption (a small cache) and with prefix caching
    (shared prompts), and no block is left."""
    rng = np.random.default_rng()
    for num_blocks in (64, 24):
        d = make(num_blocks=num_blocks, budget=24)
        limits = {f"r{i}": Limits(max_tokens=int(rng.integers(1, 30))) for i in range(6)}
        shared = rng.integers(0, 50, 9).tolist()
        prompts = {r: shared + rng.integers(0, 50, int(rng.integers(1, 20))).tolist()
                   for r in limits}  # fmt: skip
        for r in limits:
            d.add(r, prompts[r], limits[r])
        steps = 0
        while d.s.has_unfinished_requests():
            for r, tokens in d.tokens.items():
                if r in d.finished or not d.s.has_request(r):
                    continue
                drafts, context = [], list(tokens)
                for _ in range(int(rng.integers(0, 5))):
                    right = next_token(context)
                    drafts.append(right if rng.random() < 0.7 else (right + 1) % 1000)
                    context.append(drafts[-1])
                d.s.set_draft_tokens(r, drafts)
            d.schedule()
            tokens, counts = d.model.step_with_drafts(d.s, d.tokens)
            d.s.update(tokens, counts)
            d.take_outputs()
            steps += 1
        for r in limits:
            assert (d.outputs[r], d.finished[r]) == run_alone(prompts[r], limits[r], 128), r
        assert steps < sum(len(out) for out in d.outputs.values())
        assert d.s.kv_cache.num_free_blocks == num_blocks


def test_state_slots_reach_the_step_buffers() -> None:
    """With recurrent-state slots (no prefix caching), each scheduled request's slot and
    whether it holds its state are in the step's buffers; a third request waits for a
    slot; a forked sample's state copy comes with its forking step."""
    scheduler = Scheduler(
        64, 4, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128,
        **(OPTIONS | {"enable_prefix_caching": False}), num_state_slots=2,
    )  # type: ignore[arg-type]  # fmt: skip
    for request_id, length in (("a", 5), ("b", 3), ("c", 2)):
        scheduler.add_request(request_id, list(range(1, length + 1)), max_tokens=2)
    assert scheduler.schedule() == 2
    buffers = scheduler.buffers
    assert buffers.request_ids == ["a", "b"]
    assert buffers.state_slots.tolist() == [0, 1] and buffers.has_state.tolist() == [0, 0]
    scheduler.update(np.array([7, 7], dtype=np.int32))
    assert scheduler.schedule() == 2
    assert scheduler.buffers.has_state.tolist() == [1, 1]
    assert scheduler.buffers.state_copies == []
    with pytest.raises(ValueError, match="prefix caching with recurrent-state slots"):
        Scheduler(
            64, 4, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128,
            **OPTIONS, num_state_slots=2,
        )  # type: ignore[arg-type]  # fmt: skip


def test_a_rejected_draft_puts_the_state_back_and_runs_the_accepted_tokens_again() -> None:
    """With state snapshots (speculative decoding on a hybrid model), a step that
    verifies drafts first saves the request's state into its snapshot slot (after the
    2 request slots and 2 checkpoints: slot 4 + its own); where a draft is rejected, the
    state is put back before the next step, which runs the decode token, the accepted
    draft and the new token again as a chunk. Where every draft is accepted, nothing is
    put back."""
    scheduler = Scheduler(
        64, 4, max_num_batched_tokens=32, max_num_seqs=8, max_model_len=128, **OPTIONS,
        num_state_slots=2, num_state_checkpoints=2, state_snapshots=True,
    )  # type: ignore[arg-type]  # fmt: skip
    scheduler.add_request("a", [1, 2, 3, 5], max_tokens=20, speculate=True)
    assert scheduler.schedule() == 1
    scheduler.update(np.array([7], dtype=np.int32))  # (4 computed, 5 known)
    scheduler.set_draft_tokens("a", [8, 9, 10])
    assert scheduler.schedule() == 1
    b = scheduler.buffers
    assert b.state_loads == [(0, 4)] and b.num_draft_tokens.tolist() == [3]
    # The first draft accepted, the second rejected: 7, 8, then 11 in place of 9.
    scheduler.update(np.array([8, 11], dtype=np.int32), np.array([2], dtype=np.int32))
    assert scheduler.schedule() == 1
    b = scheduler.buffers
    assert b.state_loads == [(4, 0)] and b.has_state.tolist() == [1]
    assert b.num_scheduled_tokens.tolist() == [3]  # (7 and 8 again, then 11)
    assert b.num_draft_tokens.tolist() == [0]
    scheduler.update(np.array([12], dtype=np.int32))
    scheduler.set_draft_tokens("a", [13, 14])
    assert scheduler.schedule() == 1
    assert scheduler.buffers.state_loads == [(0, 4)]
    scheduler.update(np.array([13, 14, 15], dtype=np.int32), np.array([3], dtype=np.int32))
    assert scheduler.schedule() == 1
    assert (
        scheduler.buffers.state_loads == []
        and scheduler.buffers.num_scheduled_tokens.tolist() == [1]
    )
