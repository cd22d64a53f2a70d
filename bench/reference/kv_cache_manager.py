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
class ComputedBlocks:
    block_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0


@dataclass(slots=True)
class _Request:
    token_ids: list[int]
    extra_keys: ExtraKeys
    block_table: list[KVCacheBlock] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # of the full blocks of token_ids
    num_computed_tokens: int = 0
    num_cached_blocks: int = 0  # leading entries of block_table in the prefix index


class PyKVCacheManager:
    """Per-request block tables over a pool of blocks, with verified prefix caching."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True):
        if num_blocks <= 0:
            raise ValueError("num_blocks must be positive")
        if block_size <= 0 or block_size & (block_size - 1):
            raise ValueError("block_size must be a positive power of two")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
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
        request = _Request(list(prompt_token_ids), extra_keys)
        self._extend_block_hashes(request)
        self.requests[request_id] = request

    def append_token_ids(self, request_id: str, token_ids: Sequence[int]) -> None:
        request = self.requests[request_id]
        if token_ids and min(token_ids) < 0:
            raise ValueError("append_token_ids: negative token id")
        request.token_ids.extend(token_ids)

    def get_computed_blocks(self, request_id: str) -> ComputedBlocks:
        """The longest verified cached prefix, never all tokens; changes only the statistics."""
        request = self.requests[request_id]
        if request.block_table:
            raise RuntimeError(f"get_computed_blocks: request {request_id!r} already has blocks")
        computed = ComputedBlocks()
        if not self.enable_prefix_caching:
            return computed
        self._extend_block_hashes(request)
        size, tokens = self.block_size, request.token_ids
        parent: KVCacheBlock | None = None
        for i in range((len(tokens) - 1) // size):
            block = self.cached_block_hash_to_block.get(request.block_hashes[i])
            if block is None or not self._verify(
                block, tokens[i * size : (i + 1) * size], parent, request
            ):
                break
            computed.block_ids.append(block.block_id)
            parent = block
        computed.num_computed_tokens = len(computed.block_ids) * size
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
        """Schedules the next known tokens (+ lookahead); new block ids, or None if too few free."""
        request = self.requests[request_id]
        if num_new_tokens <= 0:
            raise ValueError("allocate_slots: num_new_tokens must be positive")
        if num_lookahead < 0:
            raise ValueError("allocate_slots: num_lookahead must be non-negative")
        hits: list[KVCacheBlock] = []
        num_free_hits = 0
        first_new_token = request.num_computed_tokens
        if computed is not None and computed.block_ids:
            num_hit = len(computed.block_ids)
            if request.block_table:
                raise ValueError("allocate_slots: computed blocks are for a first allocation")
            if computed.num_computed_tokens != num_hit * self.block_size:
                raise ValueError("allocate_slots: computed blocks do not match the request")
            for i, block_id in enumerate(computed.block_ids):
                block = self.blocks[block_id]
                if i >= len(request.block_hashes) or block.block_hash != request.block_hashes[i]:
                    raise ValueError(f"allocate_slots: computed block {block_id} is stale")
                num_free_hits += block.ref_cnt == 0
                hits.append(block)
            first_new_token = computed.num_computed_tokens
        end = first_new_token + num_new_tokens
        if end > len(request.token_ids):
            raise ValueError(f"allocate_slots: only {len(request.token_ids)} tokens are known")
        num_blocks_needed = -(-(end + num_lookahead) // self.block_size)
        num_new_blocks = max(0, num_blocks_needed - len(request.block_table) - len(hits))
        if num_new_blocks + num_free_hits > self.num_free_blocks:
            return None

        for block in hits:
            self._retain(block)
        if hits:
            request.block_table.extend(hits)
            request.num_cached_blocks = len(hits)
        new_blocks = [self._allocate_block() for _ in range(num_new_blocks)]
        request.block_table.extend(new_blocks)
        request.num_computed_tokens = end
        self._cache_full_blocks(request)
        return [block.block_id for block in new_blocks]

    def free(self, request_id: str) -> None:
        """Releases the blocks, last first (prompt heads are evicted last); forgets the request."""
        request = self.requests.pop(request_id)
        for block in reversed(request.block_table):
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.cached_free.append(block)
                else:
                    self.uncached_free.appendleft(block)

    # Internals.

    def _extend_block_hashes(self, request: _Request) -> None:
        if not self.enable_prefix_caching:
            return
        have, size = len(request.block_hashes), self.block_size
        if (len(request.token_ids) // size) > have:
            parent = request.block_hashes[-1] if have else ROOT_HASH
            new_tokens = request.token_ids[have * size :]
            request.block_hashes += hash_full_blocks(new_tokens, size, request.extra_keys, parent)

    def _verify(
        self, block: KVCacheBlock, tokens: list[int], parent: KVCacheBlock | None, request: _Request
    ) -> bool:
        if block.parent is not parent or block.token_ids != tuple(tokens):
            return False
        if parent is not None:
            return block.parent_generation == parent.generation
        return block.extra_keys == request.extra_keys

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
        while request.num_cached_blocks < num_full:
            i = request.num_cached_blocks
            block, block_hash = request.block_table[i], request.block_hashes[i]
            if block.block_hash is not None:
                assert block.block_hash == block_hash, "a block's hash is written once"
            elif block_hash in self.cached_block_hash_to_block:
                break  # another block caches this prefix; later ones stay uncached too
            else:
                parent = request.block_table[i - 1] if i else None
                block.block_hash = block_hash
                block.token_ids = tuple(request.token_ids[i * size : (i + 1) * size])
                block.parent = parent
                block.parent_generation = parent.generation if parent is not None else 0
                block.extra_keys = request.extra_keys if parent is None else None
                self.cached_block_hash_to_block[block_hash] = block
            request.num_cached_blocks += 1
