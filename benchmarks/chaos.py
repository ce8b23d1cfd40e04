"""Chaos: workers killed, stopped and restarted under streaming load through one router; nothing may be lost.

Workers are killed (SIGKILL, then restarted on the same port), stopped (SIGSTOP for a few seconds,
then SIGCONT) and restarted (SIGTERM, which drains, then started again) under concurrent load.

One router over --workers workers (static, polled every heartbeat interval). First a fault-free
reference phase runs seeded streaming requests (temperature > 0, chat and completions alternating)
at --concurrency for --duration-s; then the same requests run again at the same concurrency while
--faults faults hit workers that are serving (at most one faulted at a time, the next only once the
router takes the last one back). Every faulted stream is compared token for token with its reference.

--scenario harsh runs the fleet under `shoal serve` (its supervisor restarts whatever exits) and,
every --fault-interval-s, kills, stops or restarts a random live worker whatever the others' state,
so that at times no worker is up; streams then wait for capacity (--wait-for-capacity-s).

Reported: requests sent / completed / failed (an HTTP error, an error event or a stream without
[DONE]); requests whose tokens differ from the reference, tokens lost and repeated (extra), usage
that disagrees with the tokens received; migrations (the router's "migrating a stream" log lines)
and the streams in flight on each faulted worker; per fault the time from injection to the router's
"down" or "ejected" event (from GET /admin/workers); TTFT, inter-token and end-to-end latency
percentiles with and without faults. Targets: no lost request, no lost or repeated token, detection
of kills and stops within 2 heartbeat periods, TTFT p99 under faults <= 3x fault-free.

    .venv/bin/python benchmarks/chaos.py --tiny --duration-s 30        # tiny random Llama, fast
    .venv/bin/python benchmarks/chaos.py                               # SmolLM2-135M-Instruct
    .venv/bin/python benchmarks/chaos.py --scenario harsh --requests 60  # everything down at times
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import json
import os
import random
import re
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import yaml
from chaos_harsh import HarshInjector, ServedFleet
from routing_quality import free_port, wait_for

from shoal.percentile import percentile

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from chaos_network import NetworkFleet, NetworkInjector  # uses the tests' network test bed

from tests.support.tiny_model import write_tiny_model

RESULTS = Path(__file__).parent / "results"
MODEL_NAME = "chaos"
SUBJECTS = [
    "a lighthouse keeper",
    "a river",
    "an old clock",
    "a fox in winter",
    "the first snow",
    "a ship's cat",
    "a mountain road",
    "a lost key",
    "a garden at night",
    "a quiet library",
    "a storm at sea",
    "a baker",
]
MIGRATING = re.compile(
    r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*migrating a stream \(.*?\) from (\S+) after (\d+) tokens \((.*)\)"
)
DETECTED = ("down", "ejected")


def make_spec(index: int, args) -> dict:
    """Request `index` of the deterministic sequence: even ones chat, odd ones completions."""
    rng = random.Random(args.seed * 1_000_003 + index)
    subject = rng.choice(SUBJECTS)
    prompt = f"Tell story {index} about {subject}, part {rng.randrange(100)}."
    body = {
        "model": MODEL_NAME,
        "max_tokens": args.max_tokens,
        "temperature": 0.8,
        "top_p": 0.95,
        "seed": args.seed * 100_000 + index,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if index % 2 == 0:
        return {
            "index": index,
            "path": "/v1/chat/completions",
            "body": {**body, "messages": [{"role": "user", "content": prompt}]},
        }
    return {"index": index, "path": "/v1/completions", "body": {**body, "prompt": prompt}}


class Fleet:
    """The router and its workers as subprocesses; each worker keeps its port across restarts and
    appends its stderr to LOG_DIR/worker-K.log (the router's goes to router.log)."""

    def __init__(self, args, model: str, log_dir: Path, admin_token: str):
        self.args, self.model, self.log_dir, self.admin_token = args, model, log_dir, admin_token
        self.ports = [free_port() for _ in range(args.workers)]
        self.urls = [f"http://127.0.0.1:{p}" for p in self.ports]
        self.processes: list[subprocess.Popen | None] = [None] * args.workers
        self.stopped: set[int] = set()
        self.router: subprocess.Popen | None = None
        self.router_url = ""

    def start_worker(self, k: int) -> subprocess.Popen:
        command = [
            sys.executable,
            "-m",
            "shoal.cli",
            "worker",
            "--model",
            self.model,
            "--port",
            str(self.ports[k]),
            "--served-model-name",
            MODEL_NAME,
            "--kv-cache",
            self.args.kv_cache,
            "--num-threads",
            str(self.args.threads_per_worker),
            "--drain-grace-s",
            str(self.args.drain_grace_s),
            "--step-delay-ms",
            str(self.args.step_delay_ms),
            "--dtype",
            self.args.dtype,
        ]
        with open(self.log_dir / f"worker-{k}.log", "a") as log:
            log.write(f"\n=== started at {time.time():.3f}: {' '.join(command)}\n")
            log.flush()
            self.processes[k] = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log)
        return self.processes[k]

    def start(self) -> None:
        for k in range(self.args.workers):
            self.start_worker(k)
        for k, url in enumerate(self.urls):
            wait_for(url + "/ready", self.processes[k])
        config = {
            "workers": [{"url": url} for url in self.urls],
            "load_poll_interval_s": self.args.heartbeat_interval_s,  # polls are the static workers' heartbeats
            "health": {"heartbeat_interval_s": self.args.heartbeat_interval_s},
            "failover": {
                "token_deadline_min_s": self.args.token_deadline_min_s,
                "wait_for_capacity_s": self.args.wait_for_capacity_s,
            },
        }
        config_path = self.log_dir / "router.yaml"
        config_path.write_text(yaml.safe_dump(config))
        port = free_port()
        with open(self.log_dir / "router.log", "a") as log:
            self.router = subprocess.Popen(
                [sys.executable, "-m", "shoal.cli", "router", "--port", str(port), "--config", str(config_path)],
                env={**os.environ, "SHOAL_ADMIN_TOKEN": self.admin_token},
                stdout=subprocess.DEVNULL,
                stderr=log,
            )
        self.router_url = f"http://127.0.0.1:{port}"
        wait_for(self.router_url + "/ready", self.router, timeout_s=60)

    def close(self) -> None:
        for k, process in enumerate(self.processes):
            if process is not None and process.poll() is None:
                if k in self.stopped:
                    os.kill(process.pid, signal.SIGCONT)
                process.terminate()
        for process in [*self.processes, self.router]:
            if process is None:
                continue
            if process is self.router and process.poll() is None:
                process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


class AdminWatch:
    """Polls the router's GET /admin/workers every 0.1 s: accumulates its health events (wall-clock
    times) and when each worker was last seen healthy or not."""

    def __init__(self, router_url: str, token: str):
        self.router_url, self.token = router_url, token
        self.events: dict[tuple, dict] = {}
        self.workers: dict[str, dict] = {}
        self.unhealthy_since: dict[str, float] = {}
        self.rotation_changes: list[tuple[float, str, bool]] = []

    async def refresh(self, client: httpx.AsyncClient) -> None:
        response = await client.get(
            self.router_url + "/admin/workers", headers={"authorization": f"Bearer {self.token}"}, timeout=5
        )
        response.raise_for_status()
        now, body = time.time(), response.json()
        for event in body["events"]:
            self.events[(event["time"], event["worker_id"], event["change"])] = event
        listed = {worker["worker_id"] for worker in body["workers"]}
        for gone in [w for w in self.workers if w not in listed]:  # left the router (a supervised worker that exited)
            if self.workers.pop(gone)["healthy"]:
                self.rotation_changes.append((now, gone, False))
        for worker in body["workers"]:
            previous = self.workers.get(worker["worker_id"])
            if previous is None or previous["healthy"] != worker["healthy"]:
                self.rotation_changes.append((now, worker["worker_id"], worker["healthy"]))
            self.workers[worker["worker_id"]] = worker

    async def run(self, stop: asyncio.Event) -> None:
        async with httpx.AsyncClient() as client:
            while not stop.is_set():
                try:
                    await self.refresh(client)
                except (httpx.HTTPError, ValueError):
                    pass
                await asyncio.sleep(0.1)

    def sorted_events(self) -> list[dict]:
        return sorted(self.events.values(), key=lambda e: e["time"])


async def stream_one(client: httpx.AsyncClient, spec: dict, open_streams: dict) -> dict:
    """One streamed request as the client sees it."""
    record = {
        "index": spec["index"],
        "path": spec["path"],
        "worker": None,
        "status": None,
        "error": None,
        "done": False,
        "ids": [],
        "text": "",
        "usage_tokens": None,
        "response_ids": [],
        "roles": 0,
        "ttft_s": None,
        "itl_s": [],
        "e2e_s": None,
        "started_at": time.time(),
        "ended_at": None,
    }
    sent = time.perf_counter()
    last = None
    text = []
    try:
        async with client.stream("POST", spec["path"], json=spec["body"]) as response:
            record["status"], record["worker"] = response.status_code, response.headers.get("x-shoal-worker")
            if response.status_code != 200:
                content = (await response.aread())[:200].decode(errors="replace")
                record["error"] = f"HTTP {response.status_code}: {content}"
                return record
            open_streams[spec["index"]] = record["worker"]
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    record["done"], record["e2e_s"] = True, time.perf_counter() - sent
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record["error"] = f"error event: {event['error'].get('message')}"
                    continue
                if event.get("id") not in record["response_ids"]:
                    record["response_ids"].append(event.get("id"))
                if event.get("usage"):
                    record["usage_tokens"] = event["usage"].get("completion_tokens")
                for choice in event.get("choices") or []:
                    delta = choice.get("delta") or {}
                    record["roles"] += "role" in delta
                    text.append(choice.get("text") or delta.get("content") or "")
                    if choice.get("token_ids"):
                        now = time.perf_counter()
                        if last is None:
                            record["ttft_s"] = now - sent
                        else:
                            record["itl_s"].append(now - last)
                        last = now
                        record["ids"] += choice["token_ids"]
    except (httpx.HTTPError, ValueError) as exc:
        record["error"] = f"{type(exc).__name__}: {exc}"
    finally:
        open_streams.pop(spec["index"], None)
        record["ended_at"] = time.time()
        record["text"] = "".join(text)
    if not record["done"] and record["error"] is None:
        record["error"] = "the stream ended without [DONE]"
    return record


async def run_phase(
    router_url: str,
    specs,
    concurrency: int,
    open_streams: dict,
    deadline_s: float | None = None,
    count: int | None = None,
) -> tuple[list[dict], float]:
    """`concurrency` lanes take the next request of `specs(i)` until `count` were sent or, with
    `deadline_s`, until that many seconds have passed. Returns the records (by index) and seconds."""
    records: list[dict] = []
    next_index = 0
    started = time.perf_counter()

    async def lane(client: httpx.AsyncClient) -> None:
        nonlocal next_index
        while (count is None or next_index < count) and (
            deadline_s is None or time.perf_counter() - started < deadline_s
        ):
            spec = specs(next_index)
            next_index += 1
            records.append(await stream_one(client, spec, open_streams))

    timeout = httpx.Timeout(120, connect=10)
    async with httpx.AsyncClient(
        base_url=router_url, timeout=timeout, limits=httpx.Limits(max_connections=concurrency + 4)
    ) as client:
        await asyncio.gather(*(lane(client) for _ in range(concurrency)))
    return sorted(records, key=lambda r: r["index"]), time.perf_counter() - started


class Injector:
    """Injects the planned faults during the faulted phase, one at a time, each on a worker the
    router calls healthy (one with streams in flight when there is one within 3 s)."""

    def __init__(self, fleet: Fleet, watch: AdminWatch, args, open_streams: dict, seconds: float):
        self.fleet, self.watch, self.args, self.open_streams = fleet, watch, args, open_streams
        self.phase_started_wall = time.time()
        self.rng = random.Random(args.seed)
        self.faults: list[dict] = []
        self.planned = self.plan(seconds)

    def plan(self, seconds: float) -> list[tuple[float, str]]:
        """(offset into the phase, kind) per fault: evenly spread with jitter, kinds shuffled."""
        n = self.args.faults
        kinds = (["kill", "stop", "restart"] * n)[:n]
        self.rng.shuffle(kinds)
        slot = seconds / max(n, 1)
        return [((i + 0.5 + self.rng.uniform(-0.3, 0.3)) * slot, kind) for i, kind in enumerate(kinds)]

    async def pick_target(self, finished: asyncio.Event) -> int | None:
        deadline = time.monotonic() + 3
        while not finished.is_set():
            healthy = [
                k
                for k, url in enumerate(self.fleet.urls)
                if self.watch.workers.get(url, {}).get("healthy") and self.fleet.processes[k].poll() is None
            ]
            busy = [k for k in healthy if self.watch.workers[self.fleet.urls[k]]["in_flight"] > 0]
            if busy or (healthy and time.monotonic() > deadline):
                return self.rng.choice(busy or healthy)
            await asyncio.sleep(0.05)
        return None

    async def wait_ready(self, k: int, timeout_s: float = 300) -> float | None:
        deadline = time.monotonic() + timeout_s
        async with httpx.AsyncClient() as client:
            while time.monotonic() < deadline and self.fleet.processes[k].poll() is None:
                try:
                    if (await client.get(self.fleet.urls[k] + "/ready", timeout=1)).status_code == 200:
                        return time.time()
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        return None

    async def wait_back(self, url: str, timeout_s: float = 60) -> float | None:
        """When the router takes the worker back into rotation."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            worker = self.watch.workers.get(url, {})
            if worker.get("healthy") and not worker.get("down"):
                return time.time()
            await asyncio.sleep(0.05)
        return None

    async def inject(self, k: int, kind: str) -> dict:
        url, process = self.fleet.urls[k], self.fleet.processes[k]
        async with httpx.AsyncClient() as client:
            await self.watch.refresh(client)  # the in-flight count as of now, not 0.1 s ago
        fault = {
            "kind": kind,
            "worker": url,
            "router_in_flight": self.watch.workers[url]["in_flight"],
            "client_streams_opened_there": sorted(i for i, w in self.open_streams.items() if w == url),
        }
        fault["injected_at"] = time.time()
        if kind == "kill":
            os.kill(process.pid, signal.SIGKILL)
            process.wait()
            self.fleet.start_worker(k)
        elif kind == "stop":
            os.kill(process.pid, signal.SIGSTOP)
            self.fleet.stopped.add(k)
            fault["stopped_s"] = self.rng.uniform(2.0, 4.0)
            await asyncio.sleep(fault["stopped_s"])
            os.kill(process.pid, signal.SIGCONT)
            self.fleet.stopped.discard(k)
        else:
            os.kill(process.pid, signal.SIGTERM)
            deadline = time.monotonic() + self.args.drain_grace_s + 15
            while process.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            if process.poll() is None:
                fault["note"] = "did not exit after SIGTERM within drain grace + 15 s; killed"
                process.kill()
                process.wait()
            fault["exited_at"] = time.time()
            fault["exit_code"] = process.returncode
            self.fleet.start_worker(k)
        fault["serving_again_at"] = await self.wait_ready(k) if kind != "stop" else time.time()
        fault["back_in_rotation_at"] = await self.wait_back(url)
        return fault

    async def run(self, finished: asyncio.Event) -> None:
        started = time.monotonic()
        for offset, kind in self.planned:
            while time.monotonic() - started < offset and not finished.is_set():
                await asyncio.sleep(0.05)
            k = await self.pick_target(finished)
            if k is None:
                break
            fault = await self.inject(k, kind)
            fault["planned_offset_s"], fault["offset_s"] = offset, fault["injected_at"] - self.phase_started_wall
            self.faults.append(fault)
            print(
                f"  fault {len(self.faults)}: {kind} {fault['worker']} at {fault['offset_s']:.1f} s "
                f"({fault['router_in_flight']} in flight there)",
                flush=True,
            )


def latency(records: list[dict]) -> dict:
    done = [r for r in records if r["done"] and not r["error"]]
    ttft = [r["ttft_s"] for r in done if r["ttft_s"] is not None]
    itl = [gap for r in done for gap in r["itl_s"]]
    e2e = [r["e2e_s"] for r in done]
    figures = {
        f"{name}_p{q}_s": percentile(values, q)
        for name, values in (("ttft", ttft), ("itl", itl), ("e2e", e2e))
        for q in (50, 99)
    }
    return {**figures, "itl_max_s": max(itl, default=None)}


def migrations(log_path: Path, since: float, until: float) -> list[dict]:
    found = []
    for line in log_path.read_text(errors="replace").splitlines():
        match = MIGRATING.match(line)
        if match:
            at = time.mktime(time.strptime(match.group(1), "%Y-%m-%d %H:%M:%S")) + int(match.group(2)) / 1000
            if since <= at <= until:
                found.append(
                    {"at": at, "worker": match.group(3), "after_tokens": int(match.group(4)), "reason": match.group(5)}
                )
    return found


def compare(reference: dict, faulted: dict) -> dict:
    """Tokens of the reference missing from the faulted stream (lost) and tokens the faulted stream
    has beyond the reference (repeated or extra), by a diff of the two id sequences."""
    ref, got = reference["ids"], faulted["ids"]
    lost = extra = 0
    for tag, i1, i2, j1, j2 in difflib.SequenceMatcher(None, ref, got, autojunk=False).get_opcodes():
        if tag in ("delete", "replace"):
            lost += i2 - i1
        if tag in ("insert", "replace"):
            extra += j2 - j1
    first = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    return {
        "index": faulted["index"],
        "reference_tokens": len(ref),
        "tokens": len(got),
        "lost": lost,
        "repeated": extra,
        "first_difference": first if ref != got else None,
        "text_differs": reference["text"] != faulted["text"],
    }


def summarise_phase(records: list[dict], seconds: float) -> dict:
    failed = [r for r in records if r["error"] or not r["done"]]
    return {
        "sent": len(records),
        "completed": len(records) - len(failed),
        "failed": len(failed),
        "failures": [{"index": r["index"], "error": r["error"], "tokens": len(r["ids"])} for r in failed][:20],
        "seconds": seconds,
        "tokens": sum(len(r["ids"]) for r in records),
        **latency(records),
    }


def analyse(args, phases: dict, faults: list[dict], watch: AdminWatch, log_dir: Path) -> dict:
    """phases: name -> (records, seconds, (wall-clock start, end)) for "reference" and "faulted"."""
    ref_records, ref_s, ref_window = phases["reference"]
    fault_records, fault_s, fault_window = phases["faulted"]
    result = {"reference": summarise_phase(ref_records, ref_s), "faulted": summarise_phase(fault_records, fault_s)}
    events = watch.sorted_events()
    for name, (since, until) in (("reference", ref_window), ("faulted", fault_window)):
        phase_events = [e for e in events if since <= e["time"] <= until]
        counts: dict[str, int] = {}
        for e in phase_events:
            counts[e["change"]] = counts.get(e["change"], 0) + 1
        result[name]["health_events"] = counts
        result[name]["migrations"] = migrations(log_dir / "router.log", since, until)
    by_index = {r["index"]: r for r in ref_records}
    diffs, usage_wrong, anomalies = [], [], []
    for record in fault_records:
        if record["error"] or not record["done"]:
            continue
        reference_record = by_index.get(record["index"])
        if reference_record is None or reference_record["error"]:
            anomalies.append({"index": record["index"], "what": "no clean reference"})
            continue
        if reference_record["ids"] != record["ids"] or reference_record["text"] != record["text"]:
            diffs.append(compare(reference_record, record))
        if record["usage_tokens"] != len(record["ids"]):
            usage_wrong.append(
                {"index": record["index"], "usage": record["usage_tokens"], "received": len(record["ids"])}
            )
        if len(record["response_ids"]) != 1 or (record["path"].endswith("chat/completions") and record["roles"] != 1):
            anomalies.append(
                {"index": record["index"], "response_ids": record["response_ids"], "roles": record["roles"]}
            )
    exposed = {i for f in faults for i in f["client_streams_opened_there"]}
    result["tokens"] = {
        "requests_differing": len(diffs),
        "tokens_lost": sum(d["lost"] for d in diffs),
        "tokens_repeated": sum(d["repeated"] for d in diffs),
        "differing_streams_exposed_to_a_fault": sum(d["index"] in exposed for d in diffs),
        "usage_mismatches": len(usage_wrong),
        "stream_anomalies": len(anomalies),
        "differences": diffs[:20],
        "usage_wrong": usage_wrong[:20],
        "anomalies": anomalies[:20],
    }
    for i, fault in enumerate(faults):
        until = faults[i + 1]["injected_at"] if i + 1 < len(faults) else fault_window[1]
        hit = next(
            (
                e
                for e in events
                if e["worker_id"] == fault["worker"] and e["change"] in DETECTED and e["time"] >= fault["injected_at"]
            ),
            None,
        )
        fault["detected"] = (
            None
            if hit is None
            else {"change": hit["change"], "reason": hit["reason"], "after_s": hit["time"] - fault["injected_at"]}
        )
        out = next(
            (
                t
                for t, w, healthy in watch.rotation_changes
                if w == fault["worker"] and not healthy and t >= fault["injected_at"]
            ),
            None,
        )
        fault["out_of_rotation_after_s"] = None if out is None else out - fault["injected_at"]
        if fault["detected"] is None and out is not None and "slot" in fault:  # the supervisor saw it exit first
            fault["detected"] = {"change": "left", "reason": "exited", "after_s": out - fault["injected_at"]}
        logged = migrations(log_dir / "router.log", fault["injected_at"], until)
        moved = [m for m in logged if m["worker"] == fault["worker"]]
        if moved and (
            fault["detected"] is None or moved[0]["at"] - fault["injected_at"] < fault["detected"]["after_s"]
        ):
            fault["detected"] = {  # a stream left it before the health monitor did (a hung stream)
                "change": "stream moved",
                "reason": moved[0]["reason"],
                "after_s": moved[0]["at"] - fault["injected_at"],
            }
        if fault.get("first_503_after_s") is not None:
            fault["detected"] = {"change": "503", "reason": "store unreachable", "after_s": fault["first_503_after_s"]}
        fault["migrations_logged"] = len(logged)
        fault["events"] = [e for e in events if fault["injected_at"] <= e["time"] <= until]
    detect = [
        f["detected"]["after_s"] if f["detected"] else None
        for f in faults
        if f["kind"] in ("kill", "stop") and f.get("healthy_there_before", True)  # else nothing left to detect
    ]
    finite = [d for d in detect if d is not None]
    bound = 2 * args.heartbeat_interval_s
    result["detection"] = {
        "kill_and_stop_s": detect,
        "max_s": max(finite, default=None),
        "p50_s": percentile(finite, 50),
        "target_s": bound,
        "undetected": len(detect) - len(finite),
    }
    ttft_ratio = None
    if result["faulted"]["ttft_p99_s"] and result["reference"]["ttft_p99_s"]:
        ttft_ratio = result["faulted"]["ttft_p99_s"] / result["reference"]["ttft_p99_s"]
    result["ttft_p99_ratio"] = ttft_ratio
    tokens = result["tokens"]
    result["targets"] = {
        "no lost request": result["faulted"]["failed"] == 0 and result["reference"]["failed"] == 0,
        "no lost or repeated token": tokens["requests_differing"] == 0
        and tokens["usage_mismatches"] == 0
        and tokens["stream_anomalies"] == 0,
        "TTFT p99 under faults <= 3x fault-free": ttft_ratio is not None and ttft_ratio <= 3,
    }
    if detect:  # process faults: the network ones have no heartbeat bound (a one-way partition keeps them)
        result["targets"][f"kills and stops detected within 2 heartbeats ({bound:g} s)"] = (
            len(finite) == len(detect) and max(finite) <= bound
        )
    result["faults"] = faults
    stretches = stretches_without_a_worker(watch, fault_window)
    result["no_healthy_worker_s"] = sum(stretches)
    result["longest_without_a_worker_s"] = max(stretches, default=0.0)
    return result


def stretches_without_a_worker(watch: AdminWatch, window: tuple[float, float]) -> list[float]:
    """Lengths of the stretches of `window` in which the router called no worker healthy."""
    healthy: dict[str, bool] = {}
    stretches, empty_since = [], None
    for at, worker, is_healthy in [*watch.rotation_changes, (window[1], None, None)]:
        if worker is not None:
            healthy[worker] = is_healthy
        none_now = not any(healthy.values())
        if empty_since is not None and (not none_now or worker is None):
            stretches.append(min(at, window[1]) - max(empty_since, window[0]))
            empty_since = None
        if none_now and empty_since is None and worker is not None:
            empty_since = at
    return [s for s in stretches if s > 0]


def report(result: dict) -> None:
    def ms(value):
        return "-" if value is None else f"{value * 1e3:.0f} ms"

    print("\nfaults:")
    for i, f in enumerate(result["faults"], 1):
        detected = f["detected"]
        back = f.get("back_in_rotation_at") and f["back_in_rotation_at"] - f["injected_at"]
        drained = (
            f" (exited {f['exited_at'] - f['injected_at']:.1f} s after SIGTERM; not a detection)"
            if "exited_at" in f
            else ""
        )
        found = f"{detected['change']} after {ms(detected['after_s'])} ({detected['reason']})" if detected else "never"
        print(
            f"  {i:>2} {f['kind']:<7} {f['worker']} at {f['offset_s']:5.1f} s: {f['router_in_flight']} in flight, "
            f"{f['migrations_logged']} migrations logged, detected {found}"
            + f"{drained}, out of rotation after {ms(f['out_of_rotation_after_s'])}, back after {ms(back)}"
        )
    hit = sum(f["router_in_flight"] > 0 for f in result["faults"])
    planned = "unplanned" if result["faults_planned"] is None else f"of {result['faults_planned']} planned"
    print(
        f"{len(result['faults'])} {planned} faults injected, {hit} with streams "
        f"in flight on the worker ({sum(f['router_in_flight'] for f in result['faults'])} streams in all); "
        f"no worker healthy for {result['no_healthy_worker_s']:.1f} s of the faulted phase "
        f"(longest stretch {result['longest_without_a_worker_s']:.1f} s)"
    )
    for name in ("reference", "faulted"):
        p = result[name]
        print(
            f"{name:>9}: {p['sent']} sent, {p['completed']} completed, {p['failed']} failed, {p['tokens']} tokens in "
            f"{p['seconds']:.1f} s; TTFT p50 {ms(p['ttft_p50_s'])} p99 {ms(p['ttft_p99_s'])}, ITL p50 "
            f"{ms(p['itl_p50_s'])} p99 {ms(p['itl_p99_s'])} max {ms(p['itl_max_s'])}, e2e p50 "
            f"{ms(p['e2e_p50_s'])} p99 {ms(p['e2e_p99_s'])}; "
            f"{len(p['migrations'])} migrations; events {p['health_events']}"
        )
    t = result["tokens"]
    print(
        f"tokens: {t['requests_differing']} requests differ from the reference ({t['tokens_lost']} tokens lost, "
        f"{t['tokens_repeated']} repeated/extra), {t['usage_mismatches']} usage mismatches, "
        f"{t['stream_anomalies']} stream anomalies"
    )
    d = result["detection"]
    print(
        f"detection (kill, stop): max {ms(d['max_s'])}, p50 {ms(d['p50_s'])}, {d['undetected']} undetected, "
        f"target {ms(d['target_s'])}; TTFT p99 faulted / fault-free: "
        + ("-" if result["ttft_p99_ratio"] is None else f"{result['ttft_p99_ratio']:.2f}")
    )
    for name, ok in result["targets"].items():
        print(f"  {'PASS' if ok else 'MISS'}  {name}")


async def scenario(fleet, args) -> dict:
    watch = AdminWatch(fleet.router_url, fleet.admin_token)
    stop_watch = asyncio.Event()
    watcher = asyncio.create_task(watch.run(stop_watch))
    open_streams: dict[int, str] = {}
    warm = args.concurrency * 2
    await run_phase(
        fleet.router_url, lambda i: make_spec(1_000_000 + i, args), args.concurrency, open_streams, count=warm
    )
    length = f"{args.requests} requests" if args.requests else f"{args.duration_s:g} s"
    print(f"reference phase: {length} at concurrency {args.concurrency}", flush=True)
    since = time.time()
    reference = await run_phase(
        fleet.router_url,
        lambda i: make_spec(i, args),
        args.concurrency,
        open_streams,
        deadline_s=None if args.requests else args.duration_s,
        count=args.requests,
    )
    reference_window = (since, time.time())
    await asyncio.sleep(2 * args.heartbeat_interval_s)
    sent = len(reference[0])
    if args.scenario == "harsh":
        injector = HarshInjector(fleet, watch, args, open_streams)
        print(f"faulted phase: the same {sent} requests, a fault every {args.fault_interval_s:g} s", flush=True)
    elif args.scenario == "network":
        injector = NetworkInjector(fleet, watch, args, open_streams)
        print(f"faulted phase: the same {sent} requests, faults {', '.join(injector.planned)}", flush=True)
    else:
        injector = Injector(fleet, watch, args, open_streams, reference[1])
        print(f"faulted phase: the same {sent} requests, {len(injector.planned)} faults", flush=True)
    finished = asyncio.Event()
    since = injector.phase_started_wall = time.time()
    injection = asyncio.create_task(injector.run(finished))
    faulted = await run_phase(
        fleet.router_url, lambda i: make_spec(i, args), args.concurrency, open_streams, count=sent
    )
    finished.set()
    await injection
    faulted_window = (since, time.time())
    await asyncio.sleep(0.5)
    stop_watch.set()
    await watcher
    phases = {"reference": (*reference, reference_window), "faulted": (*faulted, faulted_window)}
    result = analyse(args, phases, injector.faults, watch, fleet.log_dir)
    result["faults_planned"] = None if injector.planned is None else len(injector.planned)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--scenario",
        choices=("one-at-a-time", "harsh", "network"),
        default="one-at-a-time",
        help="harsh: `shoal serve` supervises the workers; a random one is killed, stopped or restarted every "
        "--fault-interval-s, whatever the others' state. network: router, workers and Redis on hosts of a "
        "test bed of network namespaces; a link cut, a blackhole, a one-way partition, a slow link and Redis "
        "out of reach, one after the other",
    )
    parser.add_argument("--model", default="smollm2-135m-instruct", help="registry name, .gguf file or HF directory")
    parser.add_argument("--tiny", action="store_true", help="a tiny random Llama built on the fly (fast)")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=6)
    parser.add_argument("--duration-s", type=float, default=60, help="length of each phase")
    parser.add_argument("--requests", type=int, default=None, help="requests per phase (default: --duration-s decides)")
    parser.add_argument("--fault-interval-s", type=float, default=4.0, help="harsh: seconds between faults")
    parser.add_argument("--wait-for-capacity-s", type=float, default=10.0, help="the router's failover setting")
    parser.add_argument("--fault-hold-s", type=float, default=6.0, help="network: how long each fault lasts")
    parser.add_argument("--slow-rate", default="64kbit", help="network: the slow link's rate (tc tbf)")
    parser.add_argument("--faults", type=int, default=None, help="default: one per 8 s of --duration-s")
    parser.add_argument("--heartbeat-interval-s", type=float, default=0.5)
    parser.add_argument("--token-deadline-min-s", type=float, default=2.0)
    parser.add_argument("--max-tokens", type=int, default=None, help="default 128 (tiny) or 64")
    parser.add_argument("--step-delay-ms", type=float, default=None, help="default 20 (tiny) or 0")
    parser.add_argument("--dtype", default=None, help="default float32 (tiny) or auto")
    parser.add_argument("--kv-cache", default=None, help="default 8MiB (tiny) or 256MiB")
    parser.add_argument("--threads-per-worker", type=int, default=1)
    parser.add_argument("--drain-grace-s", type=float, default=5.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--commit", default=None, help="the commit of the shoal code imported from PYTHONPATH, if any")
    parser.add_argument("--log-dir", default=None, help="worker and router logs (default: a new temporary folder)")
    args = parser.parse_args()
    tiny = args.tiny
    defaults = {
        "max_tokens": (128, 64),
        "step_delay_ms": (20.0, 0.0),
        "dtype": ("float32", "auto"),
        "kv_cache": ("8MiB", "256MiB"),
    }
    for name, (small, real) in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, small if tiny else real)
    if args.faults is None:
        args.faults = max(1, round(args.duration_s / 8))
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="shoal-chaos-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    model = str(write_tiny_model(log_dir / "tiny-llama")) if tiny else args.model
    load_before = os.getloadavg()
    shoal_from = subprocess.run(
        [sys.executable, "-c", "import shoal; print(shoal.__file__)"], capture_output=True, text=True
    ).stdout.strip()  # what the workers and the router will run
    if args.scenario == "harsh":
        fleet = ServedFleet(args, model, MODEL_NAME, log_dir)
    elif args.scenario == "network":
        fleet = NetworkFleet(args, model, MODEL_NAME, log_dir)
    else:
        fleet = Fleet(args, model, log_dir, secrets.token_hex(16))
    print(f"logs: {log_dir}", flush=True)
    try:
        fleet.start()
        result = asyncio.run(scenario(fleet, args))
    finally:
        fleet.close()
    report(result)
    RESULTS.mkdir(exist_ok=True)
    repo = Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(repo)]
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    dirty = subprocess.run([*git, "status", "--porcelain", "src"], capture_output=True, text=True).stdout.splitlines()
    if not shoal_from.startswith(str(repo / "src")):  # an export on PYTHONPATH: the checkout says nothing
        commit, dirty = args.commit or f"unknown (shoal from {shoal_from})", None
    out = RESULTS / f"chaos-{time.strftime('%Y%m%dT%H%M%SZ', time.gmtime())}.json"
    out.write_text(
        json.dumps(
            {
                "args": vars(args),
                "model": "tiny random Llama" if tiny else args.model,
                "commit": commit,
                "uncommitted_src_changes": dirty,
                "shoal_imported_from": shoal_from,
                "log_dir": str(log_dir),
                "cpus": os.cpu_count(),
                "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
                "results": result,
            },
            indent=2,
            default=str,
        )
    )
    print(f"results: {out}")
    return 0 if all(result["targets"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
