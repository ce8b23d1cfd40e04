"""A GGUF file's tensor list (name, ggml type, elements, bytes) read from its header alone, skipping
the metadata values: what a fit check needs at every engine start. gguf's GGUFReader builds an
array for each metadata string (a vocabulary: 1.9 s for SmolLM2's file; this: milliseconds)."""

from __future__ import annotations

import math
import struct
from pathlib import Path
from typing import BinaryIO, NamedTuple

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from shoal.model.errors import ModelLoadError

# Bytes of each fixed-size metadata value type (GGUFValueType: 8 is a string, 9 an array).
_FIXED = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


class TensorInfo(NamedTuple):
    name: str
    type_name: str  # GGMLQuantizationType name, e.g. Q4_K
    elements: int
    bytes: int


class GGUFHeader(NamedTuple):
    """The tensors, and the byte where the file's data must end (the last tensor's end)."""

    tensors: list[TensorInfo]
    data_end: int


def _read(stream: BinaryIO, fmt: str) -> int:
    size = struct.calcsize(fmt)
    data = stream.read(size)
    if len(data) != size:
        raise ModelLoadError(f"GGUF file {stream.name} ends inside its header")
    return struct.unpack(fmt, data)[0]


def _skip_string(stream: BinaryIO) -> None:
    stream.seek(_read(stream, "<Q"), 1)


def _skip_value(stream: BinaryIO, value_type: int) -> None:
    if value_type in _FIXED:
        stream.seek(_FIXED[value_type], 1)
    elif value_type == _STRING:
        _skip_string(stream)
    elif value_type == _ARRAY:
        element_type, count = _read(stream, "<I"), _read(stream, "<Q")
        if element_type in _FIXED:
            stream.seek(_FIXED[element_type] * count, 1)
        else:
            for _ in range(count):
                _skip_value(stream, element_type)
    else:
        raise ModelLoadError(f"GGUF file {stream.name}: unknown metadata value type {value_type}")


def read_gguf_header(path: str | Path) -> GGUFHeader:
    """Every tensor the file's header lists, and where its data ends. ModelLoadError for a file that
    is not GGUF v2/v3 or whose header is cut short or names an unknown tensor type."""
    with open(path, "rb") as stream:
        if stream.read(4) != b"GGUF":
            raise ModelLoadError(f"{path} is not a GGUF file")
        version = _read(stream, "<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{path}: GGUF version {version} is not supported")
        tensors, values = _read(stream, "<Q"), _read(stream, "<Q")
        alignment = 32  # llama.cpp's default; general.alignment overrides it
        for _ in range(values):
            key = stream.read(_read(stream, "<Q"))
            value_type = _read(stream, "<I")
            if key == b"general.alignment" and value_type == 4:
                alignment = _read(stream, "<I")
            else:
                _skip_value(stream, value_type)
        infos, end = [], 0
        for _ in range(tensors):
            name = stream.read(_read(stream, "<Q")).decode("utf-8", errors="replace")
            dims = [_read(stream, "<Q") for _ in range(_read(stream, "<I"))]
            type_id = _read(stream, "<I")
            offset = _read(stream, "<Q")  # in the data section
            try:
                kind = GGMLQuantizationType(type_id)
            except ValueError as exc:
                raise ModelLoadError(f"{path}: tensor {name} has unknown ggml type {type_id}") from exc
            elements = math.prod(dims)
            block, block_bytes = GGML_QUANT_SIZES[kind]
            infos.append(TensorInfo(name, kind.name, elements, elements // block * block_bytes))
            end = max(end, offset + infos[-1].bytes)
        data_start = -(-stream.tell() // alignment) * alignment
        return GGUFHeader(infos, data_start + end)
