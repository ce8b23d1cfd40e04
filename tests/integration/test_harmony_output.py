"""Harmony output end to end: a real worker serving a tiny random gpt-oss (transformers' GptOssConfig,
the character-level tokenizer with harmony's special tokens, and no chat template of its own, so
the family's harmony template) behind a real router, asked through the official `openai` client.
A grammar (`structured_outputs`, the markers as special-token terminals) makes the model write
harmony whatever its random weights prefer, and `tool_choice` forces a call message through the
family's call grammar; the worker reads the channels into reasoning, content and tool calls, in
chat completions (whole, streamed, resumed after a failover) and in the Responses API. `<|end|>`
ends a harmony message, not the turn: an output goes on past its analysis message."""

from __future__ import annotations

import json

import openai
import pytest
import yaml

from tests.support.family_variants import COMMON
from tests.support.harmony import write_harmony_tokenizer
from tests.support.routers import start_router, stop
from tests.support.streams import read_chunks
from tests.support.tiny_model import write_random_family_model
from tests.support.workers import start_worker, tiny_worker_args

MODEL = "gpt-oss"
ASK = [{"role": "user", "content": "hi"}]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "pattern": "^[a-z]{3}$"}},
            "required": ["city"],
        },
    },
}
# Tokens of `<|channel|>analysis<|message|>abc<|end|>` and of `<|start|>assistant<|channel|>final<|message|>abc`:
# three markers each, one token a character.
ANALYSIS_TOKENS = 3 + len("analysis") + 3
FINAL_TOKENS = 3 + len("assistant") + len("final") + 3


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> tuple:
    """(directory, {harmony token: id}) of the tiny gpt-oss, whose generation ends at <|return|> or
    <|call|>; a context long enough for harmony's system message and tools, one token a character."""
    directory = tmp_path_factory.mktemp(MODEL)
    ids = {"<|return|>": 104, "<|call|>": 105}
    fields = dict(head_dim=16, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=21)
    fields.update(max_position_embeddings=1024, eos_token_id=[ids["<|return|>"], ids["<|call|>"]])
    fields["rope_parameters"] = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 128}
    write_random_family_model(directory, "GptOssConfig", "GptOssForCausalLM", {**COMMON, **fields})
    written = write_harmony_tokenizer(directory)
    assert all(written[token] == id_ for token, id_ in ids.items())
    return directory, written


@pytest.fixture(scope="module")
def endpoints(model, tmp_path_factory, shoal_cache_dir):
    """{"router": URL, "worker": URL}."""
    worker, worker_url = start_worker(tiny_worker_args(model[0], MODEL), shoal_cache_dir)
    config = tmp_path_factory.mktemp("router") / "router.yaml"
    config.write_text(yaml.safe_dump({"workers": [{"url": worker_url}]}))
    router, router_url = start_router(["--config", str(config)])
    yield {"router": router_url, "worker": worker_url}
    stop(router)
    worker.kill()
    worker.wait(timeout=30)


def harmony(ids: dict[str, int], *parts: str) -> dict:
    """structured_outputs for a Lark grammar written with harmony markers (as special tokens)."""
    rule = " ".join(f"<[{ids[part]}]>" if part in ids else part for part in parts)
    return {"structured_outputs": {"grammar": f"start: {rule}\n"}}


def think_then_answer(ids):
    return harmony(
        ids, "<|channel|>", '"analysis"', "<|message|>", "/[a-z]{3}/", "<|end|>",
        "<|start|>", '"assistant"', "<|channel|>", '"final"', "<|message|>", "/[a-z]{3}/",
    )  # fmt: skip


def think_then_call(ids):
    return harmony(
        ids, "<|channel|>", '"analysis"', "<|message|>", "/[a-z]{3}/", "<|end|>", "<|start|>", '"assistant"',
        "<|channel|>", '"commentary to=functions.get_weather "', "<|constrain|>", '"json"', "<|message|>",
        r'/\{"city":"[a-z]{3}"\}/',
    )  # fmt: skip


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0)


def chat(url: str, extra: dict, messages=ASK, max_tokens: int = 120, **fields):
    return client(url).chat.completions.create(
        model=MODEL, messages=messages, temperature=0, max_tokens=max_tokens, extra_body=extra, **fields
    )


def streamed(url: str, extra: dict, **fields) -> tuple[dict, list[str], object]:
    """({"reasoning": ..., "content": ...} joined, the kinds of the deltas in order, usage)."""
    chunks = client(url).chat.completions.create(
        model=MODEL,
        messages=ASK,
        temperature=0,
        max_tokens=120,
        stream=True,
        stream_options={"include_usage": True},
        extra_body=extra,
        **fields,
    )
    texts, kinds, usage, calls = {"reasoning": "", "content": ""}, [], None, {}
    for chunk in chunks:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            delta = choice.delta
            for kind, text in (("reasoning", getattr(delta, "reasoning_content", None)), ("content", delta.content)):
                if text:
                    texts[kind] += text
                    kinds.append(kind)
            for call in delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"name": None, "arguments": ""})
                entry["name"] = call.function.name or entry["name"]
                entry["arguments"] += call.function.arguments or ""
                kinds.append("call")
    return {**texts, "calls": [calls[i] for i in sorted(calls)]}, kinds, usage


@pytest.mark.parametrize("via", ["router", "worker"])
def test_analysis_and_final_are_reasoning_and_content_whole_and_streamed(endpoints, model, via):
    reply = chat(endpoints[via], think_then_answer(model[1]))
    message = reply.choices[0].message
    assert len(message.reasoning_content) == 3 and message.reasoning_content.isalpha()
    assert len(message.content) == 3 and message.content.isalpha()
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == ANALYSIS_TOKENS + FINAL_TOKENS
    assert reply.usage.completion_tokens_details.reasoning_tokens == ANALYSIS_TOKENS
    texts, kinds, usage = streamed(endpoints[via], think_then_answer(model[1]))
    assert (texts["reasoning"], texts["content"]) == (message.reasoning_content, message.content)
    assert kinds == ["reasoning"] * 3 + ["content"] * 3  # streamed a token at a time, reasoning first
    assert usage.completion_tokens_details.reasoning_tokens == ANALYSIS_TOKENS


def test_include_reasoning_false_drops_it(endpoints, model):
    plain = chat(endpoints["router"], think_then_answer(model[1])).choices[0].message
    dropped = chat(endpoints["router"], {**think_then_answer(model[1]), "include_reasoning": False})
    assert getattr(dropped.choices[0].message, "reasoning_content", None) is None
    assert dropped.choices[0].message.content == plain.content
    assert dropped.usage.completion_tokens_details.reasoning_tokens == ANALYSIS_TOKENS


def test_a_message_to_a_function_is_a_tool_call(endpoints, model):
    url = endpoints["router"]
    reply = chat(url, think_then_call(model[1]), tools=[WEATHER])
    message = reply.choices[0].message
    assert reply.choices[0].finish_reason == "tool_calls"
    assert message.content is None and len(message.reasoning_content) == 3
    [call] = message.tool_calls
    assert call.function.name == "get_weather" and len(json.loads(call.function.arguments)["city"]) == 3
    texts, kinds, _ = streamed(url, think_then_call(model[1]), tools=[WEATHER])
    assert texts["reasoning"] == message.reasoning_content and texts["content"] == ""
    assert texts["calls"] == [{"name": "get_weather", "arguments": call.function.arguments}]
    # Forced by tool_choice: the family's call grammar, with no reasoning first.
    forced = chat(url, {}, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert forced.choices[0].finish_reason == "tool_calls"
    [call] = forced.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and len(json.loads(call.function.arguments)["city"]) == 3


def test_a_conversation_with_reasoning_calls_and_results_is_rendered_in_harmony(endpoints):
    called = {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"abc"}'}}
        ],
    }
    result = {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}

    def prompt_tokens(*messages) -> int:
        return chat(
            endpoints["router"], {}, messages=[*ASK, *messages], tools=[WEATHER], max_tokens=1
        ).usage.prompt_tokens

    asked = prompt_tokens()
    with_call = prompt_tokens(called, result)
    # <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{...}<|call|>
    # then <|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny<|end|>
    call_message = 5 + len("assistant") + len("commentary to=functions.get_weather ") + len("json") + 14
    result_message = 4 + len("functions.get_weather to=assistant") + len("commentary") + len("sunny")
    assert with_call == asked + call_message + result_message
    thought = prompt_tokens({**called, "reasoning_content": "xyz"}, result)
    assert thought == with_call + 4 + len("assistant") + len("analysis") + len("xyz")  # an analysis message


def test_reasoning_effort_reaches_the_prompt_and_a_bad_one_is_a_400(endpoints):
    url = endpoints["router"]
    tokens = {
        effort: chat(url, {}, max_tokens=1, reasoning_effort=effort).usage.prompt_tokens
        for effort in ("low", "medium", "high")
    }
    default = chat(url, {}, max_tokens=1).usage.prompt_tokens
    assert tokens["medium"] == default == tokens["low"] + len("medium") - len("low") == tokens["high"] + 2
    with pytest.raises(openai.BadRequestError) as refused:
        chat(url, {}, max_tokens=1, reasoning_effort="extreme")
    assert refused.value.body["param"] == "reasoning_effort"
    response = client(url).responses.create(model=MODEL, input="hi", max_output_tokens=1, reasoning={"effort": "low"})
    assert response.usage.input_tokens == tokens["low"] and response.reasoning.effort == "low"
    with pytest.raises(openai.BadRequestError) as refused:
        client(url).responses.create(model=MODEL, input="hi", reasoning={"effort": "extreme"})
    assert refused.value.body["param"] == "reasoning.effort"


def test_the_responses_api_gives_reasoning_then_the_message_or_the_call(endpoints, model):
    api = client(endpoints["router"])
    expected = chat(endpoints["router"], think_then_answer(model[1])).choices[0].message
    response = api.responses.create(model=MODEL, input="hi", temperature=0, extra_body=think_then_answer(model[1]))
    thought, said = response.output
    assert thought.type == "reasoning" and [part.text for part in thought.content] == [expected.reasoning_content]
    assert said.type == "message" and response.output_text == expected.content
    assert response.usage.output_tokens_details.reasoning_tokens == ANALYSIS_TOKENS
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]
    calling = api.responses.create(
        model=MODEL, input="hi", temperature=0, tools=tools, extra_body=think_then_call(model[1])
    )
    assert [item.type for item in calling.output] == ["reasoning", "function_call"]
    assert calling.output[1].name == "get_weather"


def test_a_stream_resumed_from_its_tokens_reads_as_the_unbroken_one(endpoints, model):
    """What a router sends a worker to continue a broken stream: the tokens relayed and the
    characters the client had. Cut inside the analysis header, its body, at its end, inside the
    final header and inside the answer, the rest comes out as it did unbroken."""
    body = {
        "model": MODEL,
        "messages": ASK,
        "temperature": 1.0,
        "seed": 5,
        "max_tokens": 60,
        "stream": True,
        "stream_options": {"include_usage": True},
        **think_then_answer(model[1]),
    }
    unbroken, usage = read_chunks(endpoints["worker"], body)
    with_tokens = [c for c in unbroken if c.get("token_ids")]
    ids = [token for c in with_tokens for token in c["token_ids"]]
    assert len(ids) == len(with_tokens) == ANALYSIS_TOKENS + FINAL_TOKENS
    for cut in (1, 5, ANALYSIS_TOKENS - 2, ANALYSIS_TOKENS, ANALYSIS_TOKENS + 4, len(ids) - 1):
        had = sum(c["text_chars"] for c in with_tokens[:cut])
        resumed, resumed_usage = read_chunks(
            endpoints["worker"],
            {**body, "resume_token_ids": ids[:cut], "resume_text_offset": had, "seed": with_tokens[0]["seed"]},
        )
        rest = [c for c in resumed if c.get("token_ids")]
        assert [c["token_ids"] for c in rest] == [c["token_ids"] for c in with_tokens[cut:]], cut
        assert [c["delta"] for c in rest] == [c["delta"] for c in with_tokens[cut:]], cut
        assert resumed_usage["completion_tokens_details"] == usage["completion_tokens_details"], cut
