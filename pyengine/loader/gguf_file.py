"""A GGUF file's metadata and tensors.

The layout (header, key/value metadata, tensor infos, aligned tensor data) is parsed
here, straight from a memory map: the `gguf` package's reader builds a numpy view per
array element and takes seconds on a vocabulary's strings. Quantized tensors are
dequantized by the `gguf` package, which knows every block format.
"""

from __future__ import annotations

import itertools
import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pyengine.layers.block_quantized import BlockQuantized, from_gguf_blocks, is_block_quantized

_MAGIC = b"GGUF"
_SCALARS = {  # GGUF value type -> struct format
    0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q",
    12: "<d",
}  # fmt: skip
_NUMPY = {0: "<u1", 1: "<i1", 2: "<u2", 3: "<i2", 4: "<u4", 5: "<i4", 6: "<f4", 7: "?",
          10: "<u8", 11: "<i8", 12: "<f8"}  # fmt: skip
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: the GGUF dims reversed
    ggml_type: int
    offset: int  # absolute, in the file


class GGUFError(ValueError):
    pass


class _Cursor:
    def __init__(self, buffer: memoryview, path: Path) -> None:
        self.buffer = buffer
        self.pos = 0
        self.path = path

    def scalar(self, fmt: str) -> Any:
        try:
            (value,) = struct.unpack_from(fmt, self.buffer, self.pos)
        except struct.error:
            raise GGUFError(f"{self.path}: truncated GGUF file") from None
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        length = self.scalar("<Q")
        end = self.pos + length
        if end > len(self.buffer):
            raise GGUFError(f"{self.path}: truncated GGUF file")
        text = bytes(self.buffer[self.pos : end]).decode("utf-8", errors="replace")
        self.pos = end
        return text

    def value(self, value_type: int) -> Any:
        if value_type in _SCALARS:
            return self.scalar(_SCALARS[value_type])
        if value_type == _STRING:
            return self.string()
        if value_type == _ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _NUMPY:
                dtype = np.dtype(_NUMPY[item_type])
                if count > (len(self.buffer) - self.pos) // dtype.itemsize:
                    raise GGUFError(f"{self.path}: truncated GGUF file")
                array = np.frombuffer(self.buffer, dtype, count, self.pos)
                self.pos += dtype.itemsize * count
                return array
            return [self.value(item_type) for _ in range(count)]
        raise GGUFError(f"{self.path}: unknown GGUF value type {value_type}")


_RawInfo = tuple[str, tuple[int, ...], int, int]  # name, shape, GGML type, offset


class GGUFFile:
    """Metadata (`fields`) and tensor infos of a GGUF file, its data memory-mapped."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        with open(self.path, "rb") as f:
            if not os.fstat(f.fileno()).st_size:
                raise GGUFError(f"{self.path} is empty")
            self._map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        data = memoryview(self._map)
        if bytes(data[:4]) != _MAGIC:
            raise GGUFError(f"{self.path} is not a GGUF file (no GGUF magic)")
        cursor = _Cursor(data, self.path)
        cursor.pos = 4
        version = cursor.scalar("<I")
        if version not in (2, 3):
            raise GGUFError(f"{self.path}: GGUF version {version} is not supported (2, 3)")
        num_tensors, num_fields = cursor.scalar("<Q"), cursor.scalar("<Q")
        self.fields: dict[str, Any] = {}
        for _ in range(num_fields):
            key = cursor.string()
            self.fields[key] = cursor.value(cursor.scalar("<I"))
        infos: list[_RawInfo] = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
            ggml_type, offset = cursor.scalar("<I"), cursor.scalar("<Q")
            infos.append((name, tuple(reversed(dims)), ggml_type, offset))
        alignment = self.fields.get("general.alignment", 32)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise GGUFError(f"{self.path}: general.alignment {alignment!r} is not a power of 2")
        start = (cursor.pos + alignment - 1) // alignment * alignment
        self.tensors = {
            name: TensorInfo(name, shape, ggml_type, start + offset)
            for name, shape, ggml_type, offset in infos
        }
        self._check_layout(infos, alignment)

    def _check_layout(self, infos: list[_RawInfo], alignment: int) -> None:
        """As llama.cpp: names are unique, and each tensor's data is aligned and its own
        (two tensors that share bytes would load one's weights as the other's)."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        if len(self.tensors) != len(infos):
            names = [name for name, *_ in infos]
            twice = next(name for name in names if names.count(name) > 1)
            raise GGUFError(f"{self.path}: tensor {twice} is in the file twice")
        spans = []
        for name, shape, ggml_type, offset in infos:
            if not shape or min(shape) < 1:
                raise GGUFError(f"{self.path}: tensor {name} has shape {shape}")
            if offset % alignment:
                raise GGUFError(f"{self.path}: tensor {name} is not {alignment}-byte aligned")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
            except (KeyError, ValueError):
                continue  # refused with its name when read
            elements = int(np.prod(shape, dtype=np.int64))
            spans.append((offset, offset + elements // block * type_size, name))
        spans.sort()
        for (_, end, name), (next_start, _, next_name) in itertools.pairwise(spans):
            if end > next_start:
                raise GGUFError(f"{self.path}: tensors {name} and {next_name} overlap")

    def tensor(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 (dequantized if quantized)."""
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        qtype, raw = self._raw(name)
        if qtype == GGMLQuantizationType.F32:
            values = raw.view(np.float32)
        elif qtype == GGMLQuantizationType.F16:
            values = raw.view(np.float16).astype(np.float32)
        else:
            try:
                values = dequantize(raw, qtype)
            except NotImplementedError:
                raise GGUFError(
                    f"{self.path}: tensor {name} is {qtype.name}, a type pyengine does not load"
                ) from None
        return values.astype(np.float32).reshape(self.tensors[name].shape)  # a writable copy

    def has_block_form(self, name: str) -> bool:
        """Whether tensor `name` is a matrix, or a stack of them (a layer's experts), of a
        type with a block form (block_quantized.py)."""
        info = self.tensors[name]
        return len(info.shape) in (2, 3) and is_block_quantized(info.ggml_type)

    def block_quantized(self, name: str) -> BlockQuantized | None:
        """Tensor `name` in its block form where it has one (has_block_form), else None;
        a stack of matrices [n, rows, cols] as their rows one after another [n * rows,
        cols]."""
        if not self.has_block_form(name):
            return None
        return from_gguf_blocks(self._raw(name)[1], self.tensors[name].ggml_type)

    def _raw(self, name: str) -> tuple[Any, np.ndarray]:
        """(GGML type, the tensor's bytes as uint8 [rows, row bytes]), checked."""
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        info = self.tensors[name]
        try:
            qtype = GGMLQuantizationType(info.ggml_type)
        except ValueError:
            raise GGUFError(
                f"{self.path}: tensor {name} has unknown type {info.ggml_type}"
            ) from None
        block, type_size = GGML_QUANT_SIZES[qtype]
        rows = int(np.prod(info.shape[:-1], dtype=np.int64))
        if info.shape[-1] % block:
            raise GGUFError(f"{self.path}: tensor {name} rows do not fill {qtype.name} blocks")
        row_bytes = info.shape[-1] // block * type_size
        end = info.offset + rows * row_bytes
        if end > len(self._map):
            raise GGUFError(f"{self.path}: tensor {name} runs past the end of the file")
        raw = np.frombuffer(self._map, np.uint8, rows * row_bytes, info.offset)
        return qtype, raw.reshape(rows, row_bytes)
