"""All-reduce and all-gather through shared memory, for the ranks of a tensor-parallel
group on one machine: gloo's TCP collectives cost a millisecond each here, and a step
makes two per layer.

Each rank has a slot per parity in one mapped file. A collective writes this rank's
tensor into its slot of the call's parity, publishes the call's number in its flag, waits
for every peer's flag, then reads the slots in rank order (so every rank sums in the
same order and holds the same bits). Two parities make it safe without a second wait: a
rank writes a slot again two calls later, and by then every peer has published the call
in between, which it does only after reading this one.

The file is unlinked as soon as every rank has it mapped: nothing is left on disk
whatever ends the processes. Flags are written after the data (x86 keeps stores in
order); a wait longer than the group's timeout is an error rather than a hang.
"""

from __future__ import annotations

import mmap
import os
import tempfile
import time

import numpy as np
import torch

FLAG_BYTES = 64  # a cache line per rank's flag
SPINS_BEFORE_YIELD = 200  # then the core goes to whoever needs it (more ranks than cores)


class ShmCommunicator:
    def __init__(
        self, path: str, rank: int, world_size: int, slot_bytes: int, timeout_s: float
    ) -> None:
        self.rank, self.world_size, self.slot_bytes = rank, world_size, slot_bytes
        self.timeout_s = timeout_s
        size = layout_bytes(world_size, slot_bytes)
        fd = os.open(path, os.O_RDWR)
        try:
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        buffer = np.frombuffer(self.map, dtype=np.uint8)
        self.flags = buffer[: world_size * FLAG_BYTES].view(np.int64)[:: FLAG_BYTES // 8]
        data = buffer[world_size * FLAG_BYTES :]
        # slots[parity][rank]: bytes
        self.slots = [
            [data[(p * world_size + r) * slot_bytes : (p * world_size + r + 1) * slot_bytes]
             for r in range(world_size)]
            for p in range(2)
        ]  # fmt: skip
        self.calls = 0

    @staticmethod
    def create(world_size: int, slot_bytes: int) -> str:
        """A new zeroed file for a group's communicators (in /dev/shm where there is one);
        its path, for every rank to open, then unlink()."""
        folder = "/dev/shm" if os.path.isdir("/dev/shm") else None
        fd, path = tempfile.mkstemp(prefix="pyengine-tp-", dir=folder)
        try:
            os.ftruncate(fd, layout_bytes(world_size, slot_bytes))
        finally:
            os.close(fd)
        return path

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.device.type == "cpu"
            and x.is_contiguous()
            and x.numel() * x.element_size() <= self.slot_bytes
        )

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over the group, into x."""
        parts = self._exchange(x)
        flat = x.view(-1)  # a contiguous tensor (a layer's product)
        flat.copy_(parts[0])
        for part in parts[1:]:
            flat.add_(part)
        return x

    def all_gather(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """Every rank's x concatenated along dim, in rank order."""
        parts = self._exchange(x)
        return torch.cat([p.view(x.shape) for p in parts], dim=dim)

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's x (views of the slots: read them before this rank's next call)."""
        self.calls += 1
        slots = self.slots[self.calls % 2]
        nbytes = x.numel() * x.element_size()
        views = [torch.from_numpy(s[:nbytes]).view(x.dtype) for s in slots]
        views[self.rank].copy_(x.reshape(-1))
        self.flags[self.rank] = self.calls
        self._wait_for_peers()
        return views

    def _wait_for_peers(self) -> None:
        flags, calls = self.flags, self.calls
        spins = 0
        started = 0.0
        while int(flags.min()) < calls:
            spins += 1
            if spins < SPINS_BEFORE_YIELD:
                continue
            os.sched_yield()
            if not started:
                started = time.monotonic()
            elif spins % 1024 == 0 and time.monotonic() - started > self.timeout_s:
                raise RuntimeError(
                    f"tensor-parallel rank {self.rank}: a peer did not reach collective "
                    f"{calls} within {self.timeout_s:.0f} s"
                )

    def close(self) -> None:
        del self.flags, self.slots
        self.map.close()


def layout_bytes(world_size: int, slot_bytes: int) -> int:
    return world_size * FLAG_BYTES + 2 * world_size * slot_bytes
