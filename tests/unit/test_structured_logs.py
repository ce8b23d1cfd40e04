"""JSON log lines carry the request and trace ids bound in the task that logs; each task has its own."""

from __future__ import annotations

import asyncio
import io
import json
import logging

from shoal.observability.logging import JsonLines, RequestContext, bind_request


def capture() -> tuple[logging.Logger, io.StringIO]:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(RequestContext())
    handler.setFormatter(JsonLines())
    logger = logging.getLogger("shoal.test.structured")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, out


def test_each_request_task_logs_its_own_ids_and_others_log_none():
    logger, out = capture()

    async def serve(request_id: str, trace_id: str) -> None:
        bind_request(request_id, trace_id)
        await asyncio.sleep(0)  # the other request's task runs meanwhile
        logger.info("serving %s", request_id)

    async def both() -> None:
        await asyncio.gather(serve("r1", "a" * 32), serve("r2", "b" * 32))
        logger.warning("between requests")

    asyncio.run(both())
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert {(line["message"], line.get("request_id"), line.get("trace_id")) for line in lines} == {
        ("serving r1", "r1", "a" * 32),
        ("serving r2", "r2", "b" * 32),
        ("between requests", None, None),
    }
    assert all(line["logger"] == "shoal.test.structured" and line["time"].endswith("+00:00") for line in lines)


def test_an_exception_is_logged_with_its_traceback():
    logger, out = capture()
    try:
        raise ValueError("broken")
    except ValueError:
        logger.exception("it failed")
    [line] = [json.loads(line) for line in out.getvalue().splitlines()]
    assert line["level"] == "ERROR" and "ValueError: broken" in line["exception"]
