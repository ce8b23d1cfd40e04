"""Weight cache: keyed by source identity and dtype, atomic writes, memory-mapped (shared, copy-free) loads."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shoal.model import loader as loader_module
from shoal.model.config import LlamaConfig, RopeScaling
from shoal.model.loader import load_checkpoint
from shoal.model.quantized_weight import QuantizedWeight
from shoal.model.weight_cache import CACHE_DTYPES, WeightCache, config_from_json, config_to_json

linux_only = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs /proc (Linux)")

CONFIG = LlamaConfig(
    vocab_size=10,
    hidden_size=8,
    intermediate_size=16,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=4,
    rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 64),
    eos_token_ids=(2, 5),
)


def _weights(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a": torch.randn(10, 8, generator=gen).to(dtype),
        "b": torch.randn(3, generator=gen).to(dtype),
        "c": torch.randn(2, 5, 7, generator=gen).to(dtype),
    }


def file_mapping_of(tensor: torch.Tensor) -> str | None:
    """The file backing the memory mapping that holds `tensor`'s data, per /proc/self/maps."""
    address = tensor.data_ptr()
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            low, high = (int(x, 16) for x in fields[0].split("-"))
            if low <= address < high:
                return fields[5].strip() if len(fields) == 6 else None
    return None


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.fixture
def source(tmp_path: Path) -> Path:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"stand-in source file")
    return path


@pytest.mark.parametrize("dtype", CACHE_DTYPES)
def test_round_trip_preserves_config_tensors_and_metadata(tmp_path: Path, source: Path, dtype: torch.dtype) -> None:
    cache = WeightCache(tmp_path / "cache")
    assert cache.load([source], dtype) is None
    weights = _weights(dtype)
    path = cache.store([source], dtype, CONFIG, weights, extra={"tokenizer": "{}"})
    entry = cache.load([source], dtype)
    assert entry is not None and entry.path == path and entry.config == CONFIG and entry.extra == {"tokenizer": "{}"}
    assert set(entry.weights) == set(weights)
    for name, tensor in weights.items():
        assert entry.weights[name].dtype == dtype and torch.equal(entry.weights[name], tensor)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary files left behind


@linux_only
def test_loaded_tensors_are_views_of_one_private_file_mapping(tmp_path: Path, source: Path) -> None:
    cache = WeightCache(tmp_path)
    path = cache.store([source], torch.float32, CONFIG, _weights(torch.float32))
    entry = cache.load([source], torch.float32)
    assert {file_mapping_of(t) for t in entry.weights.values()} == {str(path)}
    assert len({t.untyped_storage().data_ptr() for t in entry.weights.values()}) == 1
    entry.weights["a"].fill_(7.0)  # copy-on-write: the process sees its write, the file does not change
    assert torch.equal(cache.load([source], torch.float32).weights["a"], _weights(torch.float32)["a"])


def test_changed_source_other_dtype_or_corrupt_entry_is_a_miss(tmp_path: Path, source: Path) -> None:
    cache = WeightCache(tmp_path)
    path = cache.store([source], torch.float32, CONFIG, _weights(torch.float32))
    assert cache.load([source], torch.bfloat16) is None
    path.write_bytes(path.read_bytes()[:100])  # truncated
    assert cache.load([source], torch.float32) is None
    cache.store([source], torch.float32, CONFIG, _weights(torch.float32))
    assert cache.load([source], torch.float32) is not None
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert cache.load([source], torch.float32) is None and cache.entry_path([source], torch.float32) != path


def test_store_rejects_tensors_not_in_the_cache_dtype(tmp_path: Path, source: Path) -> None:
    with pytest.raises(ValueError, match="not torch.bfloat16"):
        WeightCache(tmp_path).store([source], torch.bfloat16, CONFIG, _weights(torch.float32))
    assert list(tmp_path.iterdir()) == [source]


_CHILD = """
import sys, torch
from shoal.model.weight_cache import map_safetensors
weights, _ = map_safetensors(sys.argv[1])
total = sum(float(t.float().sum()) for t in weights.values())  # touch every page
shared = 0
with open("/proc/self/smaps") as smaps:
    inside = False
    for line in smaps:
        if "-" in line.split()[0]:
            inside = line.rstrip().endswith(sys.argv[1])
        elif inside and line.startswith("Shared_Clean:"):
            shared += int(line.split()[1]) * 1024
print(shared)
"""


@linux_only
def test_smollm2_second_load_is_mapped_and_shared_across_processes(tmp_path: Path, monkeypatch) -> None:
    first = load_checkpoint("smollm2-135m-instruct", dtype=torch.bfloat16, cache_dir=tmp_path)
    (entry_file,) = tmp_path.glob("*.safetensors")

    def no_conversion(*args):
        raise AssertionError("a cache hit must not convert the source again")

    monkeypatch.setattr(loader_module, "_convert", no_conversion)
    resident_before = resident_bytes()
    second = load_checkpoint("smollm2-135m-instruct", dtype=torch.bfloat16, cache_dir=tmp_path)
    grown = resident_bytes() - resident_before
    assert grown < entry_file.stat().st_size // 4, grown  # nothing was read or copied up front
    assert second.config == first.config and second.config.num_layers == 30
    assert second.tokenizer.encode("Hello!") == first.tokenizer.encode("Hello!")
    embed = second.weights["model.embed_tokens.weight"]
    assert embed.dtype == torch.bfloat16 and embed.shape == (49152, 576)
    assert {file_mapping_of(t) for t in second.weights.values()} == {str(entry_file)}
    assert all(torch.equal(first.weights[k], second.weights[k]) for k in first.weights)  # touches every page here
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    shared = int(
        subprocess.run(
            [sys.executable, "-c", _CHILD, str(entry_file)], capture_output=True, text=True, check=True, env=env
        ).stdout
    )
    # Pages the child touched are the ones this process already maps: the page cache holds one copy.
    weight_bytes = sum(t.numel() * t.element_size() for t in second.weights.values())
    assert shared >= 0.9 * weight_bytes, (shared, weight_bytes)


def test_quantized_entry_keeps_blocks_and_is_a_separate_entry(tmp_path: Path, source: Path) -> None:
    cache = WeightCache(tmp_path)
    blocks = torch.randint(0, 256, (4, 2 * 20), dtype=torch.uint8)
    weights = {**_weights(torch.float32), "q": QuantizedWeight(blocks, "q4_1", 64)}
    with pytest.raises(ValueError, match="need a quantized entry"):
        cache.store([source], torch.float32, CONFIG, weights)
    cache.store([source], torch.float32, CONFIG, weights, quantized=True)
    assert cache.load([source], torch.float32) is None  # the dequantized entry is another one
    loaded = cache.load([source], torch.float32, quantized=True).weights["q"]
    assert (loaded.kind, loaded.columns) == ("q4_1", 64) and torch.equal(loaded.blocks, blocks)


def test_a_config_with_windows_and_rope_factors_round_trips():
    config = dataclasses.replace(
        CONFIG,
        attention_windows=(21,),
        rope_scaling=RopeScaling("frequency_factors", frequency_factors=(1.0, 2.5)),
    )
    assert config_from_json(config_to_json(config)) == config
