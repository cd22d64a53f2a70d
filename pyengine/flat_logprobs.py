"""A sample's logprobs as flat arrays (as vLLM's FlatLogprobs): per position, the token
ids, logprobs and ranks of its entries (the chosen token's first, then the top-k), 12
bytes an entry, where a list of dicts of Logprob objects costs some hundred. A position's
dict is built only where it is read. The arrays only grow: an output's slice of them is
a view, so that neither a step's delta nor a whole output copies what came before."""

from __future__ import annotations

from array import array
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, overload

from pyengine.outputs import Logprob, PositionLogprobs


class _Store:
    """The arrays, append-only: entry j's token, logprob and rank; starts[p] is position
    p's first entry (one more than the positions: the end)."""

    def __init__(self) -> None:
        self.token_ids = array("i")
        self.logprobs = array("f")  # (the sampler's float32 values, exactly)
        self.ranks = array("i")
        self.starts = array("q", [0])

    @property
    def num_positions(self) -> int:
        return len(self.starts) - 1


class FlatLogprobs(Sequence[PositionLogprobs]):
    """Positions [begin, end) of a store; `token_text` fills each Logprob's decoded_token
    as it is read (None: left None)."""

    __slots__ = ("_store", "_begin", "_end", "token_text")

    def __init__(self, token_text: Callable[[int], str] | None = None) -> None:
        self._store = _Store()
        self._begin = self._end = 0
        self.token_text = token_text

    def _view(self, begin: int, end: int) -> FlatLogprobs:
        view = FlatLogprobs.__new__(FlatLogprobs)
        view._store, view._begin, view._end, view.token_text = (
            self._store,
            begin,
            end,
            self.token_text,
        )
        return view

    def append(self, position: Mapping[int, Logprob], chosen: int) -> None:
        """Adds a position: the chosen token's entry first, then the others'."""
        if self._end != self._store.num_positions:  # (a view of earlier positions: its own)
            self._own()
        store = self._store
        tokens = [chosen, *(t for t in position if t != chosen)]
        store.token_ids.extend(tokens)
        store.logprobs.extend(position[t].logprob for t in tokens)
        store.ranks.extend(position[t].rank for t in tokens)
        store.starts.append(len(store.token_ids))
        self._end += 1

    def _own(self) -> None:
        """Its positions copied into a store of its own (before appending to a view that
        ends before its store does)."""
        old, first, last = (
            self._store,
            self._store.starts[self._begin],
            self._store.starts[self._end],
        )
        store = _Store()
        store.token_ids = old.token_ids[first:last]
        store.logprobs = old.logprobs[first:last]
        store.ranks = old.ranks[first:last]
        store.starts = array("q", (s - first for s in old.starts[self._begin : self._end + 1]))
        self._store, self._begin, self._end = store, 0, self._end - self._begin

    def __len__(self) -> int:
        return self._end - self._begin

    @overload
    def __getitem__(self, index: int) -> PositionLogprobs: ...

    @overload
    def __getitem__(self, index: slice) -> FlatLogprobs: ...

    def __getitem__(self, index: int | slice) -> PositionLogprobs | FlatLogprobs:
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("FlatLogprobs takes slices of step 1")
            return self._view(self._begin + start, self._begin + max(start, stop))
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("FlatLogprobs index out of range")
        store, p = self._store, self._begin + index
        text = self.token_text
        return {
            store.token_ids[j]: Logprob(
                store.logprobs[j],
                store.ranks[j],
                None if text is None else text(store.token_ids[j]),
            )
            for j in range(store.starts[p], store.starts[p + 1])
        }

    def __iter__(self) -> Iterator[PositionLogprobs]:
        return (self[i] for i in range(len(self)))

    def chosen_logprobs(self) -> list[float]:
        """Each position's chosen token's logprob (its first entry), without the dicts."""
        store = self._store
        return [store.logprobs[store.starts[p]] for p in range(self._begin, self._end)]

    def __iadd__(self, other: Sequence[PositionLogprobs]) -> FlatLogprobs:
        if isinstance(other, FlatLogprobs) and not len(self):
            self._store, self._begin, self._end = other._store, other._begin, other._end
            self.token_text = other.token_text  # (a view of the same positions)
            return self
        if (
            isinstance(other, FlatLogprobs)
            and other._store is self._store
            and other._begin == self._end
        ):
            self._end = other._end  # (the positions that follow: the view grows)
            return self
        for position in other:
            self.append(position, next(iter(position)))  # (the chosen token's entry first)
        return self

    def __add__(self, other: Sequence[PositionLogprobs]) -> FlatLogprobs:
        joined = self[:]
        joined += other
        return joined

    def __radd__(self, other: Sequence[PositionLogprobs]) -> list[PositionLogprobs]:
        return [*other, *self]

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"FlatLogprobs({list(self)!r})"

    def __reduce__(self) -> tuple[Any, ...]:
        """Pickled as its positions (its token_text is not: a tokenizer's method)."""
        return _rebuilt, (list(self),)


def _rebuilt(positions: list[PositionLogprobs]) -> FlatLogprobs:
    flat = FlatLogprobs()
    flat += positions
    return flat
