"""The GGUF header scan lists the same tensors as gguf's reader, and a cut file is a clear error."""

from __future__ import annotations

import pytest

from shoal.model.errors import ModelLoadError
from shoal.model.gguf_header import read_gguf_header
from shoal.model.gguf_loader import open_gguf
from shoal.model.registry import resolve_model


def reader_infos(path) -> list[tuple]:
    return [(t.name, t.tensor_type.name, int(t.n_elements), int(t.n_bytes)) for t in open_gguf(path).tensors]


def test_the_bundled_file_lists_what_gguf_reads():
    path = resolve_model("smollm2-135m-instruct").path
    header = read_gguf_header(path)
    assert [tuple(info) for info in header.tensors] == reader_infos(path)
    assert header.data_end == path.stat().st_size  # the last tensor ends the file


def test_a_header_cut_short_or_not_gguf_is_an_error_naming_the_file(tmp_path):
    header = resolve_model("smollm2-135m-instruct").path.read_bytes()[: 1 << 20]
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(header[:100_000])  # inside the vocabulary
    with pytest.raises(ModelLoadError, match="cut.gguf ends inside its header"):
        read_gguf_header(cut)
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGML" + header[4:64])
    with pytest.raises(ModelLoadError, match="other.gguf is not a GGUF file"):
        read_gguf_header(other)


def test_a_file_cut_inside_its_tensors_is_refused_as_truncated(tmp_path):
    from shoal.model.gguf_loader import load_gguf

    data = resolve_model("smollm2-135m-instruct").path.read_bytes()
    for cut in (2_000_000, len(data) - 1000):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match=f"cut{cut}.gguf is truncated: its tensors end at byte"):
            load_gguf(path)
