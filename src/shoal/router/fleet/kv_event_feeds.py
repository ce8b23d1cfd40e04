"""The router's exact picture of what each worker caches, followed from its KV events.

For every worker it knows, the router opens GET /shoal/kv_events (shoal.worker.kv_event_stream;
the cluster secret as bearer) and applies each frame to a KvState of its own (shoal.protocol.
kv_state). A worker that answers 404 (it publishes none: a peer engine, a windowed model) is left
to the guessed prefix index, and asked again only after NOT_PUBLISHING_RETRY_S.

Consistency: a state is the worker's as of some event number, behind it by the worker's POLL_S
and the network, so a block stored or evicted within the last few tens of milliseconds may be
missing or still listed; a request placed but not yet computed is in no state (the guessed index
keeps those). A state from which no frame came for STALE_S (the worker sends one at least every
IDLE_S) is dropped until the stream is back, so a severed worker is guessed about, not trusted.
A gap in the numbers or a new epoch (a restarted engine) brings a snapshot. Each process of a
router group follows every worker itself: their states agree up to that lag.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

import aiohttp

from shoal.protocol.frames import BadFrame
from shoal.protocol.kv_events import FrameReader
from shoal.router.fleet.followed_caches import STALE_S, FollowedCaches, WorkerFeed

log = logging.getLogger(__name__)

RETRY_S = 1.0
RECONNECT_S = 0.05  # after a stream ends: a worker that closes at once is not asked again at once
NOT_PUBLISHING_RETRY_S = 60.0
SYNC_S = 0.5


class KvEventFeeds:
    """Follows the KV events of the workers `worker_urls` names (worker id -> base URL)."""

    def __init__(self, worker_urls: Callable[[], dict[str, str]], secret: str | None):
        self.worker_urls = worker_urls
        self.secret = secret
        self.session: aiohttp.ClientSession | None = None
        self.caches = FollowedCaches()
        self._tasks: dict[str, asyncio.Task] = {}

    async def run(self) -> None:
        """Keeps one follower per known worker until cancelled."""
        try:
            while True:
                urls = self.worker_urls()
                for worker_id in set(self._tasks) - set(urls):
                    self._tasks.pop(worker_id).cancel()
                    self.caches.drop(worker_id)
                for worker_id, url in urls.items():
                    if worker_id not in self._tasks:
                        feed = self.caches.feed(worker_id)
                        self._tasks[worker_id] = asyncio.create_task(self._follow(url, feed))
                await asyncio.sleep(SYNC_S)
        finally:
            for task in self._tasks.values():
                task.cancel()

    async def _follow(self, url: str, feed: WorkerFeed) -> None:
        headers = {"authorization": f"Bearer {self.secret}"} if self.secret else {}
        while True:
            params = {"epoch": feed.epoch, "after": str(feed.seq)}
            try:
                async with self.session.get(
                    f"{url}/shoal/kv_events",
                    params=params,
                    headers=headers,
                    timeout=aiohttp.ClientTimeout(total=None, sock_connect=2.0, sock_read=STALE_S),
                ) as response:
                    if response.status == 404:
                        await asyncio.sleep(NOT_PUBLISHING_RETRY_S)
                        continue
                    if response.status != 200:
                        log.warning("KV events of %s: HTTP %d", url, response.status)
                        await asyncio.sleep(RETRY_S)
                        continue
                    reader = FrameReader()
                    async for chunk in response.content.iter_any():
                        now = time.monotonic()
                        if not all(feed.apply(frame, now) for frame in reader.feed(chunk)):
                            break  # reconnect for a snapshot
            except (TimeoutError, aiohttp.ClientError, BadFrame) as error:
                log.debug("KV events of %s: %s", url, error)
                await asyncio.sleep(RETRY_S)
            await asyncio.sleep(RECONNECT_S)
