"""The C API's way into Python. libpyengine starts the interpreter and calls attach()
with the address of its bridge table (cpp/capi/bridge.h, mirrored by _Table): attach
sets the table's op to _op, which C calls (ctypes takes the GIL for it) with an
operation's number and its JSON, and keeps the C functions that hand back results
(put_result) and requests' events (deliver, from the engine thread)."""

from __future__ import annotations

import ctypes
import gc
import json
import logging
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from pyengine.capi.host import INVALID_ARGUMENT, OK, CApiError, EmbeddedEngine
from pyengine.engine.async_engine import EngineDeadError

logger = logging.getLogger("pyengine")

ABI = 1  # bridge.h's kBridgeAbi
CLOSED, ENGINE, INTERNAL = -4, -7, -9

_OP = ctypes.CFUNCTYPE(ctypes.c_int32, ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p,
                       ctypes.c_size_t, ctypes.c_void_p)  # fmt: skip
_PUT_RESULT = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t)
_I32, _F32 = ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float)
_DELIVER = ctypes.CFUNCTYPE(
    None, ctypes.c_int64, ctypes.c_int32, _I32, ctypes.c_size_t, ctypes.c_char_p,
    ctypes.c_size_t, _F32, _I32, _F32, ctypes.c_size_t, ctypes.c_int32, ctypes.c_int32,
    ctypes.c_int32, ctypes.c_int32,
)  # fmt: skip


class _Table(ctypes.Structure):
    _fields_ = [
        ("abi", ctypes.c_uint32),
        ("put_result", _PUT_RESULT),
        ("deliver", _DELIVER),
        ("op", _OP),
    ]


class _Bridge:
    def __init__(self, table: _Table) -> None:
        self.put_result = table.put_result
        self.deliver = table.deliver
        self.engines: dict[int, EmbeddedEngine] = {}
        self.next_key = 1

    def engine(self, key: int) -> EmbeddedEngine:
        engine = self.engines.get(key)
        if engine is None:
            raise CApiError(CLOSED, "the engine has been shut down")
        return engine

    def create(self, spec: dict[str, Any]) -> bytes:
        options = spec["options"]
        engine = EmbeddedEngine(spec["model"], options, self.deliver)
        key, self.next_key = self.next_key, self.next_key + 1
        self.engines[key] = engine
        return str(key).encode()

    def shutdown(self, key: int) -> bytes:
        engine = self.engines.pop(key, None)
        if engine is not None:
            engine.shutdown()
            del engine
            # An embedded interpreter never exits, so nothing collects the engine's cycles
            # or runs multiprocessing's exit: the workers' queues and locks are freed
            # now, and with the last engine the helper process that tracks them ends.
            gc.collect()
            if not self.engines:
                _stop_resource_tracker()
        return b""


def _stop_resource_tracker() -> None:
    """Ends multiprocessing's resource tracker, where one was started (by the `mp`
    executor's workers); it starts again with the next worker."""
    from multiprocessing import resource_tracker

    stop = getattr(resource_tracker._resource_tracker, "_stop", None)
    if stop is not None:
        stop()


_bridge: _Bridge | None = None
_op_callback: Any = None  # (the ctypes callback C holds: it must outlive every call)


def attach(address: int, abi: int, python_version: str) -> None:
    """Called once by libpyengine, with its table's address."""
    global _bridge, _op_callback
    import sys

    if abi != ABI:
        raise RuntimeError(f"libpyengine's bridge is version {abi}, this pyengine's is {ABI}: "
                           "the library and the package come from different builds")  # fmt: skip
    running = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if running != python_version:
        raise RuntimeError(f"libpyengine was built for Python {python_version}, the "
                           f"interpreter is Python {running}")  # fmt: skip
    table = _Table.from_address(address)
    _bridge = _Bridge(table)
    _op_callback = _OP(_op)
    table.op = _op_callback


def _op(engine: int, op: int, data: int | None, size: int, result: int) -> int:
    assert _bridge is not None
    try:
        raw = ctypes.string_at(data or 0, size) if size else b""
        try:
            spec = json.loads(raw.decode("utf-8")) if raw else None
        except UnicodeDecodeError:
            raise ValueError("a text given is not valid UTF-8") from None
        handler = _OPS.get(op)
        if handler is None:
            raise CApiError(INTERNAL, f"no operation {op}")
        out = handler(_bridge, engine, spec)
        status = OK
    except CApiError as error:
        out, status = str(error).encode(), error.status
    except EngineDeadError as error:
        out, status = str(error).encode(), ENGINE
    except (ValueError, TypeError, KeyError) as error:
        out, status = str(error).encode("utf-8", "replace"), INVALID_ARGUMENT
    except BaseException as error:  # (a bug: said, never raised into ctypes)
        logger.exception("pyengine's C API: operation %d failed", op)
        out, status = f"{type(error).__name__}: {error}".encode("utf-8", "replace"), INTERNAL
    _bridge.put_result(result, out, len(out))
    return status


def _int32s(values: list[int]) -> bytes:
    return np.asarray(values, dtype=np.int32).tobytes()


def _embed(bridge: _Bridge, key: int, spec: dict[str, Any]) -> bytes:
    rows = bridge.engine(key).embed(spec["texts"], spec["normalize"], spec["dimensions"])
    return struct.pack("<i", rows.shape[1]) + rows.tobytes()


def _submit(bridge: _Bridge, key: int, spec: dict[str, Any]) -> bytes:
    bridge.engine(key).submit(spec)
    return b""


def _abort(bridge: _Bridge, key: int, spec: int) -> bytes:
    engine = bridge.engines.get(key)
    if engine is not None:  # (a shut-down engine aborted everything already)
        engine.abort(int(spec))
    return b""


_Handler = Callable[[_Bridge, int, Any], bytes]

# bridge.h's Op numbers
_OPS: dict[int, _Handler] = {
    1: lambda bridge, key, spec: bridge.create(spec),
    2: lambda bridge, key, spec: bridge.shutdown(key),
    3: lambda bridge, key, spec: _int32s(bridge.engine(key).info()),
    4: lambda bridge, key, spec: np.asarray(bridge.engine(key).stats(), np.float64).tobytes(),
    5: lambda bridge, key, spec: _int32s(
        bridge.engine(key).tokenize(spec["text"], spec["add_special_tokens"])
    ),
    6: lambda bridge, key, spec: (
        bridge.engine(key).detokenize(spec["tokens"], spec["skip_special_tokens"]).encode()
    ),
    7: lambda bridge, key, spec: (
        bridge.engine(key).chat_template(spec["messages"], spec["add_generation_prompt"]).encode()
    ),
    8: _submit,
    9: _abort,
    10: _embed,
}
