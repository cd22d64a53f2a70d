"""Property tests of the KV-cache manager's recurrent-state slots over random sequences
of operations (a hybrid model's requests: prefill chunks, decodes, forks, frees), with
and without prefix caching, whose hits resume states from checkpoints.

A shadow records what each slot's state has absorbed: the tokens of the request that
last wrote it, as the model runner's recurrent layers would (a step starts from the
slot's state where the request has computed tokens, from zeros where it has none, and
the fork's state copies run after the step). The properties: every live request that
has computed tokens holds a slot of its own, whose state is exactly its computed
tokens' (whether computed by itself, copied from its parent at a fork, or loaded from
the checkpoint a prefix hit resumes from); a request without computed tokens holds
none; slots are never shared; a failed allocation or fork changes nothing; every slot is
free again once every request is freed.
"""

from __future__ import annotations

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    rule,
)

from pyengine import KVCacheManager

tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=14)


class StateSlotMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.next_id = 0
        self.tokens: dict[str, list[int]] = {}
        self.states: dict[int, tuple[int, ...]] = {}  # slot -> the tokens it has absorbed

    @initialize(
        num_blocks=st.integers(1, 12),
        block_size=st.sampled_from([1, 2, 4]),
        num_state_slots=st.integers(1, 4),
        num_state_checkpoints=st.sampled_from([0, 1, 3]),  # (> 0: with prefix caching)
        interval=st.integers(1, 3),
    )
    def make_manager(
        self,
        num_blocks: int,
        block_size: int,
        num_state_slots: int,
        num_state_checkpoints: int,
        interval: int,
    ) -> None:
        self.kv = KVCacheManager(
            num_blocks=num_blocks, block_size=block_size,
            enable_prefix_caching=num_state_checkpoints > 0, num_state_slots=num_state_slots,
            num_state_checkpoints=num_state_checkpoints, state_checkpoint_interval=interval,
        )  # fmt: skip
        self.num_slots = num_state_slots

    def snapshot(self) -> tuple[object, ...]:
        return (
            self.kv.num_free_blocks,
            self.kv.num_free_state_slots,
            {r: self.kv.state_slot(r) for r in self.tokens},
            {r: self.kv.num_computed_tokens(r) for r in self.tokens},
        )

    def allocate(self, request: str, num_new: int, hit: object = None) -> bool:
        """A step of num_new tokens, as the model runner runs it: a prefix hit's state
        loaded from its checkpoint, the slot's state going on from its computed tokens
        (zeros where none), then the forks' copies and the checkpoints' saves."""
        before = self.snapshot()
        first = self.kv.num_computed_tokens(request)
        if hit is not None:
            first = hit.num_computed_tokens  # type: ignore[attr-defined]
        if self.kv.allocate_slots(request, num_new, 0, hit) is None:
            assert self.snapshot() == before, "a failed allocation changed the manager"
            return False
        slot = self.kv.state_slot(request)
        assert slot >= 0, "a request that computes tokens holds no state slot"
        for source, destination in self.kv.take_pending_state_loads():
            self.states[destination] = self.states[source]
        if first > 0:
            assert self.states[slot] == tuple(self.tokens[request][:first]), (
                "a step resumed from a state that is not its request's"
            )
        self.states[slot] = tuple(self.tokens[request][: first + num_new])
        self.run_copies()
        return True

    def run_copies(self) -> None:
        for source, destination in self.kv.take_pending_state_copies():
            self.states[destination] = self.states[source]

    @rule(target=requests, prompt=tokens_st, data=st.data())
    def add_request(self, prompt: list[int], data: st.DataObject) -> str:
        request = f"r{self.next_id}"
        self.next_id += 1
        self.kv.add_request(request, prompt)
        self.tokens[request] = list(prompt)
        assert self.kv.state_slot(request) == -1  # (taken at the first allocation)
        hit = self.kv.get_computed_blocks(request)
        assert (hit.state_checkpoint >= self.num_slots) == (hit.num_computed_tokens > 0)
        remaining = len(prompt) - hit.num_computed_tokens
        self.allocate(request, data.draw(st.integers(1, remaining), label="first chunk"), hit)
        return request

    @rule(request=requests, data=st.data())
    def step(self, request: str, data: st.DataObject) -> None:
        """One more prefill chunk, or a decode step with a sampled token."""
        if request not in self.tokens:
            return
        known, computed = len(self.tokens[request]), self.kv.num_computed_tokens(request)
        if computed == known:
            token = data.draw(st.integers(0, 2), label="sampled")
            self.kv.append_token_ids(request, [token])
            self.tokens[request].append(token)
            known += 1
        self.allocate(request, data.draw(st.integers(1, known - computed), label="num_new"))

    @rule(request=consumes(requests), data=st.data())
    def preempt_in_its_step(self, request: str, data: st.DataObject) -> None:
        """Scheduled, then preempted in the same step (as the scheduler preempts a request
        it scheduled before): its step's tokens taken back, then freed. The step's copies
        still run, from a slot it did not write: what they fill must never be read."""
        if request not in self.tokens:
            return
        known, computed = len(self.tokens[request]), self.kv.num_computed_tokens(request)
        if computed == known:
            return
        num_new = data.draw(st.integers(1, known - computed), label="num_new")
        if self.kv.allocate_slots(request, num_new) is None:
            return
        self.kv.rollback(request, computed)
        for _, destination in self.kv.take_pending_state_copies():
            self.states[destination] = ("not written",)  # type: ignore[assignment]
        self.kv.free(request)
        del self.tokens[request]

    @rule(target=requests, request=requests)
    def fork(self, request: str) -> object:
        """A parallel sample: its own slot, its parent's state copied into it."""
        if request not in self.tokens:
            return multiple()
        child = f"r{self.next_id}"
        self.next_id += 1
        before = self.snapshot()
        try:
            self.kv.fork(request, child)
        except RuntimeError as error:  # (InvalidState: no slot free)
            assert "no recurrent-state slot is free" in str(error)
            assert self.snapshot() == before, "a failed fork changed the manager"
            return multiple()
        self.tokens[child] = list(self.tokens[request])
        self.run_copies()
        return child

    @rule(request=consumes(requests))
    def free(self, request: str) -> None:
        """A finished request, or one preempted by recompute (it would start again with
        no computed tokens, from zeros)."""
        if request in self.tokens:
            self.kv.free(request)
            del self.tokens[request]

    @invariant()
    def slots_are_owned_once_and_hold_their_requests_state(self) -> None:
        if not hasattr(self, "kv"):
            return
        held = {}
        for request, tokens in self.tokens.items():
            slot, computed = self.kv.state_slot(request), self.kv.num_computed_tokens(request)
            if computed == 0:
                assert slot == -1
                continue
            assert 0 <= slot < self.num_slots and slot not in held, "a slot is shared"
            held[slot] = request
            assert self.states[slot] == tuple(tokens[:computed])
        assert self.kv.num_free_state_slots == self.num_slots - len(held)

    def teardown(self) -> None:
        if hasattr(self, "kv"):
            for request in list(self.tokens):
                self.kv.free(request)
            assert self.kv.num_free_state_slots == self.num_slots
            assert self.kv.num_free_blocks == self.kv.num_blocks


TestStateSlots = StateSlotMachine.TestCase
TestStateSlots.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)  # fmt: skip
