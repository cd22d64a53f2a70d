"""A registry's entry by name, as the command line's options choose one."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TypeVar

T = TypeVar("T")


def make_named(registry: Mapping[str, Callable[[], T]], name: str, option: str) -> T:
    """A new instance of the registry's entry `name`; ValueError naming `option` and the
    entries there are."""
    make = registry.get(name)
    if make is None:
        raise ValueError(f"{option} {name!r} is not one of {', '.join(sorted(registry))}")
    return make()
