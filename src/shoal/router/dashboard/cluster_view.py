"""The fleet as the dashboard shows it: every worker the router knows, with its health, load, KV
usage, speed and the latencies the router measures; the workers that left the router lately
(killed, removed, lease expired), kept a while as `gone` with their last figures and slot, so that
a failure stays visible; and, under `shoal serve`, the supervisor's replica slots (restarts, last
exit, slots still starting).

Each worker is one flat dict (see `describe`). `status` sums its state up, worst first:
gone, down, ejected, breaker_open, draining, half_open, healthy; a supervisor slot with no worker
in the router is starting, spare or restarting.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from shoal.observability.cluster_events import ClusterEvents
from shoal.router.fleet.circuit_breaker import BreakerState
from shoal.router.fleet.load_report import LoadReport
from shoal.router.fleet.membership import Membership
from shoal.router.fleet.worker_state import WorkerState

DEFAULT_RETENTION_S = 300.0
DEFAULT_MAX_GONE = 32
SLOT_STATUS = {"waiting": "restarting", "starting": "starting", "spare": "spare", "serving": "starting"}


def status_of(state: WorkerState) -> str:
    report = state.report or LoadReport()
    if state.down:
        return "down"
    if state.ejected_until is not None:
        return "ejected"
    if state.breaker.state is BreakerState.OPEN:
        return "breaker_open"
    if report.draining:
        return "draining"
    if state.breaker.state is BreakerState.HALF_OPEN:
        return "half_open"
    return "healthy"


def kv_usage(report: LoadReport) -> float | None:
    """Fraction of the KV cache in use: as reported, else from free and total tokens."""
    if report.kv_cache_usage is not None:
        return report.kv_cache_usage
    if report.free_kv_tokens is not None and report.kv_capacity_tokens:
        return 1 - report.free_kv_tokens / report.kv_capacity_tokens
    return None


def describe(state: WorkerState, relayed_tokens_per_s: float, now: float) -> dict:
    """One worker now. `relayed_tokens_per_s` is what the router relayed from it over the last
    sample; `decode_tokens_per_s` is the worker's own moving-average decode speed (its report),
    `decode_tokens_per_step` what a decoding sequence gets a step there (above 1 where it
    speculates) and `drafts_kept` the fraction of its speculative drafts kept (None: none drafted)."""
    view, report = state.view(), state.report or LoadReport()
    return {
        "worker_id": state.worker_id,
        "url": state.url,
        "models": sorted(state.models),
        "status": status_of(state),
        "healthy": state.available,
        "down": state.down,
        "ejected": state.ejected_until is not None,
        "ejections": state.ejections,
        "breaker": str(state.breaker.state),
        "draining": report.draining,
        "registered": state.registered,
        "load_source": state.load_source,
        "running": view.running,
        "waiting": view.waiting,
        "in_flight": view.in_flight,
        "max_num_seqs": view.max_num_seqs,
        "outstanding_tokens": view.outstanding_tokens,
        "kv_cache_usage": kv_usage(report),
        "free_kv_tokens": report.free_kv_tokens,
        "kv_capacity_tokens": report.kv_capacity_tokens,
        "relayed_tokens_per_s": relayed_tokens_per_s,
        "decode_tokens_per_s": report.decode_tokens_per_s,
        "decode_tokens_per_step": report.decode_tokens_per_step,
        "drafts_kept": report.accepted_draft_tokens / report.draft_tokens if report.draft_tokens else None,
        "prefill_tokens_per_s": report.prefill_tokens_per_s,
        "capability": view.capability,
        "ttft_s": state.latency.ttft_s,
        "itl_s": state.latency.itl_s,
        "last_contact_s": round(max(now - state.last_seen, 0.0), 3),
        "gone_since": None,
        "replica": None,
    }


class ClusterView:
    """Invariants: `gone` holds at most `max_gone` workers, none longer than `retention_s` after it
    left, none that was in the router at the last `notice`; `_present` describes every worker the
    router had then, with its slot when `replicas` (set under `shoal serve`) names one."""

    def __init__(
        self,
        membership: Membership,
        feed: ClusterEvents,
        retention_s: float = DEFAULT_RETENTION_S,
        max_gone: int = DEFAULT_MAX_GONE,
    ):
        self.membership = membership
        self.feed = feed
        self.retention_s = retention_s
        self.max_gone = max_gone
        self.replicas: Callable[[], list[dict]] | None = None  # the supervisor's slots
        self._present: dict[str, dict] = {}
        self._slots: list[dict] = []  # at the last notice
        self.gone: OrderedDict[str, dict] = OrderedDict()  # oldest departure first

    def notice(self, rates: dict[str, float], now: float | None = None, wall: float | None = None) -> list[dict]:
        """Describes the workers in the router now, and moves those that left since the last
        notice to `gone` (with the figures and slot they had then). Returns the present ones."""
        now = time.monotonic() if now is None else now
        wall = time.time() if wall is None else wall
        self._slots = self.replicas() if self.replicas is not None else []
        by_url = {slot["url"]: slot for slot in self._slots if slot.get("url")}
        present = {}
        for state in list(self.membership.workers.values()):
            present[state.worker_id] = {
                **describe(state, rates.get(state.worker_id, 0.0), now),
                "replica": by_url.get(state.url),
            }
        for worker_id, last in self._present.items():
            if worker_id not in present:
                self.gone.pop(worker_id, None)
                self.gone[worker_id] = {
                    **last,
                    "status": "gone",
                    "healthy": False,
                    "gone_since": wall,
                    "running": 0,
                    "waiting": 0,
                    "in_flight": 0,
                    "relayed_tokens_per_s": 0.0,
                }
        for worker_id in present:
            self.gone.pop(worker_id, None)
        while self.gone and (
            len(self.gone) > self.max_gone or next(iter(self.gone.values()))["gone_since"] < wall - self.retention_s
        ):
            self.gone.popitem(last=False)
        self._present = present
        return list(present.values())

    def workers(self, rates: dict[str, float]) -> list[dict]:
        """Present workers, then gone ones (newest departure first), then supervisor slots with
        no worker in the router (starting, spare, restarting); each with its latest event."""
        rows = [dict(row) for row in self.notice(rates) + list(reversed(self.gone.values()))]
        shown = {row["url"] for row in rows}
        for slot in self._slots:
            if slot.get("url") in shown:
                continue
            rows.append(
                {
                    "worker_id": slot.get("url") or f"{slot['model']}#{slot['slot']}",
                    "url": slot.get("url"),
                    "models": [slot["model"]],
                    "status": SLOT_STATUS.get(slot["state"], slot["state"]),
                    "healthy": False,
                    "running": 0,
                    "waiting": 0,
                    "in_flight": 0,
                    "gone_since": None,
                    "replica": slot,
                }
            )
        latest = self._latest_events({row["worker_id"] for row in rows})
        for row in rows:
            row["last_event"] = latest.get(row["worker_id"])
        return rows

    def _latest_events(self, worker_ids: set[str]) -> dict[str, dict]:
        """The newest health or lifecycle event of each worker (failovers are per request)."""
        latest: dict[str, dict] = {}
        for event in self.feed.recent(kinds=("health", "lifecycle")):
            if event.get("worker_id") in worker_ids:
                latest[event["worker_id"]] = event
        return latest

    def known(self) -> set[str]:
        return set(self._present) | set(self.gone)

    def check_integrity(self) -> None:
        assert len(self.gone) <= self.max_gone
        assert not set(self.gone) & set(self._present)
