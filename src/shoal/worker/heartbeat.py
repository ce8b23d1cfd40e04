"""A worker's membership in a router: register, then push the load report every interval.

The router's answer to the registration sets the interval. If the router answers 404 (it
restarted, or dropped this worker after missed heartbeats) the worker registers again; if it cannot
be reached, the worker keeps trying each interval and keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import httpx

from shoal.protocol.worker_load import Heartbeat, Registration, WorkerLoad, decode_registration_accepted, encode

log = logging.getLogger(__name__)


class RouterHeartbeat:
    def __init__(
        self,
        router_url: str,
        advertise_url: str,
        model_name: str,
        secret: str,
        load_report: Callable[[], WorkerLoad],
        interval_s: float = 1.0,
    ):
        self.router_url = router_url.rstrip("/")
        self.advertise_url = advertise_url
        self.model_name = model_name
        self.headers = {"authorization": f"Bearer {secret}", "content-type": "application/json"}
        self.load_report = load_report
        self.interval_s = interval_s
        self.registered = False

    async def run(self) -> None:
        async with httpx.AsyncClient(base_url=self.router_url, headers=self.headers, timeout=2.0) as client:
            while True:
                try:
                    await self._beat(client)
                except httpx.HTTPError as exc:
                    log.warning("router %s unreachable: %s", self.router_url, exc)
                await asyncio.sleep(self.interval_s)

    async def _beat(self, client: httpx.AsyncClient) -> None:
        if self.registered:
            response = await client.post(
                "/admin/workers/heartbeat",
                content=encode(Heartbeat(worker_id=self.advertise_url, load=self.load_report())),
            )
            if response.status_code != 404:
                response.raise_for_status()
                return
            log.warning("router %s forgot this worker; registering again", self.router_url)
        response = await client.post(
            "/admin/workers",
            content=encode(Registration(url=self.advertise_url, models=[self.model_name], load=self.load_report())),
        )
        response.raise_for_status()
        self.registered = True
        self.interval_s = decode_registration_accepted(response.content).heartbeat_interval_s
        log.info("registered with router %s as %s", self.router_url, self.advertise_url)
