"""A GGUF file's tensor list (name, ggml type, elements, bytes) read from its header alone, skipping
the metadata values: what a fit check needs at every engine start. gguf's GGUFReader builds an
array for each metadata string (a vocabulary: 1.9 s for SmolLM2's file); this walks the mapped file,
reading only the lengths it skips (milliseconds)."""

from __future__ import annotations

import math
import mmap
import struct
from pathlib import Path
from typing import NamedTuple

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from shoal.model.errors import ModelLoadError

# Bytes of each fixed-size metadata value type (GGUFValueType: 8 is a string, 9 an array).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_U32, _U64 = struct.Struct("<I"), struct.Struct("<Q")


class TensorInfo(NamedTuple):
    name: str
    type_name: str  # GGMLQuantizationType name, e.g. Q4_K
    elements: int
    bytes: int


class GGUFHeader(NamedTuple):
    """The tensors, and the byte where the file's data must end (the last tensor's end)."""

    tensors: list[TensorInfo]
    data_end: int


class _Cursor:
    """Reads a mapped file forward from `at`. Invariant: `at` never passes the end of what it read."""

    def __init__(self, data: mmap.mmap, path: Path):
        self.data, self.path, self.at = data, path, 0

    def _end_check(self, end: int) -> int:
        if end > len(self.data):
            raise ModelLoadError(f"GGUF file {self.path} ends inside its header")
        return end

    def u32(self) -> int:
        self.at = self._end_check(self.at + 4)
        return _U32.unpack_from(self.data, self.at - 4)[0]

    def u64(self) -> int:
        self.at = self._end_check(self.at + 8)
        return _U64.unpack_from(self.data, self.at - 8)[0]

    def take(self, size: int) -> bytes:
        self.at = self._end_check(self.at + size)
        return self.data[self.at - size : self.at]

    def skip(self, size: int) -> None:
        self.at = self._end_check(self.at + size)

    def skip_strings(self, count: int) -> None:
        """Skips `count` length-prefixed strings (a vocabulary: tens of thousands)."""
        data, at, unpack = self.data, self.at, _U64.unpack_from
        end = len(data)
        for _ in range(count):
            if at + 8 > end:
                raise ModelLoadError(f"GGUF file {self.path} ends inside its header")
            at += 8 + unpack(data, at)[0]
        self.at = self._end_check(at)

    def skip_value(self, value_type: int) -> None:
        if value_type in _FIXED:
            self.skip(_FIXED[value_type])
        elif value_type == _STRING:
            self.skip(self.u64())
        elif value_type == _ARRAY:
            element_type, count = self.u32(), self.u64()
            if element_type in _FIXED:
                self.skip(_FIXED[element_type] * count)
            elif element_type == _STRING:
                self.skip_strings(count)
            else:
                for _ in range(count):
                    self.skip_value(element_type)
        else:
            raise ModelLoadError(f"GGUF file {self.path}: unknown metadata value type {value_type}")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Every tensor the file's header lists, and where its data ends. ModelLoadError for a file that
    is not GGUF v2/v3 or whose header is cut short or names an unknown tensor type."""
    path = Path(path)
    with open(path, "rb") as file:
        if file.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _read_header(_Cursor(data, path))


def _read_header(cursor: _Cursor) -> GGUFHeader:
    path = cursor.path
    cursor.skip(4)  # the magic, checked
    version = cursor.u32()
    if version not in (2, 3):
        raise ModelLoadError(f"{path}: GGUF version {version} is not supported")
    tensors, values = cursor.u64(), cursor.u64()
    alignment = 32  # llama.cpp's default; general.alignment overrides it
    for _ in range(values):
        key = cursor.take(cursor.u64())
        value_type = cursor.u32()
        if key == b"general.alignment" and value_type == 4:
            alignment = cursor.u32()
        else:
            cursor.skip_value(value_type)
    infos, end = [], 0
    for _ in range(tensors):
        name = cursor.take(cursor.u64()).decode("utf-8", errors="replace")
        dims = [cursor.u64() for _ in range(cursor.u32())]
        type_id = cursor.u32()
        offset = cursor.u64()  # in the data section
        try:
            kind = GGMLQuantizationType(type_id)
        except ValueError as exc:
            raise ModelLoadError(f"{path}: tensor {name} has unknown ggml type {type_id}") from exc
        elements = math.prod(dims)
        block, block_bytes = GGML_QUANT_SIZES[kind]
        infos.append(TensorInfo(name, kind.name, elements, elements // block * block_bytes))
        end = max(end, offset + infos[-1].bytes)
    data_start = -(-cursor.at // alignment) * alignment
    return GGUFHeader(infos, data_start + end)
