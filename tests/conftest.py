"""Shared fixtures: a tiny random Llama checkpoint on disk (real files, real loaders) and engines on it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.tiny_model import write_tiny_model


def pytest_configure(config) -> None:
    """SHOAL_CPU_ISA, when set, caps torch's libraries in this process before any test runs an operation."""
    from shoal.model.cpu_features import apply_cpu_isa_cap

    apply_cpu_isa_cap()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def shoal_cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("shoal-cache")


@pytest.fixture
def make_tiny_engine(tiny_model_dir, shoal_cache_dir):
    """Factory: LLMEngine on the tiny model with float32 and a small KV cache unless overridden."""
    from shoal.config.engine import EngineConfig
    from shoal.engine.engine import LLMEngine

    def make(**overrides) -> LLMEngine:
        options = dict(
            model=str(tiny_model_dir),
            dtype="float32",
            device="cpu",
            kv_cache_bytes=4 << 20,
            block_size=4,
            max_num_batched_tokens=64,
            cache_dir=str(shoal_cache_dir),
        )
        options.update(overrides)
        return LLMEngine(EngineConfig(**options))

    return make


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    """URL of a real redis-server for the whole session (installed first if missing)."""
    from tests.support.redis_server import start_redis_server

    process, url = start_redis_server(tmp_path_factory.mktemp("redis"))
    yield url
    process.terminate()
    process.wait(timeout=30)
