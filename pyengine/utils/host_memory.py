"""Host memory on transparent huge pages, for what the CPU kernels stream every step.

A decode step reads every packed weight once and the K/V of every running request, in
4 KB tiles from wherever their blocks lie. On 4 KB pages many of those reads also miss
the TLB; on 2 MB pages they do not. Linux backs an anonymous mapping with huge pages
where it is advised to (transparent huge pages in "madvise" or "always" mode), as its
pages are first touched. Attention over a scattered KV pool gains most; the decode
matmuls, which stream in order, little (docs/benchmarks.md has the measurements).

Example::

    with huge_page_arena():
        packed = empty(numel, torch.float32)  # a slice of a shared 2 MB-aligned mapping
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch

HUGE_PAGE_BYTES = 2 << 20
ALIGNMENT = 64  # bytes: each arena tensor starts on a cache line
ARENA_CHUNK_BYTES = 32 << 20


def release_free_heap() -> None:
    """Returns the heap's free memory to the OS (glibc's malloc_trim; elsewhere nothing).
    Loading frees many tensors of a few MB, which glibc, its mmap threshold raised by the
    first such free, takes from the heap and keeps: up to a few hundred MB resident for
    nothing once the model is built."""
    trim = getattr(_libc(), "malloc_trim", None)
    if trim is not None:
        trim(0)


@functools.cache  # (find_library runs ldconfig)
def _libc() -> ctypes.CDLL | None:
    name = ctypes.util.find_library("c")
    return ctypes.CDLL(name, use_errno=True) if name else None


def decommit(t: torch.Tensor) -> None:
    """Gives the pages wholly within CPU tensor t's storage back to the OS (madvise
    MADV_DONTNEED): private anonymous memory, such as huge_page_tensor's, then reads as
    zeros again and is committed anew where it is next written. For memory whose values
    may all be zeros; a no-op where madvise is unavailable."""
    storage = t.untyped_storage()
    start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, end // page * page
    madvise = getattr(_libc(), "madvise", None)
    if last <= first or madvise is None or not hasattr(mmap, "MADV_DONTNEED"):
        return
    madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    if madvise(first, last - first, mmap.MADV_DONTNEED) != 0:
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed")


def huge_pages_available() -> bool:
    """Whether this Python can map anonymous memory and advise huge pages for it."""
    return hasattr(mmap, "MAP_ANONYMOUS") and hasattr(mmap, "MADV_HUGEPAGE")


def huge_page_tensor(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor of numel elements in its own anonymous mapping, advised
    for huge pages (torch.zeros where that is unavailable). The mapping is released when
    the tensor and every view of it are gone."""
    if numel < 0:
        raise ValueError(f"numel must be non-negative, got {numel}")
    if numel == 0 or not huge_pages_available():
        return torch.zeros(numel, dtype=dtype)
    size = numel * dtype.itemsize
    buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    buffer.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(buffer, dtype=dtype, count=numel)  # keeps buffer alive


class HugePageArena:
    """Hands out CPU tensors as slices of shared huge-page mappings, so that weights of a
    few MB each still lie on whole 2 MB pages: each chunk of ARENA_CHUNK_BYTES starts on
    a 2 MB boundary, and a tensor larger than half a chunk gets a mapping of its own.
    A chunk lives as long as any tensor cut from it."""

    def __init__(self, chunk_bytes: int = ARENA_CHUNK_BYTES) -> None:
        if chunk_bytes <= 0 or chunk_bytes % HUGE_PAGE_BYTES != 0:
            raise ValueError(f"chunk_bytes must be a positive multiple of 2 MiB, got {chunk_bytes}")
        self.chunk_bytes = chunk_bytes
        self._chunk: torch.Tensor | None = None  # uint8, 2 MB-aligned
        self._used = 0

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized [numel] tensor (zero where its memory is fresh)."""
        if numel < 0:
            raise ValueError(f"numel must be non-negative, got {numel}")
        size = numel * dtype.itemsize
        if size > self.chunk_bytes // 2:
            return huge_page_tensor(numel, dtype)
        start = -(-self._used // ALIGNMENT) * ALIGNMENT
        if self._chunk is None or start + size > self.chunk_bytes:
            self._chunk = _aligned_chunk(self.chunk_bytes)
            start = 0
        self._used = start + size
        return self._chunk[start : start + size].view(dtype)


_active_arena: ContextVar[HugePageArena | None] = ContextVar("pyengine_arena", default=None)


@contextmanager
def huge_page_arena(chunk_bytes: int = ARENA_CHUNK_BYTES) -> Iterator[HugePageArena]:
    """Within the block, empty() allocates from one new HugePageArena."""
    arena = HugePageArena(chunk_bytes)
    token = _active_arena.set(arena)
    try:
        yield arena
    finally:
        _active_arena.reset(token)


def empty(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialized CPU [numel] tensor: from the active huge_page_arena, else
    torch.empty."""
    arena = _active_arena.get()
    if arena is None or not huge_pages_available():
        return torch.empty(numel, dtype=dtype)
    return arena.empty(numel, dtype)


def _aligned_chunk(size: int) -> torch.Tensor:
    whole = huge_page_tensor(size + HUGE_PAGE_BYTES, torch.uint8)
    skip = -whole.data_ptr() % HUGE_PAGE_BYTES
    return whole[skip : skip + size]
