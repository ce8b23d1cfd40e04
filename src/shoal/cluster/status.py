"""`shoal status` (the cluster a running `shoal serve` supervises, as its router sees it) and
`shoal restart MODEL` (a rolling restart of its replicas)."""

from __future__ import annotations

import json
import sys

import httpx
from rich.console import Console
from rich.table import Table

from shoal.cluster.serve import run_dir


def running_serve(state_dir: str) -> dict | None:
    """The endpoint and admin token of the `shoal serve` running with this state directory."""
    try:
        return json.loads((run_dir(state_dir) / "serve.json").read_text())
    except FileNotFoundError:
        print(f"no `shoal serve` is running here (no {run_dir(state_dir) / 'serve.json'})")
        return None


def status(state_dir: str) -> int:
    directory = run_dir(state_dir)
    serve = running_serve(state_dir)
    if serve is None:
        return 1
    try:
        fleet = httpx.get(
            serve["url"] + "/admin/workers", timeout=5, headers={"authorization": f"Bearer {serve['admin_token']}"}
        ).json()
    except httpx.HTTPError as exc:
        print(f"shoal status: the router at {serve['url']} does not answer: {exc}")
        return 1
    slots = json.loads((directory / "workers.json").read_text()) if (directory / "workers.json").exists() else []
    supervised = {slot["url"]: slot for slot in slots if slot["url"]}
    table = Table(title=f"shoal at {serve['url']}/v1, {sum(fleet['queued'].values())} requests queued")
    for column in ("model", "worker", "pid", "health", "breaker", "running", "waiting", "restarts"):
        table.add_column(column)
    for worker in fleet["workers"]:
        slot = supervised.get(worker["worker_id"], {})
        health = (
            "healthy"
            if worker["healthy"]
            else "down"
            if worker["down"]
            else "ejected"
            if worker["ejected"]
            else "unavailable"
        )
        table.add_row(
            ", ".join(worker["models"]),
            worker["worker_id"],
            str(slot.get("pid", "")),
            health,
            worker["breaker"],
            str(worker["running"]),
            str(worker["waiting"]),
            str(slot.get("restarts", "")),
        )
    for slot in slots:
        if slot["state"] != "serving" or slot["url"] not in {w["worker_id"] for w in fleet["workers"]}:
            table.add_row(
                slot["model"],
                slot["url"] or "-",
                str(slot["pid"] or ""),
                slot["state"],
                "",
                "",
                "",
                str(slot["restarts"]),
            )
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    return 0


def restart(state_dir: str, model: str) -> int:
    serve = running_serve(state_dir)
    if serve is None:
        return 1
    answer = httpx.post(
        f"{serve['url']}/admin/models/{model}/restart",
        timeout=None,
        headers={"authorization": f"Bearer {serve['admin_token']}"},
    )
    if answer.status_code != 200:
        print(f"shoal restart: {answer.json()['error']['message']}")
        return 1
    print(f"shoal restart: {answer.json()['replaced']} replicas of {model} replaced")
    return 0
