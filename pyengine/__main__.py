"""`python -m pyengine`: with --includes, --libs, --cmakedir or --pkgconfigdir, where the
C API's files lie (as pybind11's own flags say where its are):

    cc app.c $(python -m pyengine --includes) $(python -m pyengine --libs)
    cmake -Dpyengine_DIR=$(python -m pyengine --cmakedir) ...

otherwise the command line (`python -m pyengine serve ...`, as `pyengine serve ...`)."""

from __future__ import annotations

import sys
from collections.abc import Callable

from pyengine.capi import files
from pyengine.entrypoints.cli import main

_FLAGS: dict[str, Callable[[], str]] = {
    "--includes": files.compiler_flags,
    "--libs": files.linker_flags,
    "--cmakedir": lambda: str(files.cmake_dir()),
    "--pkgconfigdir": lambda: str(files.pkgconfig_dir()),
}

if __name__ == "__main__":
    asked = [a for a in sys.argv[1:] if a in _FLAGS]
    if asked:
        unknown = [a for a in sys.argv[1:] if a not in _FLAGS]
        if unknown:
            sys.exit(f"python -m pyengine: {unknown[0]} does not go with {asked[0]}")
        print(" ".join(_FLAGS[a]() for a in asked))
    else:
        main()
