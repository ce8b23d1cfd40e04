"""Stored chat completions on real routers in front of a real tiny worker, driven with the official
openai client: `store: true` keeps a completion (plain or streamed) with its messages and metadata;
listed by model and metadata, paged; metadata updated; deleted; kept across a router restart
(SQLite); seen only by the key that stored it; `store: false` keeps nothing."""

from __future__ import annotations

import httpx
import openai
import pytest

from shoal.router.admission.auth import key_hash
from tests.support.routers import RouterFactory, stop
from tests.support.workers import MODEL, start_worker, tiny_worker_args

KEYS = {"alpha": "key-alpha", "beta": "key-beta"}


@pytest.fixture(scope="module")
def worker(tiny_model_dir, shoal_cache_dir):
    process, url = start_worker(tiny_worker_args(tiny_model_dir, MODEL), shoal_cache_dir)
    yield url
    stop(process)


@pytest.fixture
def router(worker, tmp_path):
    """Factory: (re)starts the router over the worker, on one SQLite state file."""
    routers = RouterFactory(
        tmp_path,
        {
            "workers": [{"url": worker}],
            "state": {"store": "sqlite", "sqlite_path": str(tmp_path / "state.sqlite3")},
            "api_keys": [{"name": name, "sha256": key_hash(key)} for name, key in KEYS.items()],
        },
    )
    yield routers.start
    routers.stop_all()


def client_for(url: str, name: str = "alpha") -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key=KEYS[name], max_retries=0, timeout=60)


def ask(client: openai.OpenAI, text: str, **extra):
    return client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": text}], max_tokens=6, temperature=0, **extra
    )


def test_a_stored_completion_is_listed_read_labelled_and_deleted(router):
    _, url = router()
    alpha, beta = client_for(url), client_for(url, "beta")
    first = ask(alpha, "one", store=True, metadata={"topic": "fish", "run": "1"})
    second = ask(alpha, "two", store=True, metadata={"topic": "birds"})
    ask(alpha, "three", store=False)
    ask(alpha, "four")  # store defaults to false
    stored = alpha.chat.completions.retrieve(first.id)
    assert stored.choices[0].message.content == first.choices[0].message.content
    assert stored.metadata == {"topic": "fish", "run": "1"} and stored.usage == first.usage
    assert [c.id for c in alpha.chat.completions.list()] == [first.id, second.id]  # oldest first
    assert [c.id for c in alpha.chat.completions.list(order="desc")] == [second.id, first.id]
    assert [c.id for c in alpha.chat.completions.list(metadata={"topic": "birds"})] == [second.id]
    assert [c.id for c in alpha.chat.completions.list(model="no-such-model")] == []
    page = alpha.chat.completions.list(limit=1)
    assert [c.id for c in page.data] == [first.id] and page.has_more
    assert [c.id for c in alpha.chat.completions.list(after=first.id)] == [second.id]
    messages = alpha.chat.completions.messages.list(first.id)
    assert [(m.role, m.content, m.id) for m in messages] == [("user", "one", f"{first.id}-0")]
    labelled = alpha.chat.completions.update(second.id, metadata={"topic": "birds", "seen": "yes"})
    assert labelled.metadata == {"topic": "birds", "seen": "yes"}
    assert alpha.chat.completions.retrieve(second.id).metadata == labelled.metadata
    # Another key sees none of them, and cannot change or delete them.
    assert list(beta.chat.completions.list()) == []
    for call in (
        lambda: beta.chat.completions.retrieve(first.id),
        lambda: beta.chat.completions.delete(first.id),
        lambda: beta.chat.completions.update(first.id, metadata={}),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert httpx.get(url + "/v1/chat/completions", timeout=10).status_code == 401
    deleted = alpha.chat.completions.delete(first.id)
    assert deleted.deleted and deleted.id == first.id
    with pytest.raises(openai.NotFoundError):
        alpha.chat.completions.retrieve(first.id)
    assert [c.id for c in alpha.chat.completions.list()] == [second.id]


def test_a_streamed_completion_is_stored_whole_and_outlives_its_router(router):
    process, url = router()
    alpha = client_for(url)
    chunks = list(ask(alpha, "stream me", store=True, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    [completion_id] = {c.id for c in chunks}
    process.kill()  # kill -9: the completion was stored before its [DONE] was sent
    process.wait(timeout=30)
    _, url = router()
    stored = client_for(url).chat.completions.retrieve(completion_id)
    assert stored.choices[0].message.content == text and stored.usage.completion_tokens == 6
    assert stored.object == "chat.completion"


def test_bad_store_fields_are_400s_that_name_them(router):
    _, url = router()
    alpha = client_for(url)
    for extra, param in [
        ({"store": "yes"}, "store"),
        ({"store": True, "metadata": {"k": "v" * 513}}, "metadata"),
        ({"store": True, "metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ]:
        with pytest.raises(openai.BadRequestError) as refused:
            ask(alpha, "x", extra_body=extra)
        assert refused.value.body["param"] == param
    stored = ask(alpha, "x", store=True)
    with pytest.raises(openai.BadRequestError) as refused:
        alpha.chat.completions.update(stored.id, metadata={"a": "b"}, extra_body={"model": MODEL})
    assert refused.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as refused:
        alpha.chat.completions.list(extra_query={"order": "sideways"})
    assert refused.value.body["param"] == "order"
