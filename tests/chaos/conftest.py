"""The chaos tests' fleet: three tiny workers at 10 ms a step, started on fixed ports."""

from __future__ import annotations

import pytest

from tests.support.fleet import Fleet
from tests.support.workers import MODEL, tiny_worker_args


@pytest.fixture
def fleet(tiny_model_dir, shoal_cache_dir, tmp_path):
    workers = Fleet(
        tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=10),
        shoal_cache_dir,
        tmp_path,
        size=3,
    )
    yield workers
    workers.close()
