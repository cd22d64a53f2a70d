"""Host memory on transparent huge pages (pyengine.utils.host_memory)."""

from __future__ import annotations

import gc
import re
from pathlib import Path

import pytest
import torch

from pyengine.utils import host_memory
from pyengine.utils.host_memory import (
    ALIGNMENT,
    HUGE_PAGE_BYTES,
    HugePageArena,
    huge_page_arena,
    huge_page_tensor,
)

needs_mmap = pytest.mark.skipif(
    not host_memory.huge_pages_available(), reason="no anonymous mmap with MADV_HUGEPAGE"
)


def _thp_mode() -> str | None:
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    if not path.exists():
        return None
    match = re.search(r"\[(\w+)\]", path.read_text())
    return match.group(1) if match else None


def _mapping_of(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping that holds address."""
    fields: dict[str, str] = {}
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = re.match(r"^([0-9a-f]+)-([0-9a-f]+) ", line)
        if head:
            inside = int(head.group(1), 16) <= address < int(head.group(2), 16)
        elif inside and ":" in line:
            key, value = line.split(":", 1)
            fields[key] = value.strip()
    return fields


@needs_mmap
def test_huge_page_tensor_is_zeroed_writable_and_advised() -> None:
    t = huge_page_tensor(3 * HUGE_PAGE_BYTES // 4 + 5, torch.float32)
    assert t.dtype == torch.float32 and t.shape == (3 * HUGE_PAGE_BYTES // 4 + 5,)
    assert not t.any()
    t.fill_(2.5)
    assert float(t.sum()) == 2.5 * t.numel()
    if _thp_mode() in ("madvise", "always") and Path("/proc/self/smaps").exists():
        fields = _mapping_of(t.data_ptr())
        assert fields.get("THPeligible") == "1", fields


@needs_mmap
def test_arena_slices_are_aligned_disjoint_and_typed() -> None:
    arena = HugePageArena(chunk_bytes=HUGE_PAGE_BYTES)
    sizes = [(1000, torch.float32), (3, torch.uint8), (4097, torch.int8), (77, torch.float32)]
    tensors = [arena.empty(n, dtype) for n, dtype in sizes]
    for (n, dtype), t in zip(sizes, tensors, strict=True):
        assert t.shape == (n,) and t.dtype == dtype
        assert t.data_ptr() % ALIGNMENT == 0
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in tensors)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:], strict=False))
    # The first chunk starts on a 2 MB boundary, so its pages can all be huge.
    assert tensors[0].data_ptr() % HUGE_PAGE_BYTES == 0
    for i, t in enumerate(tensors):
        t.fill_(i + 1)
    for i, t in enumerate(tensors):
        assert bool((t == i + 1).all())


@needs_mmap
def test_arena_opens_a_new_chunk_and_maps_large_tensors_alone() -> None:
    arena = HugePageArena(chunk_bytes=HUGE_PAGE_BYTES)
    first = arena.empty(HUGE_PAGE_BYTES // 2, torch.uint8)
    second = arena.empty(HUGE_PAGE_BYTES // 2 - 10, torch.uint8)  # fits the first chunk
    third = arena.empty(64, torch.uint8)  # does not: a new chunk
    assert second.data_ptr() == first.data_ptr() + HUGE_PAGE_BYTES // 2
    assert third.data_ptr() % HUGE_PAGE_BYTES == 0
    large = arena.empty(HUGE_PAGE_BYTES, torch.uint8)  # over half a chunk: its own mapping
    assert not large.any()
    after = arena.empty(8, torch.uint8)  # the chunk in use is unchanged
    assert after.data_ptr() == third.data_ptr() + ALIGNMENT


@needs_mmap
def test_a_slice_keeps_its_chunk_alive() -> None:
    arena = HugePageArena(chunk_bytes=HUGE_PAGE_BYTES)
    kept = arena.empty(1024, torch.float32)
    kept.fill_(7.0)
    del arena
    gc.collect()
    assert bool((kept == 7.0).all())


def test_empty_tensors() -> None:
    assert huge_page_tensor(0, torch.float32).shape == (0,)
    assert HugePageArena().empty(0, torch.int8).shape == (0,)
    with huge_page_arena():
        assert host_memory.empty(0).shape == (0,)


def test_arena_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError, match="numel"):
        huge_page_tensor(-1, torch.float32)
    with pytest.raises(ValueError, match="chunk_bytes"):
        HugePageArena(chunk_bytes=HUGE_PAGE_BYTES + 1)
    with pytest.raises(ValueError, match="numel"):
        HugePageArena().empty(-1, torch.float32)


def test_empty_uses_the_active_arena_only_inside_the_block() -> None:
    outside = host_memory.empty(16)
    assert outside.shape == (16,) and outside.dtype == torch.float32
    with huge_page_arena(chunk_bytes=HUGE_PAGE_BYTES) as arena:
        a = host_memory.empty(16, torch.int8)
        b = host_memory.empty(16, torch.int8)
        assert a.dtype == torch.int8
        if host_memory.huge_pages_available():
            assert b.data_ptr() == a.data_ptr() + ALIGNMENT
            assert isinstance(arena, HugePageArena)
    assert host_memory._active_arena.get() is None


def test_packed_model_weights_live_on_arena_chunks() -> None:
    """process_weights_after_loading packs every weight inside one arena: neighbouring
    weights share 2 MB-aligned chunks rather than scattered small allocations."""
    from pyengine.layers.linear import (
        ColumnParallelLinear,
        LayerContext,
        process_weights_after_loading,
    )
    from pyengine.layers.placement import Placement
    from pyengine.layers.vocab_embedding import ParallelLMHead, VocabParallelEmbedding

    ctx = LayerContext()
    model = torch.nn.Module()
    model.embed_tokens = VocabParallelEmbedding(64, 32, ctx)
    model.proj = ColumnParallelLinear(32, [48], False, ctx, ["proj.weight"])
    model.head = ParallelLMHead(64, 32, ctx, ["embed_tokens.weight"], tied_to=model.embed_tokens)
    weight, embeddings = torch.randn(48, 32), torch.randn(64, 32)
    with torch.no_grad():
        model.embed_tokens.weight_loader("embed_tokens.weight", embeddings)
        model.proj.weight_loader("proj.weight", "weight", weight)
    process_weights_after_loading(model, Placement())
    proj, head = model.proj, model.head
    assert proj.method_state.panels is not None and head.method_state.panels is not None
    x = torch.randn(3, 32)
    torch.testing.assert_close(proj(x), x @ weight.T)
    torch.testing.assert_close(head(x), x @ embeddings.T)
    if host_memory.huge_pages_available():
        gap = abs(head.method_state.panels.data_ptr() - proj.method_state.panels.data_ptr())
        assert gap < HUGE_PAGE_BYTES  # cut from the same chunk
