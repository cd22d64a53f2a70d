"""The builds of the CPU's packed-weight kernels (`_C.set_quantized_dense_isa`) that
this CPU runs, for tests that run in each."""

from __future__ import annotations

from collections.abc import Iterator

from pyengine import _C

ISAS = [isa for isa in ("generic", "avx2", "avx512") if _C.cpu_supports(isa)]


def pinned_dense_isa(isa: str) -> Iterator[str]:
    """A fixture's body: the kernels pinned to `isa` while the test runs, then back to
    the widest build."""
    _C.set_quantized_dense_isa(isa)
    yield isa
    _C.set_quantized_dense_isa("auto")
