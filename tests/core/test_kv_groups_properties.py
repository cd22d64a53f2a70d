"""Property tests of the KV-cache manager with mixed KV-cache groups (full attention,
sliding windows, chunked local attention) over random sequences of operations.

The shadow model records, for every slot of every physical block, which group's KV of
which prefix the model runner would have written there. After every operation, each
live request's every group must hold, at every position its next query can read (from
the first position the group lets a query at num_computed_tokens see), the KV of
exactly its own prefix written for that group, whether computed by itself, taken from
the prefix cache (in either tier), shared through fork or swapped out and back. A window's
group holds no block before that position once an allocation has run, so its blocks per
request stay bounded by the window; reference counts equal the tables holding a block;
a failed allocation changes nothing; nothing leaks once every request is freed.
"""

from __future__ import annotations

from collections import Counter

from helpers.attention import first_visible as first_of
from helpers.kv_shadow import run_copies
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    rule,
)

from pyengine import KVCacheManager

tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=16)
group_st = st.one_of(
    st.just(("full", 0)),
    st.tuples(st.just("sliding"), st.integers(1, 6)),
    st.tuples(st.just("chunked"), st.sampled_from([2, 3, 4, 8])),
)
groups_st = st.lists(group_st, min_size=1, max_size=3)

Slot = tuple[int, str, tuple[int, ...]]  # (group, cache salt, prefix tokens)


def first_visible(group: tuple[str, int], position: int) -> int:
    """The first position a query at `position` sees in a group of this kind."""
    kind, size = group
    return first_of(position, size if kind == "sliding" else 0, size if kind == "chunked" else 0)


class KVGroupsMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.next_id = 0
        self.tokens: dict[str, list[int]] = {}
        self.salts: dict[str, str] = {}
        self.slots: dict[int, dict[int, Slot]] = {}
        self.host_slots: dict[int, dict[int, Slot]] = {}

    @initialize(
        groups=groups_st,
        num_blocks=st.integers(4, 24),
        block_size=st.sampled_from([1, 2, 4]),
        num_host_blocks=st.sampled_from([0, 0, 4, 16]),
    )
    def make_manager(
        self, groups: list[tuple[str, int]], num_blocks: int, block_size: int, num_host_blocks: int
    ) -> None:
        self.groups = groups
        self.kv = KVCacheManager(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=True,
            num_host_blocks=num_host_blocks,
            kv_groups=groups,
        )
        self.block_size = block_size
        assert self.kv.num_groups == len(groups)

    # ---- helpers ------------------------------------------------------------------

    def tables(self, request: str) -> list[list[int]]:
        return [self.kv.block_table(request, g) for g in range(len(self.groups))]

    def snapshot(self) -> tuple[object, ...]:
        s = self.kv.stats()
        return (
            s.num_free_blocks,
            s.num_cached_blocks,
            s.num_evictions,
            s.num_host_used_blocks,
            {r: self.tables(r) for r in self.tokens},
            {r: self.kv.num_computed_tokens(r) for r in self.tokens},
            self.kv.pool.free_blocks_in_order(),
        )

    def expected(self, request: str, group: int, position: int) -> Slot:
        return group, self.salts[request], tuple(self.tokens[request][: position + 1])

    def run_copies(self) -> None:
        run_copies(self.kv, self.slots, self.host_slots)

    def allocate(self, request: str, num_new: int, lookahead: int, computed: object = None) -> bool:
        before = self.snapshot()
        first = self.kv.num_computed_tokens(request)
        if computed is not None:
            first = computed.num_computed_tokens  # type: ignore[attr-defined]
        can = self.kv.can_allocate_slots(request, num_new, lookahead, computed)
        new_blocks = self.kv.allocate_slots(request, num_new, lookahead, computed)
        assert can == (new_blocks is not None)
        if new_blocks is None:
            assert self.snapshot() == before, "a failed allocation changed the manager"
            return False
        self.run_copies()
        end = first + num_new
        size = self.block_size
        for g, table in enumerate(self.tables(request)):
            for p in range(first, end):  # the step's K/V written into each group's blocks
                self.slots.setdefault(table[p // size], {})[p % size] = self.expected(request, g, p)
            kept = first_visible(self.groups[g], first) // size
            assert all(b == -1 for b in table[:kept]), "a window kept a block no query reads"
            assert all(b >= 0 for b in table[kept:]), "a block a query reads was released"
            needed = -(-(end + lookahead) // size)
            assert len(table) >= needed
            kind, window = self.groups[g]
            if kind != "full" and num_new == 1 and lookahead == 0:  # a decode step
                assert needed - kept <= -(-window // size) + 1
        return True

    # ---- rules --------------------------------------------------------------------

    @rule(target=requests, prompt=tokens_st, salt=st.sampled_from(["", "b"]), data=st.data())
    def add_request(self, prompt: list[int], salt: str, data: st.DataObject) -> str:
        request = f"r{self.next_id}"
        self.next_id += 1
        self.kv.add_request(request, prompt, cache_salt=salt)
        self.tokens[request], self.salts[request] = list(prompt), salt
        hit = self.kv.get_computed_blocks(request)
        n = hit.num_computed_tokens
        assert n % self.block_size == 0 and n < len(prompt)
        size = self.block_size
        for g, part in enumerate(hit.groups):
            assert part.first_block == first_visible(self.groups[g], n) // size
            pools = [(self.slots, b) for b in part.block_ids]
            pools += [(self.host_slots, b) for b in part.host_block_ids]
            assert len(pools) == n // size - part.first_block
            for i, (slots, block) in enumerate(pools):
                start = (part.first_block + i) * size
                for offset in range(size):
                    assert slots[block][offset] == self.expected(request, g, start + offset), (
                        "a prefix hit served KV computed for another prefix or group"
                    )
        chunk = data.draw(st.integers(1, len(prompt) - n), label="first chunk")
        self.allocate(request, chunk, 0, hit)
        return request

    @rule(request=requests, data=st.data())
    def step(self, request: str, data: st.DataObject) -> None:
        """One more prefill chunk, or one decode step with a sampled token."""
        if request not in self.tokens:
            return
        known = len(self.tokens[request])
        computed = self.kv.num_computed_tokens(request)
        if computed == known and self.kv.is_swapped(request):
            return
        if computed == known:
            token = data.draw(st.integers(0, 2), label="sampled")
            self.kv.append_token_ids(request, [token])
            self.tokens[request].append(token)
            known += 1
        num_new = data.draw(st.integers(1, known - computed), label="num_new_tokens")
        lookahead = data.draw(st.integers(0, 2), label="num_lookahead")
        self.allocate(request, num_new, lookahead)

    @rule(request=requests, data=st.data())
    def rollback(self, request: str, data: st.DataObject) -> None:
        """Rejected drafts or a cancelled step: back to a count its held blocks serve."""
        if request not in self.tokens or self.kv.is_swapped(request):
            return
        computed = self.kv.num_computed_tokens(request)
        target = data.draw(st.integers(max(0, computed - 3), computed), label="rollback to")
        tables = self.tables(request)
        serves = all(
            all(b >= 0 for b in table[first_visible(group, target) // self.block_size :])
            for group, table in zip(self.groups, tables, strict=True)
        )
        shared = any(
            self.kv.pool.ref_count(b) > 1
            for table in tables
            for b in table[target // self.block_size :]
            if b >= 0
        )
        try:
            self.kv.rollback(request, target)
        except ValueError:
            assert not serves or shared
            return
        assert serves

    @rule(target=requests, request=requests)
    def fork(self, request: str) -> str:
        if request not in self.tokens or self.kv.is_swapped(request):
            return request
        child = f"r{self.next_id}"
        self.next_id += 1
        self.kv.fork(request, child)
        self.tokens[child], self.salts[child] = list(self.tokens[request]), self.salts[request]
        assert self.tables(child) == self.tables(request)
        return child

    @rule(request=requests, data=st.data())
    def swap_out_and_in(self, request: str, data: st.DataObject) -> None:
        if request not in self.tokens or self.kv.is_swapped(request):
            return
        held = sum(b >= 0 for table in self.tables(request) for b in table)
        host_free = self.kv.host_pool.num_free_blocks if self.kv.host_pool else 0
        can = self.kv.can_swap_out(request)
        assert can == (held > 0 and host_free >= held)
        if not can:
            return
        computed = self.kv.num_computed_tokens(request)
        self.kv.swap_out(request)
        self.run_copies()
        assert self.kv.is_swapped(request) and self.kv.num_computed_tokens(request) == computed
        if data.draw(st.booleans(), label="back now"):
            self.step(request, data)

    @rule(request=consumes(requests))
    def free(self, request: str) -> None:
        if request not in self.tokens:
            return
        self.kv.free(request)
        del self.tokens[request], self.salts[request]

    # ---- invariants ---------------------------------------------------------------

    @invariant()
    def reference_counts_match_tables(self) -> None:
        pool = self.kv.pool
        held = Counter(b for r in self.tokens for table in self.tables(r) for b in table if b >= 0)
        for block in range(pool.num_blocks):
            assert pool.ref_count(block) == held[block]
        assert pool.num_free_blocks == pool.num_blocks - len(held)

    @invariant()
    def every_readable_position_holds_its_own_kv(self) -> None:
        size = self.block_size
        for request in self.tokens:
            if self.kv.is_swapped(request):
                continue
            computed = self.kv.num_computed_tokens(request)
            for g, table in enumerate(self.tables(request)):
                for p in range(first_visible(self.groups[g], computed), computed):
                    block = table[p // size]
                    assert block >= 0, "a block the next query reads was released"
                    assert self.slots[block][p % size] == self.expected(request, g, p)

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for request in list(self.tokens):
            self.kv.free(request)
        assert self.kv.num_free_blocks == self.kv.pool.num_blocks, "blocks leaked"
        assert self.kv.stats().num_host_used_blocks == 0, "host blocks leaked"


KVGroupsMachine.TestCase.settings = settings(
    max_examples=150,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_kv_groups_properties = KVGroupsMachine.TestCase
