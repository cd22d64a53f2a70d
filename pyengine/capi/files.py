"""Where the wheel put the C API's files (headers, libpyengine, the CMake package and
pkg-config's file): beside the compiled extension, in the installed package (which, for
an editable install, is not where the package's Python files are)."""

from __future__ import annotations

from pathlib import Path

from pyengine import _C


def package_dir() -> Path:
    return Path(_C.__file__).resolve().parent


def include_dir() -> Path:
    return package_dir() / "include"


def library_dir() -> Path:
    return package_dir() / "lib"


def library() -> Path:
    return library_dir() / "libpyengine.so"


def cmake_dir() -> Path:
    return library_dir() / "cmake" / "pyengine"


def pkgconfig_dir() -> Path:
    return library_dir() / "pkgconfig"


def compiler_flags() -> str:
    return f"-I{include_dir()}"


def linker_flags() -> str:
    lib = library_dir()
    return f"-L{lib} -Wl,-rpath,{lib} -lpyengine"
