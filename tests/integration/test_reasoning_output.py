"""Reasoning output end to end: real workers of a tiny random Qwen3 (transformers' Qwen3Config, the
character-level tiny tokenizer, so `<think>` is 7 tokens) behind a real router, asked through the
official `openai` client. A regular expression (`structured_outputs`) makes the model write
`<think>...</think>...` whatever its random weights prefer; the worker, knowing the model's family,
splits it into reasoning and content, in chat completions (whole and streamed) and in the Responses
API. One model's chat template switches thinking off with `enable_thinking: false` (Qwen3's hybrid
models); the other's opens the section in the prompt (Qwen3's thinking models), so its output
begins inside it."""

from __future__ import annotations

import json

import openai
import pytest
import yaml

from tests.support.family_variants import COMMON, LAYER_VARIANTS
from tests.support.routers import start_router, stop
from tests.support.streams import read_chunks
from tests.support.tiny_model import write_random_family_model
from tests.support.workers import spawn_worker, tiny_worker_args, wait_ready

HYBRID, THINKING = "qwen3-hybrid", "qwen3-thinking"
CHATML_TURNS = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.reasoning_content is defined %}<think>\n{{ m.reasoning_content }}\n</think>\n\n{% endif %}"
    "{{ m.content }}<|im_end|>\n{% endfor %}"
)
TEMPLATES = {
    HYBRID: CHATML_TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}",
    THINKING: CHATML_TURNS + "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}",
}
# The Qwen3 golden variant: per-head q/k norms, tied embeddings.
QWEN3 = {**COMMON, **LAYER_VARIANTS["qwen3-qk-norm"][2]}
THINK_THEN_ANSWER = {"structured_outputs": {"regex": "<think>[a-z]{3}</think>[a-z]{3}"}}
REASONING_TOKENS = len("<think>abc</think>")  # one token a character
ASK = [{"role": "user", "content": "hi"}]


def write_qwen3(directory, template: str):
    write_random_family_model(directory, "Qwen3Config", "Qwen3ForCausalLM", QWEN3)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))


@pytest.fixture(scope="module")
def endpoints(tmp_path_factory, shoal_cache_dir):
    """{"router": URL, HYBRID: worker URL, THINKING: worker URL}: a worker of each model, the router
    in front of both."""
    spawned = {}
    for name, template in TEMPLATES.items():
        directory = tmp_path_factory.mktemp(name)
        write_qwen3(directory, template)
        spawned[name] = spawn_worker(tiny_worker_args(directory, name), shoal_cache_dir)
    workers = {name: wait_ready(*started) for name, started in spawned.items()}
    config = tmp_path_factory.mktemp("router") / "router.yaml"
    config.write_text(yaml.safe_dump({"workers": [{"url": url} for _, url in workers.values()]}))
    router, router_url = start_router(["--config", str(config)])
    yield {"router": router_url, **{name: url for name, (_, url) in workers.items()}}
    stop(router)
    for process, _ in workers.values():
        process.kill()
        process.wait(timeout=30)


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def chat(url: str, model: str = HYBRID, **extra):
    return client(url).chat.completions.create(
        model=model, messages=ASK, temperature=0, max_tokens=40, extra_body={**THINK_THEN_ANSWER, **extra}
    )


def streamed(url: str, model: str = HYBRID, **extra) -> tuple[list[str], list[str], object]:
    """(reasoning deltas, content deltas, usage) of a streamed chat completion; asserts that no
    content delta comes before the last reasoning delta."""
    chunks = client(url).chat.completions.create(
        model=model,
        messages=ASK,
        temperature=0,
        max_tokens=40,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={**THINK_THEN_ANSWER, **extra},
    )
    order, usage = [], None
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            if getattr(choice.delta, "reasoning_content", None):
                order.append(("reasoning", choice.delta.reasoning_content))
            if choice.delta.content:
                order.append(("content", choice.delta.content))
    kinds = [kind for kind, _ in order]
    assert kinds == sorted(kinds, key=lambda kind: kind != "reasoning"), kinds
    return [t for k, t in order if k == "reasoning"], [t for k, t in order if k == "content"], usage


@pytest.mark.parametrize("via", ["router", HYBRID])
def test_reasoning_comes_back_as_reasoning_content_whole_and_streamed(endpoints, via):
    reply = chat(endpoints[via])
    message = reply.choices[0].message
    assert len(message.reasoning_content) == 3 and message.reasoning_content.isalpha()
    assert len(message.content) == 3 and message.content.isalpha()
    assert reply.usage.completion_tokens == REASONING_TOKENS + 3
    assert reply.usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS
    reasoning, content, usage = streamed(endpoints[via])
    assert len(reasoning) == 3  # one delta a token: streamed, not sent at the end
    assert "".join(reasoning) == message.reasoning_content and "".join(content) == message.content
    assert usage.completion_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_the_reasoning_switches(endpoints):
    url = endpoints["router"]
    plain = chat(url).choices[0].message
    dropped = chat(url, include_reasoning=False).choices[0].message
    assert getattr(dropped, "reasoning_content", None) is None and dropped.content == plain.content
    assert streamed(url, include_reasoning=False)[:2] == ([], list(plain.content))
    whole = chat(url, separate_reasoning=False).choices[0].message
    assert whole.content == f"<think>{plain.reasoning_content}</think>{plain.content}"
    assert getattr(whole, "reasoning_content", None) is None
    reasoning, content, _ = streamed(url, stream_reasoning=False)
    assert reasoning == [plain.reasoning_content] and "".join(content) == plain.content


def test_enable_thinking_reaches_the_chat_template(endpoints):
    url = endpoints["router"]
    answer_only = {"structured_outputs": {"regex": "[a-z]{3}"}}
    thinking = chat(url, **answer_only)
    off = chat(url, **answer_only, chat_template_kwargs={"enable_thinking": False})
    # The template closed an empty section in the prompt: "<think>\n\n</think>\n\n", 19 tokens.
    assert off.usage.prompt_tokens == thinking.usage.prompt_tokens + 19
    assert getattr(off.choices[0].message, "reasoning_content", None) is None
    assert len(off.choices[0].message.content) == 3
    assert off.usage.completion_tokens_details.reasoning_tokens == 0


def test_an_assistant_message_s_reasoning_content_reaches_the_chat_template(endpoints):
    history = [*ASK, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
    bare = client(endpoints[HYBRID]).chat.completions.create(model=HYBRID, messages=history, max_tokens=1)
    history[1] = {**history[1], "reasoning_content": "a greeting"}
    kept = client(endpoints[HYBRID]).chat.completions.create(model=HYBRID, messages=history, max_tokens=1)
    assert kept.usage.prompt_tokens == bare.usage.prompt_tokens + len("<think>\na greeting\n</think>\n\n")


@pytest.mark.parametrize("via", ["router", HYBRID])
@pytest.mark.parametrize("bad", [["enable_thinking"], "enable_thinking", {"messages": []}])
def test_chat_template_kwargs_that_is_not_an_object_of_free_names_is_a_400_naming_it(endpoints, via, bad):
    with pytest.raises(openai.BadRequestError) as refused:
        chat(endpoints[via], chat_template_kwargs=bad)
    assert refused.value.body["param"] == "chat_template_kwargs"
    assert "chat_template_kwargs" in refused.value.body["message"]


def test_output_that_begins_inside_a_section_the_prompt_opened(endpoints):
    url = endpoints["router"]
    reply = chat(url, THINKING, structured_outputs={"regex": "[a-z]{3}</think>[a-z]{3}"})
    message = reply.choices[0].message
    assert len(message.reasoning_content) == 3 and len(message.content) == 3
    assert reply.usage.completion_tokens_details.reasoning_tokens == len("abc</think>")
    # No end marker ever comes: all of it is reasoning, as the section was open.
    unended = chat(url, THINKING, structured_outputs={"regex": "[a-z]{5}"})
    assert len(unended.choices[0].message.reasoning_content) == 5 and unended.choices[0].message.content == ""
    assert unended.usage.completion_tokens_details.reasoning_tokens == 5
    reasoning, content, _ = streamed(url, THINKING, structured_outputs={"regex": "[a-z]{5}"})
    assert "".join(reasoning) == unended.choices[0].message.reasoning_content and content == []


def test_the_responses_api_gives_a_reasoning_item_before_the_message(endpoints):
    api = client(endpoints["router"])
    expected = chat(endpoints["router"]).choices[0].message
    response = api.responses.create(model=HYBRID, input="hi", temperature=0, extra_body=THINK_THEN_ANSWER)
    thought, said = response.output
    assert thought.type == "reasoning" and thought.summary == []
    assert [part.text for part in thought.content] == [expected.reasoning_content]
    assert said.type == "message" and response.output_text == expected.content
    assert response.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS
    # The next turn continues it, stored or sent back as input with its reasoning item.
    follow = api.responses.create(
        model=HYBRID,
        input="more",
        previous_response_id=response.id,
        max_output_tokens=2,
        extra_body={"ignore_eos": True},
    )
    assert follow.status == "incomplete"
    again = api.responses.create(
        model=HYBRID,
        input=[
            *ASK,
            *(item.model_dump(exclude_none=True) for item in response.output),
            {"role": "user", "content": "more"},
        ],
        max_output_tokens=2,
        extra_body={"ignore_eos": True},
    )
    assert again.usage.input_tokens == follow.usage.input_tokens


def test_the_responses_api_streams_reasoning_text_events(endpoints):
    expected = chat(endpoints["router"]).choices[0].message
    events = list(
        client(endpoints["router"]).responses.create(
            model=HYBRID, input="hi", temperature=0, stream=True, extra_body=THINK_THEN_ANSWER
        )
    )
    kinds = [event.type for event in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    first_text = kinds.index("response.output_text.delta")
    reasoning_deltas = [e for e in events if e.type == "response.reasoning_text.delta"]
    assert reasoning_deltas and all(kinds.index(e.type) < first_text for e in reasoning_deltas)
    assert "".join(e.delta for e in reasoning_deltas) == expected.reasoning_content
    [done] = [e for e in events if e.type == "response.reasoning_text.done"]
    assert done.text == expected.reasoning_content and done.output_index == 0
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["reasoning", "message"]
    final = events[-1]
    assert final.type == "response.completed"
    assert [item.type for item in final.response.output] == ["reasoning", "message"]
    assert final.response.output_text == expected.content
    assert final.response.usage.output_tokens_details.reasoning_tokens == REASONING_TOKENS


def test_a_stream_resumed_from_its_tokens_splits_as_the_unbroken_one(endpoints):
    """What a router sends a worker to continue a broken stream (token-exact failover): the tokens
    relayed and the raw characters the client had. Cut inside `<think>`, inside the reasoning,
    inside `</think>` and inside the answer, the rest comes out as it did unbroken."""
    body = {
        "model": HYBRID,
        "messages": ASK,
        "temperature": 1.0,
        "seed": 11,
        "max_tokens": 60,
        "stream": True,
        "stream_options": {"include_usage": True},
        "structured_outputs": {"regex": "<think>[a-z]{12}</think>[a-z]{6}"},
    }
    url = endpoints[HYBRID]
    unbroken, usage = read_chunks(url, body)
    with_tokens = [c for c in unbroken if c.get("token_ids")]
    assert len(with_tokens) == 7 + 12 + 8 + 6 and all(len(c["token_ids"]) == 1 for c in with_tokens)
    ids = [c["token_ids"][0] for c in with_tokens]
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 7 + 12 + 8
    for cut in (3, 10, 7 + 12 + 4, 7 + 12 + 8 + 2):
        had = sum(c["text_chars"] for c in with_tokens[:cut])
        resumed, resumed_usage = read_chunks(
            url, {**body, "resume_token_ids": ids[:cut], "resume_text_offset": had, "seed": with_tokens[0]["seed"]}
        )
        rest = [c for c in resumed if c.get("token_ids")]
        assert [c["token_ids"] for c in rest] == [c["token_ids"] for c in with_tokens[cut:]], cut
        assert [c["delta"] for c in rest] == [c["delta"] for c in with_tokens[cut:]], cut
        assert resumed_usage["completion_tokens_details"] == usage["completion_tokens_details"]
