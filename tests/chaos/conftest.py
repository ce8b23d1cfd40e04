"""The chaos tests' fleet (three tiny workers at 10 ms a step, started on fixed ports) and network
test bed (the hosts a module's HOSTS names, one network namespace each)."""

from __future__ import annotations

import pytest

from tests.support.fleet import Fleet
from tests.support.testbed import BedUnavailable, NetworkBed
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


@pytest.fixture(scope="module")
def network_bed(request):
    """The module's hosts (HOSTS) as a test bed, torn down with everything in it after the module;
    the test fails, naming the missing capability, on a machine that cannot build one."""
    try:
        bed = NetworkBed(request.module.HOSTS).up()
    except BedUnavailable as exc:
        pytest.fail(f"the network test bed cannot be built here: {exc}")
    yield bed
    bed.down()
