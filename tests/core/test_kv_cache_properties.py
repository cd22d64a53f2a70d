"""Property tests of the KV-cache manager over random sequences of operations.

A shadow model records, for every slot of every physical block, which prefix's KV the
model runner would have written there (the tokens up to and including that position,
and the extra keys). That gives the real correctness property: every computed position
of every live request, whether computed by itself, taken from the prefix cache or
shared through fork, holds the KV of exactly its own prefix; with a host tier, the same
holds of blocks brought back from it (prefix hits there, swapped-out requests). Around it: reference
counts equal the number of tables holding a block, free blocks have count 0 and are
in the free queue once, the hash index holds only cached blocks, a failed allocation
changes nothing, and nothing leaks once every request is freed.
"""

from __future__ import annotations

from collections import Counter

from helpers.kv_shadow import run_copies
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    consumes,
    initialize,
    invariant,
    multiple,
    precondition,
    rule,
)

from pyengine import KVCacheManager

# A tiny vocabulary makes shared prefixes, and so prefix hits, common.
tokens_st = st.lists(st.integers(0, 2), min_size=1, max_size=14)
extras_st = st.sampled_from([(0, ""), (0, "tenant-b"), (7, "")])

Slot = tuple[tuple[int, str], tuple[int, ...]]  # (extras, prefix tokens)


class KVCacheMachine(RuleBasedStateMachine):
    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.next_id = 0
        self.tokens: dict[str, list[int]] = {}
        self.extras: dict[str, tuple[int, str]] = {}
        self.slots: dict[int, dict[int, Slot]] = {}  # block -> offset -> what it holds
        self.host_slots: dict[int, dict[int, Slot]] = {}  # the host tier's

    @initialize(
        num_blocks=st.integers(1, 12),
        block_size=st.sampled_from([1, 2, 4]),
        num_host_blocks=st.sampled_from([0, 0, 1, 4, 16]),
    )
    def make_manager(self, num_blocks: int, block_size: int, num_host_blocks: int) -> None:
        self.kv = KVCacheManager(
            num_blocks=num_blocks,
            block_size=block_size,
            enable_prefix_caching=True,
            num_host_blocks=num_host_blocks,
        )
        self.block_size = block_size

    # ---- helpers ------------------------------------------------------------------

    def snapshot(self) -> tuple[object, ...]:
        s = self.kv.stats()
        tables = {r: self.kv.block_table(r) for r in self.tokens}
        computed = {r: self.kv.num_computed_tokens(r) for r in self.tokens}
        return (
            s.num_free_blocks,
            s.num_cached_blocks,
            s.num_evictions,
            s.num_host_used_blocks,
            s.num_host_cached_blocks,
            tables,
            computed,
            self.kv.pool.free_blocks_in_order(),
        )

    def slot_of(self, request: str, position: int) -> tuple[int, int]:
        table = self.kv.block_table(request)
        return table[position // self.block_size], position % self.block_size

    def expected(self, request: str, position: int) -> Slot:
        return self.extras[request], tuple(self.tokens[request][: position + 1])

    def run_step(self, request: str, first: int, end: int) -> None:
        """What the model runner does after a successful allocation: copy-on-write
        copies (between the tiers, then copy-on-write) first, then the KV of positions
        [first, end) is written."""
        self.run_copies()
        for p in range(first, end):
            block, offset = self.slot_of(request, p)
            self.slots.setdefault(block, {})[offset] = self.expected(request, p)

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
        assert self.kv.num_computed_tokens(request) == first + num_new
        assert not self.kv.is_swapped(request)
        self.run_step(request, first, first + num_new)
        return True

    def fork_as(self, request: str, child: str) -> None:
        self.kv.fork(request, child)
        self.tokens[child] = list(self.tokens[request])
        self.extras[child] = self.extras[request]
        assert self.kv.block_table(child) == self.kv.block_table(request)

    # ---- rules --------------------------------------------------------------------

    @rule(target=requests, prompt=tokens_st, extras=extras_st, data=st.data())
    def add_request(self, prompt: list[int], extras: tuple[int, str], data: st.DataObject) -> str:
        request = f"r{self.next_id}"
        self.next_id += 1
        self.kv.add_request(request, prompt, adapter_id=extras[0], cache_salt=extras[1])
        self.tokens[request] = list(prompt)
        self.extras[request] = extras
        hit = self.kv.get_computed_blocks(request)
        num_hit = len(hit.block_ids) + len(hit.host_block_ids)
        assert hit.num_computed_tokens == num_hit * self.block_size
        assert hit.num_host_tokens == len(hit.host_block_ids) * self.block_size
        assert hit.num_computed_tokens < len(prompt)
        host = self.kv.host_pool
        hits = [(self.kv.pool, self.slots, b) for b in hit.block_ids]
        hits += [(host, self.host_slots, b) for b in hit.host_block_ids]
        for i, (pool, slots, block) in enumerate(hits):
            start = i * self.block_size
            assert pool.stored_tokens(block) == prompt[start : start + self.block_size]
            for offset in range(self.block_size):
                assert slots[block][offset] == self.expected(request, start + offset), (
                    "a prefix hit served KV computed for another prefix"
                )
        remaining = len(prompt) - hit.num_computed_tokens
        chunk = data.draw(st.integers(1, remaining), label="first chunk")
        self.allocate(request, chunk, 0, hit)
        return request

    @rule(request=requests, data=st.data())
    def step(self, request: str, data: st.DataObject) -> None:
        """One more prefill chunk, or one decode step with a sampled token."""
        if request not in self.tokens:
            return
        known = len(self.tokens[request])
        computed = self.kv.num_computed_tokens(request)
        if computed == known and self.kv.is_swapped(request):  # (no fork while out)
            return
        if computed == known:
            token = data.draw(st.integers(0, 2), label="sampled")
            self.kv.append_token_ids(request, [token])
            self.tokens[request].append(token)
            known += 1
        num_new = data.draw(st.integers(1, known - computed), label="num_new_tokens")
        lookahead = data.draw(st.integers(0, 3), label="num_lookahead")
        self.allocate(request, num_new, lookahead)

    @precondition(lambda self: len(self.tokens) > 0)
    @rule(target=requests, request=requests)
    def fork(self, request: str) -> object:
        if request not in self.tokens or self.kv.is_swapped(request):
            return multiple()
        child = f"r{self.next_id}"
        self.next_id += 1
        self.fork_as(request, child)
        return child

    @rule(request=requests, tokens=st.tuples(st.integers(0, 2), st.integers(0, 2)))
    def fork_and_diverge(self, request: str, tokens: tuple[int, int]) -> None:
        """Parallel samples: fork, then parent and child each decode their own token."""
        if (
            request not in self.tokens
            or self.kv.is_swapped(request)
            or self.kv.num_computed_tokens(request) != len(self.tokens[request])
        ):
            return
        child = f"r{self.next_id}"
        self.next_id += 1
        self.fork_as(request, child)
        for r, token in zip((request, child), tokens, strict=True):
            self.kv.append_token_ids(r, [token])
            self.tokens[r].append(token)
            self.allocate(r, 1, 0)
        self.kv.free(child)
        del self.tokens[child], self.extras[child]

    @rule(request=requests, data=st.data())
    def swap_out_and_in(self, request: str, data: st.DataObject) -> None:
        """Preemption by swapping: out to the host tier, maybe other work, then back."""
        if request not in self.tokens or not self.kv.block_table(request):
            return
        can = self.kv.can_swap_out(request)
        host_free = self.kv.host_pool.num_free_blocks if self.kv.host_pool else 0
        assert can == (host_free >= len(self.kv.block_table(request)))
        if not can:
            return
        computed = self.kv.num_computed_tokens(request)
        self.kv.swap_out(request)
        self.run_copies()
        assert self.kv.is_swapped(request) and not self.kv.block_table(request)
        assert self.kv.num_computed_tokens(request) == computed
        if data.draw(st.booleans(), label="back now"):
            self.step(request, data)  # (it may not fit: then it stays out)

    @rule(request=consumes(requests))
    def free(self, request: str) -> None:
        if request not in self.tokens:
            return
        self.kv.free(request)
        del self.tokens[request], self.extras[request]

    @rule()
    def reset_prefix_cache(self) -> None:
        idle = all(not self.kv.block_table(r) and not self.kv.is_swapped(r) for r in self.tokens)
        assert self.kv.reset_prefix_cache() == idle
        if idle:
            assert self.kv.pool.num_cached_blocks == 0
            assert self.kv.host_pool is None or self.kv.host_pool.num_cached_blocks == 0

    # ---- invariants ---------------------------------------------------------------

    @invariant()
    def reference_counts_match_tables(self) -> None:
        pool = self.kv.pool
        held = Counter(b for r in self.tokens for b in self.kv.block_table(r))
        free_order = pool.free_blocks_in_order()
        assert len(free_order) == len(set(free_order)) == pool.num_free_blocks
        for block in range(pool.num_blocks):
            assert pool.ref_count(block) == held[block]
            assert pool.is_free(block) == (held[block] == 0)
        assert set(free_order) == {b for b in range(pool.num_blocks) if held[b] == 0}
        assert self.kv.stats().num_used_blocks == len(held) <= pool.num_blocks

    @invariant()
    def index_holds_only_cached_blocks(self) -> None:
        pool = self.kv.pool
        cached = [b for b in range(pool.num_blocks) if pool.is_cached(b)]
        assert len(cached) == pool.num_cached_blocks
        for block in cached:
            assert pool.lookup(*pool.key(block)) == block
        for block in range(pool.num_blocks):
            if not pool.is_cached(block):
                assert pool.key(block) == (0, 0)

    @invariant()
    def the_host_tier_holds_only_swapped_out_requests(self) -> None:
        host = self.kv.host_pool
        if host is None:
            return
        swapped = [r for r in self.tokens if self.kv.is_swapped(r)]
        held = sum(host.ref_count(b) for b in range(host.num_blocks))
        s = self.kv.stats()
        assert held == s.num_host_used_blocks == host.num_blocks - host.num_free_blocks
        assert s.num_swapped_requests == len(swapped)
        for block in range(host.num_blocks):
            if host.is_cached(block):
                assert host.lookup(*host.key(block)) == block

    @invariant()
    def every_request_sees_its_own_kv(self) -> None:
        for request in self.tokens:
            if self.kv.is_swapped(request):
                continue
            for p in range(self.kv.num_computed_tokens(request)):
                block, offset = self.slot_of(request, p)
                assert self.slots[block][offset] == self.expected(request, p)

    def teardown(self) -> None:
        if not hasattr(self, "kv"):
            return
        for request in list(self.tokens):
            self.kv.free(request)
        assert self.kv.num_free_blocks == self.kv.pool.num_blocks, "blocks leaked"
        assert self.kv.stats().num_host_used_blocks == 0, "host blocks leaked"
        assert self.kv.stats().internal_waste_tokens == 0


KVCacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
test_kv_cache_manager_properties = KVCacheMachine.TestCase
