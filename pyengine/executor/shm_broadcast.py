"""One writer, many readers on this machine: each message is pickled once and written
once into a ring of shared-memory slots, from which every reader unpickles it.

    [per reader: int64 sequence it has read] [per slot: int64 sequence, int64 length,
                                              payload (slot_bytes)]

The writer fills a slot, then publishes it by writing the slot's sequence number last,
then wakes each reader through its semaphore (no reader spins on a core the model
needs). A slot is reused only once every reader has read past it. A message larger
than a slot goes through each reader's pipe instead (the slot says so: length -1).
"""

from __future__ import annotations

import contextlib
import pickle
import struct
import time
from collections.abc import Callable, Sequence
from multiprocessing import shared_memory
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Semaphore
from typing import Any

_WORD = struct.Struct("<q")
_HEADER = struct.Struct("<qq")  # sequence, length
OVERFLOW = -1


class ShmBroadcast:
    """The writer's side; readers attach with ShmReader(name, ...)."""

    def __init__(
        self,
        num_readers: int,
        num_slots: int,
        slot_bytes: int,
        wakeups: Sequence[Semaphore],
        pipes: Sequence[Connection],
    ) -> None:
        if num_readers < 1 or num_slots < 1 or slot_bytes < 1:
            raise ValueError("ShmBroadcast needs readers, slots and slot bytes")
        if len(wakeups) != num_readers or len(pipes) != num_readers:
            raise ValueError("ShmBroadcast needs a wakeup semaphore and a pipe per reader")
        self.num_readers, self.num_slots, self.slot_bytes = num_readers, num_slots, slot_bytes
        size = layout_bytes(num_readers, num_slots, slot_bytes)
        self.shm = shared_memory.SharedMemory(create=True, size=size)  # zero-filled
        self.buf = _buffer(self.shm)
        self.wakeups, self.pipes = list(wakeups), list(pipes)
        self.sequence = 0  # of the last message written

    @property
    def name(self) -> str:
        return self.shm.name

    def write(self, message: Any, alive: Callable[[], bool]) -> None:
        """Publishes `message` to every reader; waits (checking `alive`) while the slot
        it needs is still unread by one."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        sequence = self.sequence + 1
        while min(self._read(r) for r in range(self.num_readers)) <= sequence - 1 - self.num_slots:
            if not alive():
                raise RuntimeError("a reader of the step broadcast is gone")
            time.sleep(0.0005)
        offset = _slot_offset(self.num_readers, self.num_slots, self.slot_bytes, sequence)
        buf = self.buf
        if len(data) <= self.slot_bytes:
            buf[offset + _HEADER.size : offset + _HEADER.size + len(data)] = data
            _HEADER.pack_into(buf, offset, -1, len(data))
        else:
            _HEADER.pack_into(buf, offset, -1, OVERFLOW)
            for pipe in self.pipes:
                pipe.send_bytes(data)
        _WORD.pack_into(buf, offset, sequence)  # published: last
        self.sequence = sequence
        for wakeup in self.wakeups:
            wakeup.release()

    def _read(self, reader: int) -> int:
        return int(_WORD.unpack_from(self.buf, reader * _WORD.size)[0])

    def close(self) -> None:
        """Unlinks the segment; unmaps it unless a write in another thread still uses
        it (the process's end unmaps it then)."""
        with contextlib.suppress(FileNotFoundError):
            self.shm.unlink()
        with contextlib.suppress(BufferError, ValueError):
            self.buf.release()
            self.shm.close()


class ShmReader:
    def __init__(
        self,
        name: str,
        reader: int,
        num_readers: int,
        num_slots: int,
        slot_bytes: int,
        wakeup: Semaphore,
        pipe: Connection,
    ) -> None:
        self.shm = shared_memory.SharedMemory(name=name)
        self.buf = _buffer(self.shm)
        self.reader, self.num_readers = reader, num_readers
        self.num_slots, self.slot_bytes = num_slots, slot_bytes
        self.wakeup, self.pipe = wakeup, pipe
        self.sequence = 0  # of the last message read

    def read(self, alive: Callable[[], bool], poll_s: float = 1.0) -> Any:
        """The next message; blocks, checking `alive` every poll_s (RuntimeError once it
        says the writer is gone)."""
        while not self.wakeup.acquire(timeout=poll_s):
            if not alive():
                raise RuntimeError("the writer of the step broadcast is gone")
        sequence = self.sequence + 1
        offset = _slot_offset(self.num_readers, self.num_slots, self.slot_bytes, sequence)
        buf = self.buf
        written, length = _HEADER.unpack_from(buf, offset)
        if written != sequence:
            raise RuntimeError(f"step broadcast out of order: slot holds {written}, {sequence} due")
        if length == OVERFLOW:
            message = pickle.loads(self.pipe.recv_bytes())
        else:
            with buf[offset + _HEADER.size : offset + _HEADER.size + length] as data:
                message = pickle.loads(data)  # copies out what it keeps
        self.sequence = sequence
        _WORD.pack_into(buf, self.reader * _WORD.size, sequence)  # the slot may be reused
        return message

    def close(self) -> None:
        self.buf.release()
        self.shm.close()


def _buffer(shm: shared_memory.SharedMemory) -> memoryview:
    """The segment's bytes (a view released before the segment is closed)."""
    assert shm.buf is not None
    return shm.buf.cast("B")


def layout_bytes(num_readers: int, num_slots: int, slot_bytes: int) -> int:
    return num_readers * _WORD.size + num_slots * (_HEADER.size + slot_bytes)


def _slot_offset(num_readers: int, num_slots: int, slot_bytes: int, sequence: int) -> int:
    return num_readers * _WORD.size + (sequence % num_slots) * (_HEADER.size + slot_bytes)
