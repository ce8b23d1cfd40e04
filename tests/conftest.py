"""Shared fixtures: a tiny random Llama checkpoint on disk (real files, real loaders) and engines on it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.fork_server import stop_fork_server
from tests.support.kernel_builds import KernelBuilds
from tests.support.tiny_model import write_layer_skip_draft, write_tiny_model


def pytest_configure(config) -> None:
    """SHOAL_CPU_ISA, when set, caps torch's libraries in this process before any test runs an operation.

    The processes the tests start (workers, routers, pipeline stages, several at once on a machine
    of few cores) let their idle OpenMP threads sleep instead of spin: a spinning thread takes the
    core its neighbour process needs. OpenMP reads the variable when torch loads it, which this
    process has done by then, so the in-process engines here keep OpenMP's default."""
    from shoal.model.cpu_features import apply_cpu_isa_cap

    apply_cpu_isa_cap()
    import torch  # noqa: F401  (loads OpenMP before the variable below is set)

    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def suite_directory(item: pytest.Item, root: Path) -> str:
    """The directory under tests/ that holds the item: "unit", "integration", ..."""
    parts = item.path.relative_to(root).parts
    return parts[1] if len(parts) > 2 else ""


# Suites in the order they start: the unit tests first (quick and mostly on one core, they leave the
# other to the kernel builds), then the longest files, so that no long file starts last and runs alone
# while the other test process has nothing left.
SUITE_ORDER = ("unit", "parallel", "chaos")


def pytest_collection_modifyitems(session, config, items) -> None:
    def rank(item: pytest.Item) -> int:
        suite = suite_directory(item, config.rootpath)
        return SUITE_ORDER.index(suite) if suite in SUITE_ORDER else len(SUITE_ORDER)

    items.sort(key=rank)


@pytest.fixture(scope="session", autouse=True)
def session_cache(request, shoal_cache_dir):
    """Every engine of the session, here or in a process started from here, caches its weights,
    calibrations and compiled kernels in `shoal_cache_dir`, never in the user's cache. When the
    session runs more than the unit tests, the attention kernels are built there ahead."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("SHOAL_CACHE_DIR", str(shoal_cache_dir))
        root = request.config.rootpath
        if all(suite_directory(item, root) == "unit" for item in request.session.items):
            yield
            return
        builds = KernelBuilds(shoal_cache_dir)
        yield
        builds.stop()
        stop_fork_server()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_draft_model_dir(tiny_model_dir, tmp_path_factory) -> Path:
    """A draft model for the tiny model: its first layer alone (support.tiny_model.write_layer_skip_draft)."""
    return write_layer_skip_draft(tiny_model_dir, tmp_path_factory.mktemp("tiny-llama-draft"))


@pytest.fixture(scope="session")
def long_tiny_model_dir(tmp_path_factory) -> Path:
    """The tiny model with 4096 positions: room for a tools prompt written one character a token."""
    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama-long"), max_position_embeddings=4096)


@pytest.fixture(scope="session")
def shoal_cache_dir(tmp_path_factory) -> Path:
    """One cache for the whole run: under pytest-xdist its worker processes share it (kernel builds
    take turns on a file lock), so the kernels are built once."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "shoal-cache"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("shoal-cache")


@pytest.fixture
def make_tiny_engine(tiny_model_dir, shoal_cache_dir):
    """Factory: LLMEngine on the tiny model with float32 and a small KV cache unless overridden."""
    from tests.support.engine_runs import engine_factory

    return engine_factory(tiny_model_dir, shoal_cache_dir, dtype="float32", max_num_batched_tokens=64)


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> str:
    """URL of a real redis-server for the whole session (installed first if missing)."""
    from tests.support.redis_server import start_redis_server

    process, url = start_redis_server(tmp_path_factory.mktemp("redis"))
    yield url
    process.terminate()
    process.wait(timeout=30)
