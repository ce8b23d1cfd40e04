"""A gpt-oss chat choice: its harmony output as reasoning_content, content and tool_calls, whole or
streamed (deltas that add up to the message, the same after a resume from any point), with the
reasoning switches and reasoning tokens counted from the analysis messages; the harmony template's
multi-turn rendering (reasoning, calls, tool results) and `reasoning_effort` reaching it."""

from __future__ import annotations

import logging
import re

import pytest
from pydantic import ValidationError

from shoal.errors import InvalidRequestError
from shoal.model.families.chat_templates import HARMONY
from shoal.model.hf_loader import load_hf_tokenizer
from shoal.worker.chat_choice import ChatChoice
from shoal.worker.chat_prompt import chat_prompt
from shoal.worker.protocol import ChatCompletionRequest
from shoal.worker.reasoning_use import ReasoningUse
from shoal.worker.tool_calling import ToolUse
from tests.support.harmony import write_harmony_tokenizer

ASK = [{"role": "user", "content": "hi"}]
ANALYSIS = "<|channel|>analysis<|message|>Greeted.<|end|>"
ANSWER = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Hello!"
CALL = (
    ANALYSIS + "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
    '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}'
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather now",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "A city"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("harmony-tokenizer")
    write_harmony_tokenizer(directory, HARMONY)
    return load_hf_tokenizer(directory)


def request(messages=ASK, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=messages, **fields)


def choice(tokenizer, **fields) -> ChatChoice:
    body = request(**fields)
    tool_use = ToolUse.of(body, tokenizer, harmony=True)
    prompt = chat_prompt(tokenizer, body, tool_use)
    reasoning = ReasoningUse.of(body, None, tokenizer, prompt, harmony=True)
    return ChatChoice(tool_use, 0, tokenizer.encode(prompt, add_special_tokens=False), reasoning, False)


def stream(chat: ChatChoice, pieces: list[str]) -> list[dict]:
    return [chat.delta(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]


def joined(deltas: list[dict], key: str) -> str:
    return "".join(delta.get(key) or "" for delta in deltas)


def test_analysis_is_reasoning_content_and_final_is_content_whole_and_streamed(tokenizer):
    assert choice(tokenizer).message(ANSWER) == {
        "role": "assistant",
        "content": "Hello!",
        "reasoning_content": "Greeted.",
    }
    deltas = stream(choice(tokenizer), list(ANSWER))
    assert joined(deltas, "reasoning_content") == "Greeted." and joined(deltas, "content") == "Hello!"
    assert len([d for d in deltas if d.get("reasoning_content")]) == len("Greeted.")  # streamed as it comes
    assert all(not d for d in deltas[: len("<|channel|>analysis<|message|>")])  # the header is not given out


def test_a_call_message_is_a_tool_call_and_its_preamble_content(tokenizer):
    chat = choice(tokenizer, tools=[WEATHER])
    message = chat.message(CALL)
    assert message["reasoning_content"] == "Greeted." and message["content"] == "Checking."
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city":"Paris"}'}
    assert chat.finish_reason("stop") == "tool_calls" and chat.finish_reason("length") == "length"
    deltas = stream(choice(tokenizer, tools=[WEATHER]), list(CALL))
    calls = [c for d in deltas for c in d.get("tool_calls") or []]
    assert calls[0]["function"]["name"] == "get_weather" and calls[0]["id"] == call["id"]
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city":"Paris"}'
    assert choice(tokenizer).finish_reason("stop") == "stop"  # no tools: a call message is content
    assert choice(tokenizer).message(CALL)["content"] == 'Checking.{"city":"Paris"}'


def test_the_reasoning_switches(tokenizer):
    assert choice(tokenizer, include_reasoning=False).message(ANSWER) == {"role": "assistant", "content": "Hello!"}
    dropped = stream(choice(tokenizer, include_reasoning=False), list(ANSWER))
    assert joined(dropped, "reasoning_content") == "" and joined(dropped, "content") == "Hello!"
    deltas = stream(choice(tokenizer, stream_reasoning=False), list(ANSWER))
    sent = [i for i, d in enumerate(deltas) if d.get("reasoning_content")]
    assert len(sent) == 1 and deltas[sent[0]]["reasoning_content"] == "Greeted."
    assert ANSWER[: sent[0] + 1] == ANALYSIS  # sent once the analysis message ends
    with pytest.raises(InvalidRequestError) as refused:
        choice(tokenizer, separate_reasoning=False)
    assert refused.value.param == "separate_reasoning"


@pytest.mark.parametrize("output", [ANSWER, CALL])
def test_a_stream_resumed_at_any_point_sends_what_the_unbroken_one_would(tokenizer, output):
    pieces = list(output)
    unbroken = stream(choice(tokenizer, tools=[WEATHER]), pieces)
    for cut in range(1, len(pieces)):
        resumed = choice(tokenizer, tools=[WEATHER])
        resumed.replay("".join(pieces[:cut]), [])
        rest = [resumed.delta(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces) if i >= cut]
        assert rest == unbroken[cut:], cut


def test_reasoning_tokens_are_the_analysis_messages_tokens_streamed_whole_and_resumed(tokenizer):
    ids = tokenizer.encode(ANSWER, add_special_tokens=False)
    texts = [tokenizer.decode([i], skip_special_tokens=False) for i in ids]
    assert "".join(texts) == ANSWER
    expected = len(tokenizer.encode(ANALYSIS, add_special_tokens=False))
    assert expected == 3 + len("analysis") + len("Greeted.")  # three markers, one token each
    whole = choice(tokenizer)
    whole.tokens(ids)
    whole.message(ANSWER)
    assert whole.reasoning_tokens() == expected
    for cut in (0, 5, 15, len(ids) - 2):
        resumed = choice(tokenizer)
        resumed.replay("".join(texts[:cut]), ids[:cut])
        for token, text in zip(ids[cut:], texts[cut:]):
            resumed.tokens([token])
            resumed.delta(text, final=False)
        assert resumed.reasoning_tokens() == expected, cut


def test_a_forced_call_is_a_harmony_call_message_and_keeps_special_tokens(tokenizer):
    tool_use = ToolUse.of(request(tools=[WEATHER], tool_choice="required"), tokenizer, harmony=True)
    assert not tool_use.skip_special_tokens
    grammar = tool_use.constraint(tokenizer).grammar
    channel, constrain, message = (
        tokenizer.encode(m, add_special_tokens=False)[0] for m in ("<|channel|>", "<|constrain|>", "<|message|>")
    )
    assert (
        f'call0: <[{channel}]> "commentary to=functions.get_weather " <[{constrain}]> "json" <[{message}]>' in grammar
    )


def prompt_of(tokenizer, **fields) -> str:
    body = request(**fields)
    return chat_prompt(tokenizer, body, ToolUse.of(body, tokenizer, harmony=True))


def test_the_template_renders_reasoning_calls_and_tool_results_in_harmony(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "reasoning_content": "Need the weather.",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"sunny": true}'},
        {"role": "assistant", "content": "Sunny.", "reasoning_content": "A finished turn's: dropped."},
        {"role": "user", "content": "Thanks"},
    ]
    text = prompt_of(tokenizer, messages=messages, tools=[WEATHER])
    date = re.search(r"Current date: (\d{4}-\d\d-\d\d)\n", text).group(1)
    assert text == (
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n"
        f"Knowledge cutoff: 2024-06\nCurrent date: {date}\n\nReasoning: medium\n\n"
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.\n"
        "Calls to these tools must go to the commentary channel: 'functions'.<|end|>"
        "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n# Tools\n\n## functions\n\n"
        "namespace functions {\n\n// The weather now\ntype get_weather = (_: {\n// A city\ncity: string,\n"
        'unit?: "c" | "f",\n}) => any;\n\n} // namespace functions<|end|>'
        "<|start|>user<|message|>Weather in Paris?<|end|>"
        "<|start|>assistant<|channel|>analysis<|message|>Need the weather.<|end|>"
        "<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        '{"city":"Paris"}<|call|>'
        '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{"sunny": true}<|end|>'
        "<|start|>assistant<|channel|>final<|message|>Sunny.<|end|>"
        "<|start|>user<|message|>Thanks<|end|><|start|>assistant"
    )
    # Without tools in this request, the history's calls and results are still harmony messages.
    assert "<|start|>functions.get_weather to=assistant" in prompt_of(tokenizer, messages=messages)
    with pytest.raises(InvalidRequestError, match="answers no earlier tool call"):
        prompt_of(tokenizer, messages=[*ASK, {"role": "tool", "tool_call_id": "nope", "content": "x"}])


def test_reasoning_effort_reaches_the_template(tokenizer):
    assert "\n\nReasoning: medium\n\n" in prompt_of(tokenizer)
    for effort in ("low", "medium", "high"):
        assert f"\n\nReasoning: {effort}\n\n" in prompt_of(tokenizer, reasoning_effort=effort)
    with pytest.raises(ValidationError) as refused:
        request(reasoning_effort="extreme")
    assert refused.value.errors()[0]["loc"] == ("reasoning_effort",)
    with pytest.raises(InvalidRequestError) as twice:
        prompt_of(tokenizer, reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"})
    assert twice.value.param == "reasoning_effort"


def test_reasoning_effort_is_logged_as_unused_where_the_template_does_not_read_it(tmp_path, caplog):
    write_harmony_tokenizer(tmp_path, "{% for m in messages %}{{ m.content }}{% endfor %}")
    plain = load_hf_tokenizer(tmp_path)
    with caplog.at_level(logging.INFO, logger="shoal.worker.chat_prompt"):
        assert chat_prompt(plain, request(reasoning_effort="high"), None) == "hi"
    assert any("reasoning_effort 'high' is unused" in record.getMessage() for record in caplog.records)
