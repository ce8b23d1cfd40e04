"""What every framed message is made of: a decoded header, and raw tensor buffers it describes.

A frame that fails any check raises BadFrame, whose message says why; receivers drop such frames
and keep serving. Nothing here builds an object a schema does not name.
"""

from __future__ import annotations

import math
from typing import Annotated

import msgspec

# The dtypes a tensor buffer may have, and each one's bytes per element.
WIRE_DTYPES = {"float32": 4, "float16": 2, "bfloat16": 2}
MAX_TENSOR_DIMS = 4


class BadFrame(ValueError):
    """A received message that does not match its schema; the text says what is wrong."""


class TensorSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The shape and dtype name of the raw buffer frame that follows a header."""

    shape: Annotated[tuple[Annotated[int, msgspec.Meta(ge=0)], ...], msgspec.Meta(max_length=MAX_TENSOR_DIMS)]
    dtype: str

    def check(self, nbytes: int) -> None:
        """Raises BadFrame unless the dtype is allowed and the buffer holds exactly the shape's bytes."""
        if self.dtype not in WIRE_DTYPES:
            raise BadFrame(f"tensor dtype {self.dtype!r} is not one of {sorted(WIRE_DTYPES)}")
        expected = math.prod(self.shape) * WIRE_DTYPES[self.dtype]
        if nbytes != expected:
            raise BadFrame(
                f"tensor of shape {list(self.shape)} and dtype {self.dtype} needs {expected} bytes, "
                f"the frame has {nbytes}"
            )


def decode_header(decoder: msgspec.msgpack.Decoder, frame: bytes | memoryview):
    """The header a decoder's schema describes; BadFrame for anything else (garbage, a Python serialization,
    a message of another type, a missing or mistyped field)."""
    try:
        return decoder.decode(frame)
    except msgspec.DecodeError as error:
        raise BadFrame(f"undecodable header: {error}") from None
