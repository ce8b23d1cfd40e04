"""A batch as OpenAI describes it, and the records that hold it: the batch (its state, written by
the router that runs it) and a cancel request (written by whoever asks); while unfinished it is
marked active for the routers to run (state.leased_work)."""

from __future__ import annotations

import re
import secrets
import time

from shoal.router.placement.route_request import RequestError
from shoal.router.state.records import Record

KIND = "batch"
CANCEL_KIND = "batch_cancel"  # id: the batch id; its presence asks the batch's runner to stop
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
FINISHED = ("completed", "failed", "expired", "cancelled")
WINDOW = re.compile(r"^([1-9][0-9]*)([smh])$")
WINDOW_UNIT_S = {"s": 1, "m": 60, "h": 3600}
MAX_WINDOW_S = 7 * 24 * 3600


def window_seconds(window: object) -> int:
    """OpenAI's completion_window (`24h`), or any other whole number of hours, minutes or seconds
    up to 7 days."""
    match = WINDOW.match(window) if isinstance(window, str) else None
    seconds = int(match[1]) * WINDOW_UNIT_S[match[2]] if match else 0
    if not 0 < seconds <= MAX_WINDOW_S:
        raise RequestError(
            "`completion_window` must be a duration such as 24h, 30m or 90s, up to 168h", "completion_window"
        )
    return seconds


def new_batch(owner: str, input_file_id: str, endpoint: str, window: str, metadata: dict | None) -> Record:
    now = time.time()
    body = {
        "id": f"batch_{secrets.token_hex(12)}",
        "object": "batch",
        "endpoint": endpoint,
        "errors": None,
        "input_file_id": input_file_id,
        "completion_window": window,
        "status": "validating",
        "output_file_id": None,
        "error_file_id": None,
        "created_at": int(now),
        "in_progress_at": None,
        "expires_at": int(now) + window_seconds(window),
        "finalizing_at": None,
        "completed_at": None,
        "failed_at": None,
        "expired_at": None,
        "cancelling_at": None,
        "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata,
    }
    return Record(KIND, body["id"], owner, now, body)


def as_seen(batch: Record, cancel: Record | None) -> dict:
    """The batch object a client is shown: its stored state, `cancelling` once a cancel was asked
    for and its runner has not finished it yet."""
    body = batch.body
    if cancel is not None and body["status"] not in FINISHED:
        return {**body, "status": "cancelling", "cancelling_at": cancel.body["cancelling_at"]}
    return body
