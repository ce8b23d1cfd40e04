"""The grammar compiler on the bundled model's tokenizer: masks allow exactly what the grammar
allows, a matcher depends only on its own tokens, compiled grammars are cached, and what cannot be
enforced is refused with the problem named."""

from __future__ import annotations

import json
import threading

import pytest
import torch

from shoal.engine.grammar import GrammarCompiler
from shoal.engine.structured_outputs import StructuredOutputs
from shoal.errors import InvalidRequestError
from shoal.model.loader import load_checkpoint
from shoal.worker.tool_call_format import HERMES

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "s": {"type": "string"}}, "required": ["n", "s"]}


@pytest.fixture(scope="module")
def compiler(tiny_model_dir, shoal_cache_dir):
    tokenizer = load_checkpoint(str(tiny_model_dir), torch.float32, str(shoal_cache_dir)).tokenizer
    return GrammarCompiler(tokenizer, 128, tokenizer.eos_token_ids), tokenizer


def walk(compiler: GrammarCompiler, spec: StructuredOutputs, text: str) -> list[torch.Tensor]:
    """The masks along `text`, token by token; each token must be allowed by the mask before it."""
    grammar, tokenizer = compiler
    matcher = grammar.matcher(spec)
    masks = []
    for token in tokenizer.encode(text, add_special_tokens=False):
        [mask], [only] = grammar.allowed_tokens([matcher])
        assert mask[token], (text, token)
        assert only == (token if mask.sum() == 1 else None)
        masks.append(mask)
        assert matcher.consume_token(token)
    assert matcher.is_accepting()
    return masks


def test_masks_follow_the_grammar(compiler):
    grammar, tokenizer = compiler
    masks = walk(compiler, StructuredOutputs.from_schema(SCHEMA, "x"), '{"n": 12, "s": "ok"}')
    assert masks[0].sum() == 1  # only "{" may open the object
    walk(compiler, StructuredOutputs(regex="[ab]+c"), "abbac")
    walk(compiler, StructuredOutputs(choice=("yes", "no way")), "no way")
    walk(compiler, StructuredOutputs(grammar='root ::= "x" [0-9]+'), "x42")
    forced = HERMES.forced_grammar([{"name": "f", "parameters": SCHEMA}], True, lambda _: None)
    walk(
        compiler,
        StructuredOutputs(grammar=forced),
        '<tool_call>\n{"name": "f", "arguments": {"n": 1, "s": ""}}\n</tool_call>',
    )
    with pytest.raises(AssertionError):
        walk(compiler, StructuredOutputs.from_schema(SCHEMA, "x"), '{"s": "ok", "n": 1}')  # property order holds


def test_a_mask_depends_only_on_its_own_matcher(compiler):
    grammar, tokenizer = compiler
    spec = StructuredOutputs.from_schema(SCHEMA, "x")
    lone = grammar.matcher(spec)
    lone.consume_tokens(tokenizer.encode('{"n": 4', add_special_tokens=False))
    [expected], _ = grammar.allowed_tokens([lone])
    crowd = [grammar.matcher(StructuredOutputs(regex=f"[a-{c}]+")) for c in "bcdefg"]
    batched, _ = grammar.allowed_tokens([*crowd[:3], lone, *crowd[3:]])
    assert torch.equal(batched[3], expected)


def test_compiled_grammars_are_cached_and_compile_from_many_threads(compiler):
    grammar, _ = compiler
    specs = [StructuredOutputs.from_schema({**SCHEMA, "title": str(i)}, "x") for i in range(8)]
    threads = [threading.Thread(target=grammar.compile, args=(spec,)) for spec in specs * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(spec in grammar._compiled for spec in specs)
    # Equal schemas are one cache entry, whatever field they came from.
    assert StructuredOutputs.from_schema(SCHEMA, "a") == StructuredOutputs(
        json=json.dumps(SCHEMA, separators=(",", ":"))
    )


@pytest.mark.parametrize(
    ("spec", "named"),
    [
        (StructuredOutputs.from_schema({"type": "array", "uniqueItems": True}, "response_format"), "uniqueItems"),
        (StructuredOutputs.from_schema({"type": "object", "if": {}, "then": {}}, "response_format"), "if"),
        (StructuredOutputs.from_schema({"type": "string", "format": "no-such-format"}, "response_format"), "format"),
        (StructuredOutputs.from_schema({"type": 7}, "response_format"), "type"),
        (StructuredOutputs(regex="(unclosed"), "regex"),
        (StructuredOutputs(grammar="root ::= ("), "grammar"),
    ],
)
def test_what_cannot_be_enforced_is_refused_by_name(compiler, spec, named):
    grammar, _ = compiler
    with pytest.raises(InvalidRequestError) as refused:
        grammar.compile(spec)
    assert named in refused.value.message and refused.value.param == spec.param


def test_a_spec_holds_exactly_one_constraint():
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs(regex="a", choice=("b",))
    with pytest.raises(InvalidRequestError, match="exactly one"):
        StructuredOutputs()
    with pytest.raises(InvalidRequestError, match="choice"):
        StructuredOutputs(choice=("",))


def test_objects_that_list_their_properties_take_no_others_unless_their_schema_says(compiler):
    """A non-strict schema (instructor's JSON_SCHEMA mode) ends: once its properties are written
    only the closing brace may follow; an object that says what more it takes keeps it."""
    grammar, tokenizer = compiler
    listed = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    matcher = grammar.matcher(StructuredOutputs.from_schema(listed, "response_format"))
    for token in tokenizer.encode('{"ok": true', add_special_tokens=False):
        assert matcher.consume_token(token)
    [mask], _ = grammar.allowed_tokens([matcher])
    allowed = {tokenizer.decode([int(t)]) for t in mask.nonzero().flatten()}
    assert "}" in allowed and not any(text.startswith(",") for text in allowed)
    walk(compiler, StructuredOutputs.from_schema({**listed, "additionalProperties": True}, "p"), '{"ok": true, "x": 1}')


def test_closing_reaches_nested_objects_but_not_the_parts_of_an_all_of():
    from shoal.engine.grammar import closed_objects

    part = {"properties": {"a": {"type": "string"}}}
    schema = {
        "type": "object",
        "properties": {"inner": part, "list": {"type": "array", "items": part}},
        "$defs": {"d": part},
        "allOf": [part],
        "anyOf": [{"properties": {"b": {}}, "patternProperties": {"^x": {}}}],
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["inner"]["additionalProperties"] is False
    assert closed["properties"]["list"]["items"]["additionalProperties"] is False
    assert closed["$defs"]["d"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["allOf"][0] and "additionalProperties" not in closed["anyOf"][0]
    assert "additionalProperties" not in part  # the request's schema is left as it was
