"""A workload against a live server: requests start at their arrival times, at most `concurrency`
in flight, and a conversation's next turn only after its previous answer has arrived."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from shoal.bench.client import ChatClient
from shoal.bench.records import RequestRecord
from shoal.bench.workloads import BenchRequest, with_answers


@dataclass(frozen=True)
class RunResult:
    """One record per request, in workload order; `duration_s` runs from the start to the end of
    the last request."""

    records: list[RequestRecord]
    duration_s: float


async def run_workload(
    requests: Sequence[BenchRequest],
    client: ChatClient,
    concurrency: int | None,
    on_record: Callable[[RequestRecord], None] = lambda record: None,
) -> RunResult:
    """Sends every request (calling `on_record` as each ends). A turn is sent no earlier than its
    arrival time and after its previous turn's answer, which takes the generated answer's place in
    its messages; the turns after a failed one are recorded as failed without being sent."""
    limit = asyncio.Semaphore(concurrency) if concurrency else contextlib.nullcontext()
    records: dict[int, RequestRecord] = {}
    run_start = time.perf_counter()

    async def converse(turns: list[BenchRequest]) -> None:
        answers: list[str] = []
        for request in turns:
            await asyncio.sleep(max(0.0, run_start + request.arrival_s - time.perf_counter()))
            if len(answers) < request.turn:
                record = _not_sent(request, "not sent: an earlier turn of its conversation failed")
            else:
                async with limit:
                    record, answer = await client.send(request, with_answers(request.messages, answers), run_start)
                if record.ok:
                    answers.append(answer)
            records[request.index] = record
            on_record(record)

    conversations: dict[int, list[BenchRequest]] = defaultdict(list)
    for request in requests:
        conversations[request.conversation_id].append(request)
    await asyncio.gather(*(converse(turns) for turns in conversations.values()))
    return RunResult([records[request.index] for request in requests], time.perf_counter() - run_start)


def _not_sent(request: BenchRequest, reason: str) -> RequestRecord:
    return RequestRecord(
        index=request.index,
        conversation_id=request.conversation_id,
        turn=request.turn,
        arrival_s=request.arrival_s,
        start_s=None,
        ttft_ms=None,
        itl_ms=(),
        e2e_ms=None,
        prompt_tokens=None,
        completion_tokens=0,
        status=None,
        error=reason,
    )
