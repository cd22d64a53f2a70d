"""Fixtures for the core tests: the repository's bench/ package, for its pure-Python
reference implementations (bench/reference/) and its benchmarks' seeded workloads."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def import_bench() -> ModuleType:
    """bench/ imported from its files, by path: the repository root is not put on sys.path
    (its pyengine/ is the source tree, without the compiled _C, and would shadow the
    installed package), yet bench's modules import each other as a package."""
    loaded = sys.modules.get("bench")
    if loaded is not None:
        if Path(loaded.__file__ or "").resolve() != BENCH / "__init__.py":
            raise RuntimeError(f"another module named bench is imported: {loaded.__file__}")
        return loaded
    spec = importlib.util.spec_from_file_location(
        "bench", BENCH / "__init__.py", submodule_search_locations=[str(BENCH)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["bench"] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules["bench"]
        raise
    return module


@pytest.fixture(scope="session")
def bench_module() -> Callable[[str], ModuleType]:
    """bench_module("reference.scheduler") is bench/reference/scheduler.py, imported."""
    import_bench()
    return lambda name: importlib.import_module(f"bench.{name}")
