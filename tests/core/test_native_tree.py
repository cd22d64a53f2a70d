"""The layout of the native tree (docs/architecture.md, "Layout"), read from the sources
without building them: no two headers share a name, cuda/'s headers are included by
folder, cuda/ reaches into cpp/ only through the public headers, and no target needs
cuda/ or cpp/src/core on its include path to find a CUDA header."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SOURCES = ("*.h", "*.cuh", "*.inc", "*.cpp", "*.cu")
QUOTED_INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.MULTILINE)


def files(folder: str, patterns: tuple[str, ...] = SOURCES) -> list[Path]:
    return sorted(p for pattern in patterns for p in (REPO / folder).rglob(pattern))


def includes(path: Path) -> list[str]:
    return QUOTED_INCLUDE.findall(path.read_text())


def test_no_two_headers_share_a_name() -> None:
    headers = files("cpp", ("*.h", "*.cuh")) + files("cuda", ("*.h", "*.cuh"))
    names = Counter(h.name for h in headers)
    assert [name for name, count in names.items() if count > 1] == []


def test_cuda_headers_are_included_by_folder() -> None:
    cuda_headers = {h.name for h in files("cuda", ("*.h", "*.cuh"))}
    bare = [
        f"{path.relative_to(REPO)}: {name}"
        for path in files("cpp") + files("cuda")
        for name in includes(path)
        if name in cuda_headers
    ]
    assert bare == []
    for path in files("cpp") + files("cuda"):
        for name in includes(path):
            if name.startswith("cuda/"):
                assert (REPO / name).is_file(), f"{path.relative_to(REPO)} includes {name}"


def test_cuda_reaches_into_cpp_only_through_public_headers() -> None:
    public = REPO / "cpp" / "include"
    for path in files("cuda"):
        for name in includes(path):
            assert name.startswith(("cuda/", "pyengine/")), f"{path.name} includes {name}"
            if name.startswith("pyengine/"):
                assert (public / name).is_file(), f"{path.name} includes {name}"


def test_no_target_finds_cuda_headers_through_cuda_or_core_folders() -> None:
    for cmake in (REPO / "CMakeLists.txt", REPO / "cpp" / "tests" / "CMakeLists.txt"):
        text = cmake.read_text()
        for call in re.findall(r"target_include_directories\(([^)]*)\)", text):
            folders = re.findall(r"\$\{\w+\}(/[\w/]*)?", call)
            assert "/cuda" not in folders, f"{cmake.name}: {call}"
            assert "/cpp/src/core" not in folders, f"{cmake.name}: {call}"
            if call.split()[0] == "pyengine_cuda":  # cpp/ only through its public headers
                assert set(folders) <= {"", "/cpp/include"}, f"{cmake.name}: {call}"
