"""The shared-memory channels of a `mp` run: the step broadcast (one writer, many
readers, a ring of slots, pipes for what a slot cannot hold) and the tensor-parallel
communicator (sums equal to float64 torch's to float32 rounding, the same bits on every
rank, gathers in rank order)."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from pyengine.distributed.shm_communicator import ShmCommunicator
from pyengine.executor.shm_broadcast import ShmBroadcast, ShmReader

CONTEXT = mp.get_context("spawn")


def _read_all(layout: tuple[str, int, int, int], reader: int, wakeup: Any, pipe: Any,
              count: int, out: Any) -> None:  # fmt: skip
    name, readers, slots, slot_bytes = layout
    shm = ShmReader(name, reader, readers, slots, slot_bytes, wakeup, pipe)
    got = [shm.read(lambda: True) for _ in range(count)]
    shm.close()
    out.put((reader, got))


def test_every_reader_gets_every_message_in_order_large_ones_through_the_pipe() -> None:
    readers, slots, slot_bytes = 3, 2, 4096
    pairs = [CONTEXT.Pipe() for _ in range(readers)]
    wakeups = [CONTEXT.Semaphore(0) for _ in range(readers)]
    broadcast = ShmBroadcast(readers, slots, slot_bytes, wakeups, [a for a, _ in pairs])
    rng = np.random.default_rng(0)
    # More messages than slots (the writer waits for slow readers), some too big for one.
    messages = [("step", rng.integers(0, 1000, int(n))) for n in rng.integers(1, 3000, 12)]
    out = CONTEXT.Queue()
    layout = (broadcast.name, readers, slots, slot_bytes)
    procs = [CONTEXT.Process(target=_read_all, args=(layout, r, wakeups[r], pairs[r][1],
                                                     len(messages), out))
             for r in range(readers)]  # fmt: skip
    for p in procs:
        p.start()
    try:
        for message in messages:
            broadcast.write(message, lambda: all(p.is_alive() or p.exitcode == 0 for p in procs))
        results = dict(out.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
        broadcast.close()
    assert any(len(m[1]) * 8 > slot_bytes for m in messages)  # the pipe path ran
    for reader in range(readers):
        assert len(results[reader]) == len(messages)
        for (kind, want), (got_kind, got) in zip(messages, results[reader], strict=True):
            assert got_kind == kind and np.array_equal(got, want)
    assert not Path(f"/dev/shm/{broadcast.name}").exists()


def _reduce(path: str, rank: int, world: int, tensors: list[torch.Tensor], out: Any) -> None:
    comm = ShmCommunicator(path, rank, world, 1 << 16, timeout_s=60)
    results = []
    for i, t in enumerate(tensors):  # many calls: both parities, reused slots
        x = (t * (rank + 1) + i).clone()
        results.append(comm.all_reduce(x).clone())
        results.append(comm.all_gather(t * 0 + rank, 0))
    comm.close()
    out.put((rank, [r.numpy() for r in results]))  # tensors would be shared, not copied


@pytest.mark.parametrize("world", [2, 3])
def test_sums_and_gathers_equal_torchs_and_agree_bit_for_bit(world: int) -> None:
    torch.manual_seed(world)
    tensors = [torch.randn(17, 33) for _ in range(6)] + [torch.randn(5)]
    path = ShmCommunicator.create(world, 1 << 16)
    out = CONTEXT.Queue()
    procs = [CONTEXT.Process(target=_reduce, args=(path, r, world, tensors, out))
             for r in range(world)]  # fmt: skip
    try:
        for p in procs:
            p.start()
        results = dict(out.get(timeout=120) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
        os.unlink(path)  # nothing left in /dev/shm, whatever failed
    for i, t in enumerate(tensors):
        want = sum((t.double() * (r + 1) + i) for r in range(world))
        sums = [torch.from_numpy(results[r][2 * i]) for r in range(world)]
        assert torch.allclose(sums[0].double(), want, rtol=1e-6, atol=1e-5)
        assert all(torch.equal(s, sums[0]) for s in sums), "ranks must hold the same bits"
        if t.dim() == 2:  # the gather of equal shapes: each rank's block in rank order
            gathered = torch.from_numpy(results[0][2 * i + 1])
            assert gathered.shape == (17 * world, 33)
            for r in range(world):
                assert torch.equal(gathered[17 * r : 17 * (r + 1)], torch.full((17, 33), float(r)))


def test_a_tensor_too_big_for_the_slot_is_not_taken(tmp_path: Path) -> None:
    path = ShmCommunicator.create(2, 1024)
    comm = ShmCommunicator(path, 0, 2, 1024, timeout_s=1)
    os.unlink(path)
    assert comm.fits(torch.zeros(256)) and not comm.fits(torch.zeros(257))
    assert not comm.fits(torch.zeros(16, 16).t())  # not contiguous
    comm.close()
