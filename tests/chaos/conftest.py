"""The chaos tests' fleet: three tiny workers at 10 ms a step, started on fixed ports."""

from __future__ import annotations

import pytest

from tests.support.fleet import Fleet
from tests.support.workers import MODEL


@pytest.fixture
def fleet(tiny_model_dir, shoal_cache_dir, tmp_path):
    workers = Fleet(
        [
            "--model",
            str(tiny_model_dir),
            "--dtype",
            "float32",
            "--served-model-name",
            MODEL,
            "--kv-cache",
            "8MiB",
            "--step-delay-ms",
            "10",
        ],
        shoal_cache_dir,
        tmp_path,
        size=3,
    )
    yield workers
    workers.close()
