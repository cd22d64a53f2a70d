"""A pure-Python KV-cache manager: the peer that bench.kv_cache measures the C++ one against.

Written the way vLLM v1's Python block pool and KV cache manager are: block objects in a
hand-made doubly linked free queue (O(1) removal from the middle on a prefix hit), a dict
from block hash to block as the prefix index, reference counts, LRU eviction, and the
newly full blocks of a request cached in allocate_slots. Block hashes are vLLM's:
sha256 over the pickled (parent hash, block token ids, extra keys).

Its public methods and semantics are those of ``pyengine.KVCacheManager`` (without fork /
copy-on-write, which the benchmark does not use), so that both make the same decisions on
the same workload. Three deliberate matches with the C++ manager where vLLM differs:
never-cached free blocks are handed out before cached ones are evicted (two free queues
instead of one), most recently freed first; and a hit is verified against the stored token
ids, the parent block and (for a first block) the extra keys, not trusted on the hash alone.
"""

from __future__ import annotations

import hashlib
import pickle
from collections.abc import Sequence
from dataclasses import dataclass, field

ExtraKeys = tuple[int, str] | None

# The parent hash of a request's first block.
ROOT_HASH = hashlib.sha256(b"pyengine").digest()


def hash_block_tokens(
    parent_hash: bytes, block_token_ids: Sequence[int], extra_keys: ExtraKeys
) -> bytes:
    """vLLM's block hash: sha256 of the pickled (parent hash, tokens, extra keys)."""
    data = pickle.dumps((parent_hash, tuple(block_token_ids), extra_keys), pickle.HIGHEST_PROTOCOL)
    return hashlib.sha256(data).digest()


def hash_full_blocks(
    token_ids: Sequence[int], block_size: int, extra_keys: ExtraKeys, parent_hash: bytes = ROOT_HASH
) -> list[bytes]:
    """Chained hashes of the full blocks of ``token_ids`` (a trailing partial block gets none)."""
    hashes = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent_hash = hash_block_tokens(
            parent_hash, token_ids[start : start + block_size], extra_keys
        )
        hashes.append(parent_hash)
    return hashes


@dataclass(eq=False, slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    # Set while the block is in the prefix index; `generation` changes on every eviction,
    # so a child's (parent, parent_generation) link stops verifying.
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    parent: KVCacheBlock | None = None
    parent_generation: int = 0
    extra_keys: ExtraKeys = None
    generation: int = 0
    # Free-queue links; None while the block is in use.
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks between two sentinels, as in vLLM.

    A hand-made list rather than a deque: a prefix hit takes a block out of the middle in
    O(1). Blocks are taken from the front. A freed cached block is appended (the front is
    the least recently freed: LRU eviction); a freed uncached one goes to the front, so
    the most recently freed is reused first, as pyengine's BlockPool does (its pages are
    committed and likely still in the CPU's caches).
    """

    def __init__(self) -> None:
        self.head = KVCacheBlock(-1)
        self.tail = KVCacheBlock(-1)
        self.head.next_free = self.tail
        self.tail.prev_free = self.head
        self.num_free_blocks = 0

    def append(self, block: KVCacheBlock) -> None:
        last = self.tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self.tail
        self.tail.prev_free = block
        self.num_free_blocks += 1

    def appendleft(self, block: KVCacheBlock) -> None:
        first = self.head.next_free
        assert first is not None
        first.prev_free = block
        block.next_free = first
        block.prev_free = self.head
        self.head.next_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        assert prev is not None and nxt is not None, "block is not in a free queue"
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def popleft(self) -> KVCacheBlock:
        block = self.head.next_free
        assert block is not None and block is not self.tail, "no free block"
        self.remove(block)
        return block


@dataclass(slots=True)
class GroupHit:
    first_block: int = 0  # earlier blocks lie outside the group's window
    block_ids: list[int] = field(default_factory=list)
    parent: tuple[KVCacheBlock, int] | None = None  # the chain's block before, its generation


@dataclass(slots=True)
class ComputedBlocks:
    groups: list[GroupHit] = field(default_factory=list)
    num_computed_tokens: int = 0

    @property
    def block_ids(self) -> list[int]:
        return self.groups[0].block_ids if self.groups else []


@dataclass(slots=True)
class _Table:
    """A request's blocks of one KV-cache group."""

    blocks: list[KVCacheBlock | None] = field(default_factory=list)  # None: released
    num_released: int = 0  # leading entries that are None
    num_cached: int = 0
    cached_tail: tuple[KVCacheBlock, int] | None = None  # block num_cached - 1, its generation


@dataclass(slots=True)
class _Request:
    token_ids: list[int]
    extra_keys: ExtraKeys
    tables: list[_Table]
    block_hashes: list[list[bytes]]  # per group, of the full blocks of token_ids
    num_computed_tokens: int = 0
    state_slot: int = -1  # the recurrent-state slot (-1: none)


def first_visible(group: tuple[str, int], position: int) -> int:
    """The first position a query at `position` sees in a group of this kind."""
    kind, size = group
    if kind == "sliding":
        return max(0, position - size + 1)
    if kind == "chunked":
        return position - position % size
    return 0


class PyKVCacheManager:
    """Per-request block tables (one per KV-cache group) over a pool of blocks, with
    verified prefix caching."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        kv_groups: list[tuple[str, int]] | None = None,
        num_state_slots: int = 0,
    ):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if block_size <= 0 or block_size & (block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.groups = list(kv_groups or [("full", 0)])
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.uncached_free = FreeKVCacheBlockQueue()  # taken first
        self.cached_free = FreeKVCacheBlockQueue()  # then evicted, least recently freed first
        for block in self.blocks:
            self.uncached_free.append(block)
        self.cached_block_hash_to_block: dict[bytes, KVCacheBlock] = {}
        self.requests: dict[str, _Request] = {}
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.num_evictions = 0
        # Recurrent-state slots: one a request from its first allocation (lowest first).
        if num_state_slots and enable_prefix_caching:
            raise ValueError("prefix caching with recurrent-state slots needs checkpoints")
        self.num_state_slots = num_state_slots
        self.free_state_slots = list(range(num_state_slots - 1, -1, -1))

    @property
    def num_free_blocks(self) -> int:
        return self.uncached_free.num_free_blocks + self.cached_free.num_free_blocks

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        adapter_id: int = 0,
        cache_salt: str = "",
    ) -> None:
        if not prompt_token_ids:
            raise ValueError("add_request: the prompt is empty")
        if min(prompt_token_ids) < 0:
            raise ValueError("add_request: negative token id")
        if request_id in self.requests:
            raise ValueError(f"add_request: request id {request_id!r} already exists")
        extra_keys = (adapter_id, cache_salt) if adapter_id or cache_salt else None
        request = _Request(
            list(prompt_token_ids), extra_keys, [_Table() for _ in self.groups],
            [[] for _ in self.groups],
        )  # fmt: skip
        self._extend_block_hashes(request)
        self.requests[request_id] = request

    def append_token_ids(self, request_id: str, token_ids: Sequence[int]) -> None:
        request = self.requests[request_id]
        if token_ids and min(token_ids) < 0:
            raise ValueError("append_token_ids: negative token id")
        request.token_ids.extend(token_ids)

    def block_table(self, request_id: str, group: int = 0) -> list[int]:
        """A group's block ids, -1 where a window released a block."""
        blocks = self.requests[request_id].tables[group].blocks
        return [-1 if b is None else b.block_id for b in blocks]

    def get_computed_blocks(self, request_id: str) -> ComputedBlocks:
        """The longest prefix every group's chain verifies, never all tokens; changes only
        the statistics. Each group takes the hit's blocks its window still needs."""
        request = self.requests[request_id]
        if any(t.blocks for t in request.tables):
            raise RuntimeError(f"get_computed_blocks: request {request_id!r} already has blocks")
        computed = ComputedBlocks()
        if not self.enable_prefix_caching:
            return computed
        self._extend_block_hashes(request)
        size, tokens = self.block_size, request.token_ids
        n = (len(tokens) - 1) // size
        chains: list[list[KVCacheBlock]] = []
        for g in range(len(self.groups)):
            chain: list[KVCacheBlock] = []
            parent: KVCacheBlock | None = None
            for i in range(n):
                block = self.cached_block_hash_to_block.get(request.block_hashes[g][i])
                link = None if parent is None else (parent, parent.generation)
                if block is None or not self._verify(
                    block, tokens[i * size : (i + 1) * size], link, request, g
                ):
                    break
                chain.append(block)
                parent = block
            n = len(chain)
            chains.append(chain)
        computed.num_computed_tokens = n * size
        for group, chain in zip(self.groups, chains, strict=True):
            first = first_visible(group, n * size) // size
            parent_link = (chain[first - 1], chain[first - 1].generation) if first else None
            computed.groups.append(
                GroupHit(first, [b.block_id for b in chain[first:n]], parent_link)
            )
        self.prefix_cache_queries += len(tokens)
        self.prefix_cache_hits += computed.num_computed_tokens
        return computed

    def allocate_slots(
        self,
        request_id: str,
        num_new_tokens: int,
        num_lookahead: int = 0,
        computed: ComputedBlocks | None = None,
    ) -> list[int] | None:
        """Schedules the next known tokens (+ lookahead); group 0's new block ids, or None
        (nothing changed) if too few blocks are free. A window's group first releases the
        blocks its step's queries cannot see."""
        request = self.requests[request_id]
        if num_new_tokens <= 0:
            raise ValueError("allocate_slots: num_new_tokens must be positive")
        if num_lookahead < 0:
            raise ValueError("allocate_slots: num_lookahead must be non-negative")
        size = self.block_size
        has_hit = computed is not None and computed.num_computed_tokens > 0
        num_hit = num_free_hits = 0
        if has_hit:
            assert computed is not None
            if any(t.blocks for t in request.tables):
                raise ValueError("allocate_slots: computed blocks are for a first allocation")
            num_hit = computed.num_computed_tokens // size
            if computed.num_computed_tokens % size or len(computed.groups) != len(self.groups):
                raise ValueError("allocate_slots: computed blocks do not match the request")
            for g, hit in enumerate(computed.groups):
                for i, block_id in enumerate(hit.block_ids, start=hit.first_block):
                    block = self.blocks[block_id]
                    if block.block_hash != request.block_hashes[g][i]:
                        raise ValueError(f"allocate_slots: computed block {block_id} is stale")
                    num_free_hits += block.ref_cnt == 0
        first_new_token = computed.num_computed_tokens if has_hit else request.num_computed_tokens  # type: ignore[union-attr]
        end = first_new_token + num_new_tokens
        if end > len(request.token_ids):
            raise ValueError(f"allocate_slots: only {len(request.token_ids)} tokens are known")
        num_blocks_needed = -(-(end + num_lookahead) // size)
        first_needed = [first_visible(g, first_new_token) // size for g in self.groups]
        num_new = [
            max(0, num_blocks_needed - (num_hit if has_hit else len(table.blocks)))
            for table in request.tables
        ]
        num_released = sum(
            block is not None and block.ref_cnt == 1
            for table, first in zip(request.tables, first_needed, strict=True)
            for block in table.blocks[table.num_released : first]
        )
        if sum(num_new) + num_free_hits > self.num_free_blocks + num_released:
            return None
        if self.num_state_slots and request.state_slot < 0:
            if not self.free_state_slots:
                return None
            request.state_slot = self.free_state_slots.pop()

        for table, first in zip(request.tables, first_needed, strict=True):
            self._release_before(table, first)
        if has_hit:
            assert computed is not None
            for table, hit in zip(request.tables, computed.groups, strict=True):
                hits = [self.blocks[b] for b in hit.block_ids]
                for block in hits:
                    self._retain(block)
                table.blocks = [None] * hit.first_block + hits  # type: ignore[operator]
                table.num_released = hit.first_block
                table.num_cached = num_hit
                last = table.blocks[-1] if num_hit > hit.first_block else None
                table.cached_tail = hit.parent if last is None else (last, last.generation)
        new_blocks: list[list[int]] = []
        for table, count in zip(request.tables, num_new, strict=True):
            blocks = [self._allocate_block() for _ in range(count)]
            table.blocks += blocks
            new_blocks.append([block.block_id for block in blocks])
        request.num_computed_tokens = end
        self._cache_full_blocks(request)
        return new_blocks[0]

    def free(self, request_id: str) -> None:
        """Releases the blocks, group after group, each last first (prompt heads are
        evicted last); forgets the request."""
        request = self.requests.pop(request_id)
        for table in request.tables:
            for block in reversed(table.blocks):
                if block is not None:
                    self._release(block)
        if request.state_slot >= 0:
            self.free_state_slots.append(request.state_slot)

    def state_slot(self, request_id: str) -> int:
        return self.requests[request_id].state_slot

    # Internals.

    def _release(self, block: KVCacheBlock) -> None:
        block.ref_cnt -= 1
        if block.ref_cnt == 0:
            if block.block_hash is not None:
                self.cached_free.append(block)
            else:
                self.uncached_free.appendleft(block)

    def _release_before(self, table: _Table, first_needed: int) -> None:
        end = min(first_needed, len(table.blocks))
        for i in range(end - 1, table.num_released - 1, -1):
            block = table.blocks[i]
            if block is not None:
                self._release(block)
                table.blocks[i] = None
        table.num_released = max(table.num_released, end)

    def _extend_block_hashes(self, request: _Request) -> None:
        if not self.enable_prefix_caching:
            return
        size = self.block_size
        for g, hashes in enumerate(request.block_hashes):
            have = len(hashes)
            if (len(request.token_ids) // size) > have:
                parent = hashes[-1] if have else ROOT_HASH
                new_tokens = request.token_ids[have * size :]
                # (the group in the extra keys: each group's blocks have their own hashes)
                extra = request.extra_keys if g == 0 else (request.extra_keys, g)
                hashes += hash_full_blocks(new_tokens, size, extra, parent)  # type: ignore[arg-type]

    def _verify(
        self,
        block: KVCacheBlock,
        tokens: list[int],
        parent: tuple[KVCacheBlock, int] | None,
        request: _Request,
        group: int,
    ) -> bool:
        if block.token_ids != tuple(tokens):
            return False
        if parent is None:
            return block.parent is None and block.extra_keys == (request.extra_keys, group)
        return block.parent is parent[0] and block.parent_generation == parent[1]

    def _retain(self, block: KVCacheBlock) -> None:
        if block.ref_cnt == 0:
            (self.cached_free if block.block_hash is not None else self.uncached_free).remove(block)
        block.ref_cnt += 1

    def _allocate_block(self) -> KVCacheBlock:
        if self.uncached_free.num_free_blocks:
            block = self.uncached_free.popleft()
        else:
            block = self.cached_free.popleft()
            self._evict(block)
        block.ref_cnt = 1
        return block

    def _evict(self, block: KVCacheBlock) -> None:
        assert block.block_hash is not None
        del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        block.token_ids = ()
        block.parent = None
        block.extra_keys = None
        block.generation += 1
        self.num_evictions += 1

    def _cache_full_blocks(self, request: _Request) -> None:
        if not self.enable_prefix_caching:
            return
        self._extend_block_hashes(request)
        size = self.block_size
        num_full = request.num_computed_tokens // size
        for g, table in enumerate(request.tables):
            while table.num_cached < num_full:
                i = table.num_cached
                block, block_hash = table.blocks[i], request.block_hashes[g][i]
                if block is None:
                    break  # released uncached: later ones stay uncached too
                if block.block_hash is not None:
                    assert block.block_hash == block_hash, "a block's hash is written once"
                elif block_hash in self.cached_block_hash_to_block:
                    break  # another block caches this prefix; later ones stay uncached too
                else:
                    tail = table.cached_tail if i else None
                    block.block_hash = block_hash
                    block.token_ids = tuple(request.token_ids[i * size : (i + 1) * size])
                    block.parent = tail[0] if tail is not None else None
                    block.parent_generation = tail[1] if tail is not None else 0
                    block.extra_keys = (request.extra_keys, g) if tail is None else None
                    self.cached_block_hash_to_block[block_hash] = block
                table.cached_tail = (block, block.generation)
                table.num_cached += 1
