"""The lines of a batch's input file (OpenAI's JSONL: custom_id, method, url, body), each read on
its own: a malformed line fails that line only."""

from __future__ import annotations

import json
from dataclasses import dataclass


@dataclass(frozen=True)
class BatchLine:
    """Invariant: exactly one of `body` (a request to run) and `error` (why the line fails) is set."""

    index: int
    custom_id: str | None
    body: dict | None = None
    error: dict | None = None


def _failed(index: int, custom_id: str | None, code: str, message: str) -> BatchLine:
    return BatchLine(index, custom_id, error={"code": code, "message": f"line {index + 1}: {message}"})


def read_lines(content: bytes, endpoint: str) -> list[BatchLine]:
    """Every non-blank line of the file, in order, as a request or a failure. A custom_id seen
    before fails the later line."""
    lines, seen = [], set()
    for index, raw in enumerate(line for line in content.split(b"\n") if line.strip()):
        try:
            item = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            lines.append(_failed(index, None, "invalid_json", f"not a JSON object ({exc})"))
            continue
        custom_id = item.get("custom_id") if isinstance(item, dict) else None
        if not isinstance(item, dict):
            lines.append(_failed(index, None, "invalid_json", "not a JSON object"))
        elif not isinstance(custom_id, str) or not custom_id:
            lines.append(_failed(index, None, "missing_required_parameter", "`custom_id` must be a non-empty string"))
        elif custom_id in seen:
            lines.append(_failed(index, custom_id, "duplicate_custom_id", f"custom_id {custom_id!r} was used before"))
        elif item.get("method") != "POST":
            lines.append(_failed(index, custom_id, "invalid_method", "`method` must be POST"))
        elif item.get("url") != endpoint:
            lines.append(_failed(index, custom_id, "invalid_url", f"`url` must be this batch's endpoint, {endpoint}"))
        elif not isinstance(item.get("body"), dict):
            lines.append(_failed(index, custom_id, "invalid_body", "`body` must be a JSON object"))
        elif item["body"].get("stream"):
            lines.append(_failed(index, custom_id, "invalid_body", "a batch request cannot stream"))
        else:
            lines.append(BatchLine(index, custom_id, body=item["body"]))
        if isinstance(custom_id, str):
            seen.add(custom_id)
        unknown = sorted(set(item) - {"custom_id", "method", "url", "body"}) if isinstance(item, dict) else []
        if unknown and lines[-1].body is not None:
            lines[-1] = _failed(index, custom_id, "invalid_request", f"unknown or unsupported field `{unknown[0]}`")
    return lines
