"""Three workers behind a router with a 1 s token deadline, for chaos tests that kill one mid-stream
and watch the others carry its stream on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import yaml

from tests.support.routers import start_router, stop
from tests.support.workers import spawn_worker, wait_ready


def failover_trio(worker_args: list[str], cache_dir: Path, config_dir: Path) -> Iterator[tuple[str, dict]]:
    """Yields the router's URL and each worker's process by its URL (workers seeded 1, 2 and 3);
    stops the router and kills what is left of the workers afterwards."""
    workers = [wait_ready(*w) for w in [spawn_worker(worker_args + ["--seed", str(i)], cache_dir) for i in (1, 2, 3)]]
    config = config_dir / "router.yaml"
    config.write_text(
        yaml.safe_dump({"workers": [{"url": url} for _, url in workers], "failover": {"token_deadline_min_s": 1.0}})
    )
    router, url = start_router(["--config", str(config)])
    yield url, {worker_url: process for process, worker_url in workers}
    stop(router)
    for process, _ in workers:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=30)
