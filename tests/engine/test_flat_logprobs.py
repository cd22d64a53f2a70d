"""FlatLogprobs, a sample's logprobs as flat arrays: positions read back as the dicts they
were given (the chosen token first, decoded as read), slices are views that later
appends leave as they are, deltas join without copying, and an entry costs 12 bytes."""

from __future__ import annotations

import pickle
import random

from pyengine.flat_logprobs import FlatLogprobs
from pyengine.outputs import Logprob, PositionLogprobs


def position(rng: random.Random, k: int) -> tuple[PositionLogprobs, int]:
    """A position as the sampler gives it: the chosen token's entry, then the top k's."""
    chosen = rng.randrange(1000)
    # (multiples of 1/1024: float32 holds them exactly, as the sampler's float32 values)
    entry = {chosen: Logprob(-rng.randrange(4096) / 1024, rng.randrange(1, 50))}
    for rank in range(1, k + 1):
        entry.setdefault(rng.randrange(1000), Logprob(-rank * 0.5, rank))
    return entry, chosen


def text(token: int) -> str:
    return f"<{token}>"


def test_positions_read_back_decoded_and_views_stay_put() -> None:
    rng = random.Random(0)
    given = [position(rng, k % 4) for k in range(50)]
    flat = FlatLogprobs(text)
    for entry, chosen in given[:30]:
        flat.append(entry, chosen)
    early = flat[:]  # a whole output of 30 positions, as CUMULATIVE hands it out
    delta = flat[25:]
    for entry, chosen in given[30:]:
        flat.append(entry, chosen)
    decoded = [{t: Logprob(lp.logprob, lp.rank, text(t)) for t, lp in e.items()} for e, _ in given]
    assert list(flat) == decoded and flat == decoded
    assert len(early) == 30 and early == decoded[:30] and delta == decoded[25:30]
    assert [next(iter(p)) for p in flat] == [chosen for _, chosen in given]
    chosen = [c for _, c in given]
    assert flat.chosen_logprobs() == [p[c].logprob for p, c in zip(decoded, chosen, strict=True)]
    assert flat[-1] == decoded[-1] and flat[10:20][3] == decoded[13]


def test_deltas_join_without_copying_and_a_view_appended_to_is_its_own() -> None:
    rng = random.Random(1)
    flat = FlatLogprobs()
    for _ in range(10):
        flat.append(*position(rng, 3))
    first, second = flat[0:4], flat[4:10]
    joined = FlatLogprobs()
    joined += first  # (adopts the view)
    joined += second  # (contiguous: the view grows)
    assert joined == list(flat) and joined._store is flat._store
    entry, chosen = position(rng, 2)
    first.append(entry, chosen)  # a view ending before its store: copied first
    assert first._store is not flat._store and len(first) == 5 and first[4] == entry
    assert flat[4] == second[0] and len(flat) == 10  # the original is untouched
    assert (list(flat[:2]) + flat[2:4]) == list(flat)[:4]  # (a list plus it: a list)


def test_an_entry_costs_twelve_bytes_and_it_pickles() -> None:
    rng = random.Random(2)
    flat = FlatLogprobs(text)
    for _ in range(1000):
        flat.append(*position(rng, 20))
    store = flat._store
    entries = len(store.token_ids)
    arrays = (store.token_ids, store.logprobs, store.ranks)
    assert sum(a.itemsize * len(a) for a in arrays) == 12 * entries
    copy = pickle.loads(pickle.dumps(flat))
    assert [{t: lp.logprob for t, lp in p.items()} for p in copy] == [
        {t: lp.logprob for t, lp in p.items()} for p in flat
    ]
