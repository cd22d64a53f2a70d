"""The builds of the CPU's packed-weight kernels (`_C.set_quantized_dense_isa`) that
this CPU runs, for tests that run in each; for the bfloat16-panel and int8 kernels also
"amx", the AVX-512 build with blocks of rows on AMX's tile unit (`_C.set_amx_tiles`),
where the CPU has it."""

from __future__ import annotations

from collections.abc import Iterator

from pyengine import _C

ISAS = [isa for isa in ("generic", "avx2", "avx512") if _C.cpu_supports(isa)]
AMX = _C.split_gemm_supported()  # (AMX with bfloat16, allowed by the OS)
TILE_ISAS = ISAS + (["amx"] if AMX else [])


def pin_dense_isa(isa: str) -> None:
    """The kernels pinned to `isa` (one of TILE_ISAS): "amx" alone uses the tile unit."""
    _C.set_amx_tiles(isa == "amx")
    _C.set_quantized_dense_isa("avx512" if isa == "amx" else isa)


def unpin_dense_isa() -> None:
    """Back to the widest build, the tile unit where the CPU has it."""
    _C.set_quantized_dense_isa("auto")
    _C.set_amx_tiles(AMX)


def pinned_dense_isa(isa: str) -> Iterator[str]:
    """A fixture's body: the kernels pinned to `isa` while the test runs, then back to
    the widest build."""
    pin_dense_isa(isa)
    yield isa
    unpin_dense_isa()
