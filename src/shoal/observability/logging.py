"""Process logging: text lines, or JSON lines (`SHOAL_LOG_FORMAT=json`, `shoal --log-format json`)
that carry the request id and trace id of the request being served, for log search to join with
traces. The ids live in a context variable, so each request's task (and what it awaits) has its
own; a process's children inherit the format through the environment."""

from __future__ import annotations

import contextvars
import json
import logging
import os
from datetime import UTC, datetime

FORMAT_VARIABLE = "SHOAL_LOG_FORMAT"
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# HTTP client libraries would log every heartbeat and poll: only their warnings are kept.
NOISY_LOGGERS = ("httpx", "httpcore")

_request: contextvars.ContextVar[tuple[str | None, str | None]] = contextvars.ContextVar(
    "shoal_request", default=(None, None)
)


def bind_request(request_id: str | None, trace_id: str | None) -> None:
    """From here on in this task, log records carry these ids."""
    _request.set((request_id, trace_id))


class RequestContext(logging.Filter):
    """Adds `request_id` and `trace_id` (None outside a request) to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id, record.trace_id = _request.get()
        return True


class JsonLines(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, the request and
    trace ids when set, and the exception's traceback if any."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        for key in ("request_id", "trace_id"):
            if getattr(record, key, None):
                entry[key] = getattr(record, key)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def configure_logging(json_lines: bool | None = None) -> None:
    """INFO for shoal's loggers, in the format asked for (else the environment's, else text)."""
    if json_lines is None:
        json_lines = os.environ.get(FORMAT_VARIABLE, "text") == "json"
    handler = logging.StreamHandler()
    handler.addFilter(RequestContext())
    handler.setFormatter(JsonLines() if json_lines else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=logging.INFO, handlers=[handler], force=True)
    for noisy in NOISY_LOGGERS:
        logging.getLogger(noisy).setLevel(logging.WARNING)
