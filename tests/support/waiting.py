"""Waiting for a condition in tests, bounded: the tests never assert on how long it took."""

from __future__ import annotations

import time

import httpx


def wait_for(predicate, timeout_s: float = 30):
    """Returns the predicate's first truthy value; fails the test if none comes within timeout_s."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.1)
    raise AssertionError("condition not reached in time")


def answers(url: str) -> bool:
    """Whether GET `url` answers 200 now."""
    try:
        return httpx.get(url, timeout=1).status_code == 200
    except httpx.HTTPError:
        return False
