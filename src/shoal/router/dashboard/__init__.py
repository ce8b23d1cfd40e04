"""The web dashboard served by the router at /dashboard: the live cluster, recent requests with
their spans, the event feed, and throughput and latency charts (see routes)."""

from shoal.router.dashboard.routes import Dashboard

__all__ = ["Dashboard"]
