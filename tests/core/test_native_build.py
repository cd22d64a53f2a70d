"""The C++ side on its own: ctest, and a C++ program that embeds the installed library.

Builds pyengine_core without Python in a temporary folder (ninja and ccache keep this
short), runs the C++ tests, installs headers, library and CMake package, then builds
and runs cpp/examples against the installed package through find_package(pyengine).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [
    pytest.mark.slow,  # a CMake build of the C++ library and its tests
    pytest.mark.skipif(shutil.which("cmake") is None, reason="cmake is not installed"),
]


def run(*args: str | Path, cwd: Path | None = None) -> str:
    result = subprocess.run(
        [str(a) for a in args], cwd=cwd, capture_output=True, text=True, timeout=900
    )
    assert result.returncode == 0, (
        f"{' '.join(map(str, args))} failed:\n{result.stdout}\n{result.stderr}"
    )
    return result.stdout


def generator() -> list[str]:
    return ["-G", "Ninja"] if shutil.which("ninja") else []


@pytest.fixture(scope="module")
def core_build(tmp_path_factory: pytest.TempPathFactory) -> Path:
    build = tmp_path_factory.mktemp("core-build")
    run(
        "cmake",
        "-S",
        REPO,
        "-B",
        build,
        *generator(),
        "-DPYENGINE_BUILD_TESTS=ON",
        "-DPYENGINE_CUDA=off",
        "-DCMAKE_BUILD_TYPE=Release",
    )
    run("cmake", "--build", build, "--parallel", "2")
    return build


def test_ctest_passes(core_build: Path) -> None:
    out = run("ctest", "--test-dir", core_build, "--output-on-failure")
    assert "100% tests passed" in out


def test_example_embeds_the_installed_package(core_build: Path, tmp_path: Path) -> None:
    prefix = tmp_path / "prefix"
    run("cmake", "--install", core_build, "--prefix", prefix)
    for header in ("pyengine.h", "version.h", "kv_cache_manager.h"):
        assert (prefix / "include" / "pyengine" / header).is_file(), header
    example_build = tmp_path / "example"
    run(
        "cmake",
        "-S",
        REPO / "cpp" / "examples",
        "-B",
        example_build,
        *generator(),
        f"-DCMAKE_PREFIX_PATH={prefix}",
    )
    run("cmake", "--build", example_build)
    out = run(example_build / "kv_cache_demo")
    version = re.search(r'^version = "(.+)"$', (REPO / "pyproject.toml").read_text(), re.M)
    assert version is not None
    assert f"pyengine {version[1]}\n" in out  # version.h, from CMake's project(VERSION)
    assert "chat-b   prefix hit: 32 of 43 tokens" in out
    assert "chat-b.1 block_table = [0, 1, 4]" in out
    assert "after free: 32 free blocks" in out
    # The C API's examples build from the same package; its library lies outside an
    # installed pyengine, so it runs the Python that PYENGINE_PYTHON names.
    stream = example_build / "stream_completion"
    alone = subprocess.run([stream, "Hello"], capture_output=True, text=True, timeout=60)
    assert alone.returncode == 1
    assert "not inside an installed pyengine package" in alone.stderr
    from pyengine.loader.resolve import default_model_path

    try:
        default_model_path()
    except FileNotFoundError as error:
        pytest.skip(f"the C API's run: {error}")
    named = subprocess.run(
        [stream, "--max-tokens", "4", "Hello"], capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYENGINE_PYTHON": sys.executable},
    )  # fmt: skip
    assert named.returncode == 0 and named.stdout.strip(), named.stderr
