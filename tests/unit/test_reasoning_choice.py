"""A chat choice of a thinking model: its reasoning as `reasoning_content` (whole, or streamed as
deltas that add up to it), dropped with include_reasoning false, left in content with
separate_reasoning false, sent in one delta with stream_reasoning false; tool calls read from the
answer only; the same deltas after a resume from any point; and the request switches that decide
it (the prompt opening a section, chat_template_kwargs) validated."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from shoal.errors import InvalidRequestError
from shoal.model.errors import ChatTemplateError
from shoal.model.hf_loader import load_hf_tokenizer
from shoal.worker.chat_choice import ChatChoice
from shoal.worker.chat_prompt import chat_prompt
from shoal.worker.protocol import ChatCompletionRequest
from shoal.worker.reasoning_use import ReasoningUse
from shoal.worker.tool_calling import ToolUse
from tests.support.tiny_model import write_tiny_tokenizer

THINK = ("<think>", "</think>")
OUTPUT = "<think>\nLet me see.\n</think>\n\nIt is 4."
PROMPT = "<s>user\nhi</s>\n<s>assistant\n"
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    directory = tmp_path_factory.mktemp("tiny-tokenizer")
    write_tiny_tokenizer(directory)
    return load_hf_tokenizer(directory)


def request(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}], **fields)


def choice(tokenizer, prompt: str = PROMPT, tools: list | None = None, **fields) -> ChatChoice:
    body = request(**fields, **({"tools": tools} if tools else {}))
    tool_use = ToolUse.of(body, tokenizer) if tools else None
    reasoning = ReasoningUse.of(body, THINK, tokenizer, prompt)
    return ChatChoice(tool_use, 0, tokenizer.encode(prompt, add_special_tokens=False), reasoning)


def stream(chat: ChatChoice, pieces: list[str]) -> list[dict]:
    return [chat.delta(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]


def joined(deltas: list[dict], key: str) -> str:
    return "".join(delta.get(key) or "" for delta in deltas)


def test_reasoning_comes_as_reasoning_content_whole_and_streamed(tokenizer):
    assert choice(tokenizer).message(OUTPUT) == {
        "role": "assistant",
        "content": "It is 4.",
        "reasoning_content": "Let me see.",
    }
    deltas = stream(choice(tokenizer), list(OUTPUT))
    assert joined(deltas, "reasoning_content") == "Let me see." and joined(deltas, "content") == "It is 4."
    assert len([d for d in deltas if d.get("reasoning_content")]) > 1  # streamed, not sent at the end
    last_reasoning = max(i for i, d in enumerate(deltas) if d.get("reasoning_content"))
    assert all("content" not in d for d in deltas[: last_reasoning + 1])  # content only after </think>


def test_include_reasoning_false_drops_it(tokenizer):
    assert choice(tokenizer, include_reasoning=False).message(OUTPUT) == {"role": "assistant", "content": "It is 4."}
    deltas = stream(choice(tokenizer, include_reasoning=False), list(OUTPUT))
    assert joined(deltas, "reasoning_content") == "" and joined(deltas, "content") == "It is 4."


def test_separate_reasoning_false_leaves_it_in_content_as_written(tokenizer):
    assert ReasoningUse.of(request(separate_reasoning=False), THINK, tokenizer, PROMPT) is None
    assert choice(tokenizer, separate_reasoning=False).message(OUTPUT) == {"role": "assistant", "content": OUTPUT}
    assert joined(stream(choice(tokenizer, separate_reasoning=False), list(OUTPUT)), "content") == OUTPUT


def test_a_model_without_markers_splits_nothing(tokenizer):
    assert ReasoningUse.of(request(), None, tokenizer, PROMPT) is None


def test_stream_reasoning_false_sends_it_in_one_delta_when_the_section_closes(tokenizer):
    deltas = stream(choice(tokenizer, stream_reasoning=False), list(OUTPUT))
    sent = [i for i, d in enumerate(deltas) if d.get("reasoning_content")]
    assert len(sent) == 1 and deltas[sent[0]]["reasoning_content"] == "Let me see."
    assert OUTPUT[: sent[0] + 1].endswith("</think>")
    # A section never closed comes out at the end.
    deltas = stream(choice(tokenizer, stream_reasoning=False), list("<think>still going"))
    assert [d for d in deltas if d] == [{"reasoning_content": "still going"}] and deltas[-1]


def test_the_prompt_decides_whether_the_output_begins_inside_a_section(tokenizer):
    opened = PROMPT + "<think>\n"
    assert ReasoningUse.of(request(), THINK, tokenizer, opened).opened
    assert not ReasoningUse.of(request(), THINK, tokenizer, PROMPT + "<think>\n\n</think>\n\n").opened
    assert choice(tokenizer, opened).message("Let me see.\n</think>\n\nIt is 4.") == {
        "role": "assistant",
        "content": "It is 4.",
        "reasoning_content": "Let me see.",
    }

    # A final assistant message that opened a section and is continued: the output goes on in it.
    def continuing(text: str) -> ChatCompletionRequest:
        return ChatCompletionRequest(
            model="m",
            messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": text}],
            continue_final_message=True,
            add_generation_prompt=False,
        )

    assert ReasoningUse.of(continuing("<think>\nHm, "), THINK, tokenizer, PROMPT + "<think>\nHm, ").opened
    assert not ReasoningUse.of(continuing("<think>a</think>"), THINK, tokenizer, PROMPT + "<think>a</think>").opened
    assert ReasoningUse.of(continuing("Hm, "), THINK, tokenizer, PROMPT + "<think>\nHm, ").opened


def test_tool_calls_are_read_from_the_answer_after_the_reasoning(tokenizer):
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    text = '<think>I should call add.</think>\n<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'
    message = choice(tokenizer, tools=[tool]).message(text)
    assert message["reasoning_content"] == "I should call add." and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "add", "arguments": '{"a": 1}'}
    deltas = stream(choice(tokenizer, tools=[tool]), list(text))
    assert joined(deltas, "reasoning_content") == "I should call add."
    assert "".join(c["function"]["arguments"] for d in deltas for c in d.get("tool_calls") or []) == '{"a": 1}'


@pytest.mark.parametrize("stream_reasoning", [True, False])
def test_a_stream_resumed_at_any_point_sends_what_the_unbroken_one_would(tokenizer, stream_reasoning):
    pieces = list(OUTPUT)
    unbroken = stream(choice(tokenizer, stream_reasoning=stream_reasoning), pieces)
    for cut in range(1, len(pieces)):
        resumed = choice(tokenizer, stream_reasoning=stream_reasoning)
        resumed.replay("".join(pieces[:cut]), [])
        rest = [resumed.delta(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces) if i >= cut]
        assert rest == unbroken[cut:], cut


def test_reasoning_tokens_are_counted_the_same_streamed_whole_and_resumed(tokenizer):
    ids = tokenizer.encode(OUTPUT, add_special_tokens=False)
    whole = choice(tokenizer)
    whole.tokens(ids)
    whole.message(OUTPUT)
    expected = len(OUTPUT[: OUTPUT.index("</think>") + len("</think>")])  # one token a character
    assert whole.reasoning_tokens() == expected
    streamed = choice(tokenizer)
    for token, char in zip(ids, OUTPUT, strict=True):
        streamed.tokens([token])
        streamed.delta(char, final=False)
    assert streamed.reasoning_tokens() == expected
    resumed = choice(tokenizer)
    resumed.replay(OUTPUT[:10], ids[:10])
    for token, char in zip(ids[10:], OUTPUT[10:], strict=True):
        resumed.tokens([token])
        resumed.delta(char, final=False)
    assert resumed.reasoning_tokens() == expected
    assert choice(tokenizer, separate_reasoning=False).reasoning_tokens() is None


def test_chat_template_kwargs_must_be_an_object_that_sets_no_render_variable():
    assert request(chat_template_kwargs={"enable_thinking": False}).chat_template_kwargs == {"enable_thinking": False}
    for bad in (["enable_thinking"], "enable_thinking=false", 3, {"messages": []}, {"add_generation_prompt": False}):
        with pytest.raises(ValidationError) as refused:
            request(chat_template_kwargs=bad)
        assert refused.value.errors()[0]["loc"] == ("chat_template_kwargs",)


def test_only_assistant_messages_carry_reasoning_content():
    body = ChatCompletionRequest(
        model="m",
        messages=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "Hello.", "reasoning_content": "A greeting."},
            {"role": "user", "content": "and?"},
        ],
    )
    assert body.messages[1].reasoning_content == "A greeting."
    with pytest.raises(ValidationError):
        ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi", "reasoning_content": "x"}])


def test_chat_template_kwargs_reach_the_template_and_its_refusal_is_the_request_s_fault(tmp_path):
    write_tiny_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    config["chat_template"] = (
        "{% if enable_thinking is defined and enable_thinking is false %}{{ raise_exception('no thinking here') }}"
        "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}{{ eos_token }}|{{ flavour | default('') }}"
    )
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tokenizer = load_hf_tokenizer(tmp_path)
    assert tokenizer.apply_chat_template(ASK) == "hi</s>|"
    assert tokenizer.apply_chat_template(ASK, template_kwargs={"flavour": "x", "eos_token": "E"}) == "hiE|x"
    with pytest.raises(ChatTemplateError):
        tokenizer.apply_chat_template(ASK, template_kwargs={"messages": []})
    refused = request(chat_template_kwargs={"enable_thinking": False})
    with pytest.raises(InvalidRequestError, match="no thinking here"):
        chat_prompt(tokenizer, refused, None)
    assert chat_prompt(tokenizer, request(chat_template_kwargs={"flavour": "y"}), None) == "hi</s>|y"
