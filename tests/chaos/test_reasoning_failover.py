"""A thinking model's stream whose worker is killed with -9 inside its reasoning, or inside the
`</think>` that ends it, continues on another worker token-exact, and the client gets the same
reasoning and the same answer as without the fault: the next worker replays the text the client
had through its reasoning parser, which picks up where the first one was (a marker half sent
included)."""

from __future__ import annotations

import json
import os
import signal

import pytest

from tests.support.failover_trio import failover_trio
from tests.support.family_variants import COMMON, LAYER_VARIANTS
from tests.support.streams import read_stream
from tests.support.tiny_model import write_random_family_model
from tests.support.workers import tiny_worker_args

MODEL = "qwen3-tiny"
# The Qwen3 golden variant: per-head q/k norms, tied embeddings.
QWEN3 = {**COMMON, **LAYER_VARIANTS["qwen3-qk-norm"][2], "max_position_embeddings": 512}
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
REASONING_CHARS, ANSWER_CHARS = 40, 20


@pytest.fixture(scope="module")
def trio(tmp_path_factory, shoal_cache_dir):
    """Three workers of a tiny random Qwen3 at 10 ms a step behind a router: each test kills the
    one its stream runs on, and the rest carry it on."""
    directory = tmp_path_factory.mktemp("qwen3")
    write_random_family_model(directory, "Qwen3Config", "Qwen3ForCausalLM", QWEN3)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": TEMPLATE}))
    args = tiny_worker_args(directory, MODEL, step_delay_ms=10)
    yield from failover_trio(args, shoal_cache_dir, tmp_path_factory.mktemp("reasoning-failover"))


@pytest.mark.parametrize(
    "after_tokens",
    [
        pytest.param(len("<think>") + 15, id="inside-the-reasoning"),
        pytest.param(len("<think>") + REASONING_CHARS + 3, id="inside-the-end-marker"),
    ],
)
def test_a_reasoning_stream_survives_its_worker_killed(trio, after_tokens):
    url, processes = trio
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "think first"}],
        "temperature": 1.0,
        "seed": 17,
        "max_tokens": 200,
        "stream": True,
        "stream_options": {"include_usage": True},
        "structured_outputs": {"regex": f"<think>[a-z]{{{REASONING_CHARS}}}</think>[a-z]{{{ANSWER_CHARS}}}"},
    }
    clean = read_stream(url, body)
    assert len(clean["reasoning"]) == REASONING_CHARS and len(clean["text"]) == ANSWER_CHARS
    killed = {}

    def kill(worker: str) -> None:
        os.kill(processes[worker].pid, signal.SIGKILL)
        killed["worker"] = worker

    faulty = read_stream(url, body, fault=kill, after_tokens=after_tokens)
    assert processes[killed["worker"]].wait(timeout=10) == -signal.SIGKILL  # it went on elsewhere
    assert faulty["ids"] == clean["ids"]
    assert faulty["reasoning"] == clean["reasoning"] and faulty["text"] == clean["text"]
    assert faulty["usage"]["completion_tokens_details"] == {
        "reasoning_tokens": len("<think></think>") + REASONING_CHARS
    }
    assert faulty["roles"] == 1 and len(faulty["response_ids"]) == 1
