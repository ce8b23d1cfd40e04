"""A real router in front of two real tiny workers whose KV caches hold only a few conversations:
conversations over several system prompts, four at a time, through the openai client. The default
policy keeps each conversation on one worker and each system prompt's conversations together,
instead of spreading every prefix over both caches (which then hold none of them). Asserts where
requests went, not how fast they ran."""

from __future__ import annotations

from collections import Counter, defaultdict
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import yaml

from tests.support.routers import ADMIN_TOKEN, start_router, stop
from tests.support.workers import MODEL, spawn_worker, wait_ready

SYSTEM_PROMPTS = 4
CONVERSATIONS = 8
TURNS = 4


@pytest.fixture(scope="module")
def router_over_small_caches(tiny_model_dir, shoal_cache_dir, tmp_path_factory):
    """Two workers with 1,024 tokens of KV cache each (the tiny model's tokens are characters; a
    conversation ends near 400), 10 ms a step, behind a router with the default policy."""
    common = ["--model", str(tiny_model_dir), "--dtype", "float32", "--served-model-name", MODEL]
    workers = [
        wait_ready(*spawn_worker([*common, "--kv-cache", "512KiB", "--step-delay-ms", "10"], shoal_cache_dir))
        for _ in range(2)
    ]
    config = tmp_path_factory.mktemp("router") / "router.yaml"
    config.write_text(yaml.safe_dump({"chars_per_token": 1.0, "workers": [{"url": url} for _, url in workers]}))
    router, url = start_router(["--config", str(config)], env={"SHOAL_ADMIN_TOKEN": ADMIN_TOKEN})
    yield url
    stop(router)
    for process, _ in workers:
        stop(process)


def converse(client: openai.OpenAI, number: int, round_: int) -> list[tuple[int, str]]:
    """One conversation's turns; (its system prompt, the worker that served it) per turn."""
    system = number % SYSTEM_PROMPTS
    messages = [{"role": "system", "content": f"System prompt {system}: answer briefly. " * 4}]
    served = []
    for turn in range(TURNS):
        messages.append({"role": "user", "content": f"round {round_}, conversation {number}, question {turn}?"})
        response = client.chat.completions.with_raw_response.create(
            model=MODEL, messages=messages, max_tokens=8, temperature=0
        )
        served.append((system, response.headers["x-shoal-worker"]))
        messages.append({"role": "assistant", "content": response.parse().choices[0].message.content})
    return served


def test_conversations_and_system_prompts_stay_together_when_caches_hold_only_a_few(router_over_small_caches):
    client = openai.OpenAI(base_url=router_over_small_caches + "/v1", api_key="unused", max_retries=0)
    for round_ in range(2):  # the first places the system prompts and fills the caches; the second is asserted
        with ThreadPoolExecutor(max_workers=4) as pool:
            rounds = [round_] * CONVERSATIONS
            conversations = list(pool.map(converse, [client] * CONVERSATIONS, range(CONVERSATIONS), rounds))
    moves = sum(a != b for turns in conversations for (_, a), (_, b) in zip(turns, turns[1:]))
    continuations = CONVERSATIONS * (TURNS - 1)
    # A policy blind to the caches moves about half of them; reports lag the load on a busy machine,
    # so a few moves when four conversations meet on one worker are the policy working.
    assert moves <= continuations // 4, f"{moves} of {continuations} turns moved off their conversation's worker"
    by_system: dict[int, Counter] = defaultdict(Counter)
    for turns in conversations:
        for system, worker in turns:
            by_system[system][worker] += 1
    together = sum(counts.most_common(1)[0][1] for counts in by_system.values())
    assert together >= 0.85 * CONVERSATIONS * TURNS, dict(by_system)
    assert len({worker for turns in conversations for _, worker in turns}) == 2  # both workers serve
