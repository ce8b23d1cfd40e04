"""The GGUF header scan lists the same tensors as gguf's reader, and a cut file is a clear error."""

from __future__ import annotations

import pytest

from shoal.model.errors import ModelLoadError
from shoal.model.gguf_header import gguf_tensor_infos
from shoal.model.gguf_loader import open_gguf
from shoal.model.registry import resolve_model


def reader_infos(path) -> list[tuple]:
    return [(t.name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes)) for t in open_gguf(path).tensors]


def test_the_bundled_file_lists_what_gguf_reads():
    path = resolve_model("smollm2-135m-instruct").path
    assert [tuple(info) for info in gguf_tensor_infos(path)] == reader_infos(path)


def test_a_header_cut_short_or_not_gguf_is_an_error_naming_the_file(tmp_path):
    header = resolve_model("smollm2-135m-instruct").path.read_bytes()[: 1 << 20]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(header[:100_000])  # inside the vocabulary
    with pytest.raises(ModelLoadError, match="cut.gguf ends inside its header"):
        gguf_tensor_infos(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + header[4:64])
    with pytest.raises(ModelLoadError, match="other.gguf is not a GGUF file"):
        gguf_tensor_infos(other)
