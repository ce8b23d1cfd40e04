"""What the dashboard reads, without a browser: the cluster's event feed (bounded per kind, one
ordered list), the rolling request window and its percentiles, the per-second series, the worker
view that keeps departed workers visible, the request summaries, and the endpoints' auth."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from starlette.testclient import TestClient

from shoal.observability.cluster_events import ClusterEvents
from shoal.observability.request_window import RequestWindow, RollingSamples
from shoal.percentile import percentile
from shoal.router.config import HealthSettings, RouterConfig
from shoal.router.dashboard.cluster_view import ClusterView
from shoal.router.dashboard.requests_view import summarize
from shoal.router.dashboard.time_series import LoadNow, Sampler, TimeSeries
from shoal.router.fleet.health_events import HealthEvents
from shoal.router.fleet.load_report import LoadReport
from shoal.router.fleet.membership import Membership


def test_the_feed_is_one_ordered_list_bounded_per_kind():
    feed = ClusterEvents(keep_per_kind=3)
    feed.record("health", "down", "connection refused", worker_id="http://a")
    for i in range(10):
        feed.record("failover", "retried", f"answered 500 #{i}", worker_id="http://b")
    feed.record("scaling", "scaled_up", "1 → 2 replicas", model="m", replicas=2)
    feed.check_integrity()
    events = feed.recent()
    assert [e["kind"] for e in events] == ["health", "failover", "failover", "failover", "scaling"]
    assert events[0]["change"] == "down"  # ten retries did not push the health change out
    assert [e["seq"] for e in events] == sorted(e["seq"] for e in events)
    assert events[-1]["replicas"] == 2 and events[-1]["worker_id"] is None
    assert feed.recent(limit=2) == events[-2:]
    assert feed.recent(after_seq=events[-2]["seq"]) == events[-1:]
    assert [e["change"] for e in feed.recent(kinds=("health", "scaling"))] == ["down", "scaled_up"]
    assert feed.last_seq() == events[-1]["seq"] == 12
    with pytest.raises(ValueError):
        feed.record("gossip", "x")


def test_health_events_write_the_feed_and_keep_their_own_view():
    feed = ClusterEvents()
    events = HealthEvents(CollectorRegistry(), feed)
    feed.record("lifecycle", "started", "pid 7", worker_id="http://a")
    events.record("http://a", "down", "connection refused")
    assert [(e["worker_id"], e["change"], e["reason"]) for e in events.recent] == [
        ("http://a", "down", "connection refused")
    ]
    assert [e["kind"] for e in feed.recent()] == ["lifecycle", "health"]
    assert events.transitions.labels("http://a", "down")._value.get() == 1
    assert HealthEvents(CollectorRegistry()).recent == []  # without a feed, it keeps one of its own


def test_percentiles_are_the_one_definition_over_the_window_only():
    samples = RollingSamples(window_s=10, max_samples=1000)
    for i in range(1, 101):
        samples.add(float(i), now=0.0)
    assert (
        samples.percentiles(now=5.0)
        == {
            "p50": percentile(range(1, 101), 50),
            "p90": percentile(range(1, 101), 90),
            "p99": percentile(range(1, 101), 99),
        }
        == {"p50": 50.5, "p90": 90.1, "p99": pytest.approx(99.01)}
    )
    samples.add(1000.0, now=11.0)
    assert samples.percentiles(now=10.5) == {"p50": 1000.0, "p90": 1000.0, "p99": 1000.0}  # the first hundred aged out
    assert samples.percentiles(now=30.0) == {"p50": None, "p90": None, "p99": None}
    bounded = RollingSamples(window_s=60, max_samples=5)
    for i in range(50):
        bounded.add(float(i), now=1.0)
    assert len(bounded) == 5 and bounded.values(now=1.0) == [45.0, 46.0, 47.0, 48.0, 49.0]


def test_the_window_counts_requests_tokens_and_workers():
    window = RequestWindow(window_s=10, max_samples=100)
    window.first_token(0.2, now=1.0)
    window.relayed("http://a", 1, None, now=1.0)
    window.relayed("http://a", 3, 0.05, now=1.1)
    window.relayed("http://b", 2, 0.07, now=1.2)
    window.request_finished(200, 1.5, now=2.0)
    window.request_finished(503, 0.1, now=2.0)
    snapshot = window.snapshot(now=2.0)
    assert (snapshot["finished"], snapshot["failed"], snapshot["tokens"]) == (2, 1, 6)
    assert snapshot["tokens_by_worker"] == {"http://a": 4, "http://b": 2}
    assert (
        snapshot["ttft"]["p50"] == 0.2
        and snapshot["itl"]["p99"] == pytest.approx(0.0698)
        and snapshot["e2e"]["p50"] == 1.5
    )
    window.forget_worker("http://b")
    assert window.snapshot(now=2.0)["tokens_by_worker"] == {"http://a": 4}
    window.check_integrity()


def test_the_sampler_turns_totals_into_rates_in_a_bounded_series():
    window = RequestWindow()
    load = LoadNow(in_flight=lambda: 3, queued=lambda: 1, workers=lambda: (2, 3))
    sampler = Sampler(window, load, TimeSeries(keep=5))
    sampler.previous.at = 0.0
    window.relayed("http://a", 40, None, now=0.5)
    window.request_finished(200, 1.0, now=0.5)
    first = sampler.sample(now=2.0, wall=1000.0)
    assert first["tokens_per_s"] == 20.0 and first["requests_per_s"] == 0.5 and first["errors_per_s"] == 0.0
    assert (first["in_flight"], first["queued"], first["workers_available"], first["workers"]) == (3, 1, 2, 3)
    assert first["e2e_p50_s"] == 1.0 and first["ttft_p50_s"] is None
    assert sampler.worker_rates == {"http://a": 20.0}
    second = sampler.sample(now=3.0, wall=1001.0)
    assert second["tokens_per_s"] == 0.0 and sampler.worker_rates == {}
    for i in range(10):
        sampler.sample(now=4.0 + i, wall=1002.0 + i)
    sampler.series.check_integrity()
    assert len(sampler.series) == 5 and sampler.series.latest()["time"] == 1011.0
    assert [s["time"] for s in sampler.series.since(1009.0)] == [1010.0, 1011.0]
    sampler.series.add({"time": 900.0})  # a clock step back is dropped, the series stays ordered
    assert sampler.series.latest()["time"] == 1011.0


def fleet_view(retention_s: float = 60, max_gone: int = 2):
    feed = ClusterEvents()
    membership = Membership(HealthSettings(), HealthEvents(CollectorRegistry(), feed))
    for name in "abc":
        state = membership._new_state(f"http://{name}", frozenset({"m"}), registered=False)
        state.report = LoadReport(
            running=2,
            waiting=1,
            free_kv_tokens=25,
            kv_capacity_tokens=100,
            decode_tokens_per_s=80.0,
            decode_tokens_per_step=2.5 if name == "a" else None,
            draft_tokens=40 if name == "a" else None,
            accepted_draft_tokens=30 if name == "a" else None,
        )
        membership.workers[state.worker_id] = state
    return membership, feed, ClusterView(membership, feed, retention_s=retention_s, max_gone=max_gone)


def test_workers_that_leave_stay_visible_as_gone_for_a_while():
    membership, feed, view = fleet_view()
    present = view.notice({"http://a": 12.5}, now=0.0, wall=100.0)
    a = next(w for w in present if w["worker_id"] == "http://a")
    assert a["status"] == "healthy" and a["kv_cache_usage"] == 0.75 and a["relayed_tokens_per_s"] == 12.5
    assert (a["running"], a["waiting"], a["decode_tokens_per_s"]) == (2, 1, 80.0)
    assert (a["decode_tokens_per_step"], a["drafts_kept"]) == (2.5, 0.75)  # it speculates
    assert next(w for w in present if w["worker_id"] == "http://b")["drafts_kept"] is None
    membership.workers["http://b"].down = True
    membership.remove("http://a")
    feed.record("lifecycle", "exited", "pid 9 exited with -9", worker_id="http://a")
    rows = view.workers({})
    statuses = {row["worker_id"]: row["status"] for row in rows}
    assert statuses == {"http://a": "gone", "http://b": "down", "http://c": "healthy"}
    gone = next(row for row in rows if row["worker_id"] == "http://a")
    assert gone["last_event"]["change"] == "exited" and gone["in_flight"] == 0 and not gone["healthy"]
    view.check_integrity()
    membership.remove("http://b")
    membership.remove("http://c")
    view.notice({}, now=1.0, wall=101.0)
    view.check_integrity()
    assert list(view.gone) == ["http://b", "http://c"]  # at most max_gone: the oldest departure went
    view.notice({}, now=200.0, wall=200.0)
    assert not view.gone  # retention passed


def test_a_worker_that_comes_back_is_no_longer_gone_and_slots_fill_the_table():
    membership, _, view = fleet_view()
    view.notice({})
    state = membership.remove("http://a")
    view.notice({})
    assert "http://a" in view.gone
    membership.workers["http://a"] = state
    slots = [
        {"model": "m", "slot": 0, "state": "serving", "url": "http://a", "pid": 1, "restarts": 0},
        {"model": "m", "slot": 1, "state": "waiting", "url": None, "pid": None, "restarts": 1, "last_exit": -9},
        {"model": "m", "slot": 2, "state": "starting", "url": "http://d", "pid": 3, "restarts": 0},
    ]
    view.replicas = lambda: slots
    rows = {row["worker_id"]: row for row in view.workers({})}
    assert "http://a" not in view.gone and rows["http://a"]["replica"]["pid"] == 1
    assert rows["m#1"]["status"] == "restarting" and rows["http://d"]["status"] == "starting"
    assert rows["http://b"]["replica"] is None
    membership.remove("http://a")
    view.replicas = lambda: slots[1:]
    view.notice({})  # the sampler's tick, no page open
    gone = next(row for row in view.workers({}) if row["worker_id"] == "http://a")
    assert gone["status"] == "gone" and gone["replica"]["pid"] == 1  # the slot it had, for the record


def test_a_request_summary_names_its_workers_and_failovers():
    root = {
        "trace_id": "t" * 32,
        "start_ns": 1_000_000_000,
        "end_ns": 3_500_000_000,
        "status": "unset",
        "attributes": {
            "shoal.model": "m",
            "http.response.status_code": 200,
            "shoal.ttft_s": 0.25,
            "shoal.attempts": 2,
            "shoal.output_tokens": 16,
            "shoal.stream": True,
        },
        "events": [{"name": "migration", "attributes": {}}],
        "name": "router.request",
    }
    attempts = [
        {"name": "router.attempt", "attributes": {"shoal.worker": worker}} for worker in ("http://a", "http://b")
    ]
    summary = summarize(root, [root, *attempts])
    assert summary["ok"] and summary["duration_s"] == 2.5 and summary["time"] == 1.0
    assert summary["workers"] == ["http://a", "http://b"] and summary["migrations"] == 1 and summary["retries"] == 0
    failed = {**root, "attributes": {**root["attributes"], "http.response.status_code": 503}}
    assert summarize(failed, [])["ok"] is False


def test_the_page_is_public_and_its_data_needs_the_admin_token(monkeypatch):
    from shoal.router.app import create_router_app

    monkeypatch.setenv("SHOAL_ADMIN_TOKEN", "sesame")
    with TestClient(create_router_app(RouterConfig())) as client:
        page = client.get("/dashboard")
        assert page.status_code == 200 and "dashboard.js" in page.text
        assert "script-src 'self'" in page.headers["content-security-policy"]
        assert client.get("/dashboard/static/dashboard.js").status_code == 200
        assert client.get("/dashboard/static/..%2Fapp.py").status_code == 404
        for path in ("cluster", "events", "series", "requests", "requests/" + "0" * 32):
            assert client.get(f"/dashboard/api/{path}").status_code == 401
            assert client.get(f"/dashboard/api/{path}", headers={"authorization": "Bearer nope"}).status_code == 401
        admin = {"authorization": "Bearer sesame"}
        cluster = client.get("/dashboard/api/cluster", headers=admin).json()
        assert cluster["workers"] == [] and set(cluster["queued"]) == {"critical", "standard", "sheddable"}
        assert client.get("/dashboard/api/events", headers=admin).json() == {"events": [], "last_seq": 0}
        assert client.get("/dashboard/api/series", headers=admin).json()["interval_s"] == 1.0
        assert client.get("/dashboard/api/requests", headers=admin).json() == {"requests": []}
        assert client.get("/admin/workers", headers=admin).json()["events"] == []


def test_the_supervisor_and_the_autoscaler_report_to_the_feed(tmp_path):
    import asyncio

    from shoal.cluster.autoscaler import Signals, describe
    from shoal.cluster.config import Autoscaling, ModelDeployment, SupervisorSettings
    from shoal.cluster.launcher_local import LaunchedWorker
    from shoal.cluster.supervisor import RouterLink, SlotState, Supervisor
    from tests.support.stand_in_process import StandInProcess

    feed = ClusterEvents()

    async def join(url, model):
        pass

    async def scenario():
        supervisor = Supervisor(
            None,
            [ModelDeployment(name="m", replicas=2)],
            SupervisorSettings(restart_backoff_s=5),
            RouterLink(join, lambda url: None, feed.record),
            tmp_path / "workers.json",
        )
        for slot in supervisor.slots:
            slot.worker = LaunchedWorker(StandInProcess(), f"http://w{slot.index}", tmp_path / "log")
            slot.state = SlotState.SERVING
        supervisor.slots[0].worker.process.kill()
        supervisor.check(now=10.0)
        supervisor.scale("m", 0, reason="quiet")  # the exited slot goes first

    asyncio.run(scenario())
    exited, scaled, draining = feed.recent()
    assert (exited["kind"], exited["change"], exited["worker_id"], exited["exit_code"]) == (
        "lifecycle",
        "exited",
        "http://w0",
        -9,
    )
    assert "restarting in 5.0 s" in exited["reason"]
    assert (scaled["kind"], scaled["change"], scaled["replicas"], scaled["previous_replicas"]) == (
        "scaling",
        "scaled_down",
        0,
        2,
    )
    assert scaled["reason"] == "2 → 0 replicas: quiet"
    assert (draining["change"], draining["worker_id"]) == ("draining", "http://w1")
    signals = Signals(
        replicas=2, queued=6, in_flight=4, outstanding_tokens=0, kv_cache_usage=0.5, ttft_s=None, itl_s=None
    )
    assert describe(signals, Autoscaling()) == "queued/replica 3.0 (target 2), KV usage 0.50 (target 0.8)"
