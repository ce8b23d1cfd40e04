"""Background responses on real routers in front of a real tiny worker, driven with the official
openai client: a response created with `background: true` is queued, polled to its end, streamed
again from a sequence number, cancelled; and one whose router is killed (kill -9) while generating
it is taken over by another router sharing the state store, and streamed there whole, identical to
a run without the kill."""

from __future__ import annotations

import openai
import pytest

from tests.support.routers import RouterFactory, stop
from tests.support.waiting import wait_for
from tests.support.workers import MODEL, start_worker, tiny_worker_args

SAMPLING = {"temperature": 0.8, "max_output_tokens": 60}
FINAL = ("completed", "incomplete", "failed", "cancelled")


@pytest.fixture(scope="module")
def worker(tiny_model_dir, shoal_cache_dir):
    """At 20 ms a step, a 60-token response takes over a second: long enough to kill its router."""
    process, url = start_worker(tiny_worker_args(tiny_model_dir, MODEL, step_delay_ms=20), shoal_cache_dir)
    yield url
    stop(process)


@pytest.fixture
def router(worker, tmp_path):
    """Factory: a router (process, url) over the worker; all share one SQLite state store, with a
    1 s lease on shared work."""
    state = {"store": "sqlite", "sqlite_path": str(tmp_path / "state.sqlite3"), "lease_s": 1.0}
    routers = RouterFactory(tmp_path, {"workers": [{"url": worker}], "state": {**state, "work_poll_interval_s": 0.2}})
    yield routers.start
    routers.stop_all()


def client_for(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)


def final(client: openai.OpenAI, response_id: str):
    wait_for(lambda: client.responses.retrieve(response_id).status in FINAL, 120)
    return client.responses.retrieve(response_id)


def summary(events: list) -> tuple[list[int], str, str]:
    """(sequence numbers, the text of the deltas, the final event's type)."""
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    return [e.sequence_number for e in events], text, events[-1].type


def test_a_background_response_is_queued_polled_and_streamed_again(router):
    _, url = router()
    client = client_for(url)
    foreground = client.responses.create(model=MODEL, input="Tell a story.", extra_body={"seed": 3}, **SAMPLING)
    queued = client.responses.create(
        model=MODEL, input="Tell a story.", background=True, extra_body={"seed": 3}, **SAMPLING
    )
    assert queued.status == "queued" and queued.background is True and queued.output == []
    done = final(client, queued.id)
    assert done.status == "incomplete" and done.output_text == foreground.output_text
    streamed = list(client.responses.retrieve(queued.id, stream=True))
    sequence, text, last = summary(streamed)
    assert sequence == list(range(len(streamed))) and text == done.output_text and last == "response.incomplete"
    later = list(client.responses.retrieve(queued.id, stream=True, starting_after=5))
    assert [e.sequence_number for e in later] == sequence[6:]
    with pytest.raises(openai.BadRequestError) as refused:
        list(client.responses.retrieve(foreground.id, stream=True))
    assert refused.value.body["param"] == "stream"
    with pytest.raises(openai.BadRequestError) as unstored:
        client.responses.create(model=MODEL, input="x", background=True, store=False)
    assert unstored.value.body["param"] == "background"


def test_a_background_response_is_cancelled(router):
    _, url = router()
    client = client_for(url)
    started = client.responses.create(
        model=MODEL, input="Go on.", background=True, max_output_tokens=400, extra_body={"ignore_eos": True}
    )
    wait_for(lambda: client.responses.retrieve(started.id).status == "in_progress", 60)
    cancelled = client.responses.cancel(started.id)
    assert cancelled.status == "cancelled"
    events = list(client.responses.retrieve(started.id, stream=True))  # ends: nothing more will come
    assert 0 < len(events) < 400
    streamed_text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert client.responses.retrieve(started.id).output_text == streamed_text  # what it had so far
    with pytest.raises(openai.APIStatusError) as again:
        client.responses.cancel(
            final(client, client.responses.create(model=MODEL, input="x", max_output_tokens=2, background=True).id).id
        )
    assert again.value.status_code == 409


def test_a_background_response_outlives_the_router_that_took_it(router):
    first_process, first = router()
    reference = client_for(first).responses.create(
        model=MODEL, input="Tell a story.", extra_body={"seed": 9}, **SAMPLING
    )
    assert len(reference.output_text) > 20  # long enough that the kill lands mid-way
    taken = client_for(first).responses.create(
        model=MODEL, input="Tell a story.", background=True, stream=True, extra_body={"seed": 9}, **SAMPLING
    )
    received = []
    for event in taken:
        received.append(event)
        if event.type == "response.output_text.delta" and len(received) > 12:
            break
    response_id = received[0].response.id
    first_process.kill()  # kill -9 while it generates the response
    first_process.wait(timeout=30)
    _, second = router()  # takes the response over once the dead router's lease runs out
    client = client_for(second)
    done = final(client, response_id)
    assert done.status == reference.status and done.output_text == reference.output_text
    rest = list(client.responses.retrieve(response_id, stream=True, starting_after=received[-1].sequence_number))
    sequence, text, last = summary(received + rest)
    assert sequence == list(range(len(sequence)))  # one unbroken sequence: nothing lost, nothing twice
    assert text == reference.output_text and last == f"response.{reference.status}"
    assert rest[-1].response.id == response_id
