"""The dashboard's HTTP surface on the router.

`GET /dashboard` is a static page (with its script and style under /dashboard/static/), served
without authentication: it holds no data. It reads the admin token from its URL fragment
(`/dashboard#token=...`, which browsers never send to a server), keeps it in sessionStorage and
sends it as a bearer token to the JSON endpoints below, which take the same admin token as
`/admin/workers`:

- `GET /dashboard/api/cluster`: the workers (cluster_view), models, admission queues, totals;
- `GET /dashboard/api/events?after=SEQ&limit=N`: the event feed, oldest first;
- `GET /dashboard/api/series?after=TIME`: the per-second samples (time_series);
- `GET /dashboard/api/requests?limit=N`: the latest finished requests, newest first;
- `GET /dashboard/api/requests/{trace_id}`: one request's spans, the router's and the workers'.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from fastapi import APIRouter, Request
from starlette.responses import FileResponse, JSONResponse, Response

from shoal.observability.cluster_events import KINDS, ClusterEvents
from shoal.observability.request_window import RequestWindow
from shoal.observability.trace_assembly import whole_trace
from shoal.observability.tracing import Tracing
from shoal.router.admission.queues import Admission
from shoal.router.dashboard.cluster_view import ClusterView
from shoal.router.dashboard.requests_view import recent_requests
from shoal.router.dashboard.time_series import LoadNow, Sampler
from shoal.router.fleet.membership import Membership
from shoal.router.streams.proxy import error_response

STATIC = Path(__file__).resolve().parent / "static"
STATIC_FILES = {
    **{f"{name}.js": "text/javascript" for name in ("dashboard", "dom", "tables", "charts", "waterfall")},
    "dashboard.css": "text/css",
    "favicon.svg": "image/svg+xml",
}
# The page runs only its own files; nothing it shows can run as script.
PAGE_HEADERS = {
    "cache-control": "no-store",
    "referrer-policy": "no-referrer",
    "x-content-type-options": "nosniff",
    "content-security-policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
    "img-src 'self'; connect-src 'self'; frame-ancestors 'none'",
}


class Dashboard:
    """The dashboard's state on one router: the sampler behind the charts and the cluster view
    behind the worker table. `shoal serve` sets `replicas` to return the supervisor's slots.
    Invariant: reads only; nothing here changes how requests are served."""

    def __init__(
        self, membership: Membership, admission: Admission, tracing: Tracing, window: RequestWindow, feed: ClusterEvents
    ):
        self.membership, self.admission, self.tracing, self.window, self.feed = (
            membership,
            admission,
            tracing,
            window,
            feed,
        )
        self.cluster = ClusterView(membership, feed)
        self.sampler = Sampler(
            window,
            LoadNow(
                in_flight=admission.slots.total,
                queued=lambda: sum(admission.queued().values()),
                workers=self._worker_counts,
            ),
        )
        self.sampler.on_sample = self._after_sample

    @property
    def replicas(self) -> Callable[[], list[dict]] | None:
        return self.cluster.replicas

    @replicas.setter
    def replicas(self, slots: Callable[[], list[dict]] | None) -> None:
        self.cluster.replicas = slots

    def _worker_counts(self) -> tuple[int, int]:
        workers = list(self.membership.workers.values())
        return sum(1 for w in workers if w.available), len(workers)

    def _after_sample(self) -> None:
        """Keeps the gone workers current between page loads, and forgets the token counts of
        workers no longer shown."""
        self.cluster.notice(self.sampler.worker_rates)
        known = self.cluster.known()
        for worker_id in list(self.window.tokens_by_worker):
            if worker_id not in known:
                self.window.forget_worker(worker_id)

    async def run(self) -> None:
        await self.sampler.run()

    def cluster_state(self) -> dict:
        workers = self.cluster.workers(self.sampler.worker_rates)
        return {
            "time": time.time(),
            "models": sorted(self.membership.models()),
            "queued": self.admission.queued(),
            "in_flight": self.admission.slots.total(),
            "latest": self.sampler.series.latest(),
            "workers": workers,
        }

    def routes(self, authorized: Callable[[Request], bool]) -> APIRouter:
        routes = APIRouter()

        def refused() -> Response:
            return error_response(401, "a valid admin token is required", "authentication_error")

        @routes.get("/dashboard", include_in_schema=False)
        async def page() -> Response:
            return FileResponse(STATIC / "index.html", media_type="text/html", headers=PAGE_HEADERS)

        @routes.get("/dashboard/static/{name}", include_in_schema=False)
        async def static(name: str) -> Response:
            if name not in STATIC_FILES:
                return error_response(404, f"no file {name!r}", "not_found_error")
            return FileResponse(STATIC / name, media_type=STATIC_FILES[name], headers=PAGE_HEADERS)

        @routes.get("/dashboard/api/cluster")
        async def cluster(request: Request) -> Response:
            """Every worker with health, load, KV usage, speeds and latencies; queues; the latest sample."""
            return JSONResponse(self.cluster_state()) if authorized(request) else refused()

        @routes.get("/dashboard/api/events")
        async def events(request: Request, after: int = 0, limit: int = 200, kind: str | None = None) -> Response:
            """The feed's events after seq `after`, oldest first, at most `limit` (the latest)."""
            if not authorized(request):
                return refused()
            kinds = tuple(k for k in (kind or "").split(",") if k in KINDS) or KINDS
            found = self.feed.recent(max(1, min(limit, 1000)), after_seq=after, kinds=kinds)
            return JSONResponse({"events": found, "last_seq": self.feed.last_seq()})

        @routes.get("/dashboard/api/series")
        async def series(request: Request, after: float | None = None) -> Response:
            """The samples taken after `after` (seconds since the epoch), oldest first."""
            if not authorized(request):
                return refused()
            return JSONResponse(
                {
                    "interval_s": self.sampler.interval_s,
                    "window_s": self.window.window_s,
                    "samples": self.sampler.series.since(after),
                }
            )

        @routes.get("/dashboard/api/requests")
        async def requests(request: Request, limit: int = 50) -> Response:
            """The latest finished requests, newest first."""
            if not authorized(request):
                return refused()
            return JSONResponse({"requests": recent_requests(self.tracing, max(1, min(limit, 500)))})

        @routes.get("/dashboard/api/requests/{trace_id}")
        async def one_request(trace_id: str, request: Request) -> Response:
            """One request's spans (the router's and its workers'), in start order."""
            if not authorized(request):
                return refused()
            return JSONResponse(
                {"trace_id": trace_id, "spans": await whole_trace(self.tracing, self.membership.session, trace_id)}
            )

        return routes
