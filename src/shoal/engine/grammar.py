"""Grammar-constrained decoding with llguidance: StructuredOutputs compiled into matchers, and the
tokens each constrained sequence may take next.

llguidance was chosen over xgrammar by measurement on CPU (benchmarks/structured.py, in
docs/performance.md): it compiles a tool schema in about a millisecond, needs no other package, and
refuses the JSON Schema keywords it cannot enforce (`uniqueItems`, `if`/`then`, unknown formats)
where xgrammar drops them silently and lets non-conforming output through.

JSON is bounded so that a small model's output ends: no whitespace but the separators, and objects
that list their properties take no others unless their schema says (`closed_objects`).

Invariants: a sequence's mask depends only on the tokens its own matcher consumed, so constrained
sampling stays batch-invariant and reproducible from (seed, position); compiled grammars are
cached by spec, and `compile` is safe from any thread, so workers compile off the engine thread.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

import llguidance
import numpy
import torch
from llguidance.gbnf_to_lark import any_to_lark

from shoal.engine.structured_outputs import StructuredOutputs
from shoal.errors import InvalidRequestError
from shoal.model.tokenizer import Tokenizer

# JSON as json.dumps writes it (", " and ": "), with no other whitespace: a small model left free to
# add whitespace may add it forever.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
CACHE_SIZE = 256
MAX_ERROR_CHARS = 600


class GrammarCompiler:
    """One model's grammar compiler. The llguidance tokenizer (a fraction of a second to build) is
    made on first use, so engines that never see a constraint never pay for it."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, eos_token_ids: Sequence[int]):
        self.vocab_size = vocab_size
        self._tokenizer = tokenizer
        self._eos_token_ids = list(eos_token_ids)
        self._lock = threading.Lock()
        self._ll_tokenizer: llguidance.LLTokenizer | None = None
        self._executor: llguidance.LLExecutor | None = None
        self._compiled: OrderedDict[StructuredOutputs, llguidance.LLMatcher] = OrderedDict()

    def _ll(self) -> llguidance.LLTokenizer:
        with self._lock:
            if self._ll_tokenizer is None:
                try:
                    self._ll_tokenizer = llguidance.LLTokenizer(
                        self._tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=self._eos_token_ids
                    )
                except ValueError:  # a tokenizer with no byte-level or byte-fallback decoder
                    self._ll_tokenizer = llguidance.LLTokenizer(
                        llguidance.TokenizerWrapper(_TokenTable(self._tokenizer)),
                        n_vocab=self.vocab_size,
                        eos_token=self._eos_token_ids,
                    )
                self._executor = llguidance.LLExecutor()
            return self._ll_tokenizer

    def compile(self, spec: StructuredOutputs) -> None:
        """Compiles `spec` into the cache (a hit costs a lookup). Raises InvalidRequestError naming
        what is wrong: a schema keyword llguidance cannot enforce, a regex or grammar that does not
        parse."""
        with self._lock:
            if spec in self._compiled:
                self._compiled.move_to_end(spec)
                return
        tokenizer = self._ll()
        try:
            matcher = llguidance.LLMatcher(tokenizer, _grammar_source(spec), log_level=0)
        except ValueError as exc:  # a schema that is not JSON, or not an object
            raise InvalidRequestError(f"the {_described(spec)} cannot be used: {_short(str(exc))}", spec.param) from exc
        if matcher.is_error():
            problem = _short(matcher.get_error())
            raise InvalidRequestError(f"the {_described(spec)} cannot be used: {problem}", spec.param)
        with self._lock:
            self._compiled[spec] = matcher
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence, at the grammar's start."""
        self.compile(spec)
        with self._lock:
            return self._compiled[spec].deep_copy()

    def allowed_tokens(self, matchers: Sequence[llguidance.LLMatcher]) -> tuple[torch.Tensor, list[int | None]]:
        """(bool [len(matchers), vocab_size]: the tokens each matcher accepts next, EOS where the
        grammar is complete; for each matcher, its one allowed token where it allows just one).
        Masks are computed in parallel, each from its own matcher only."""
        self._ll()
        words = (self.vocab_size + 31) // 32
        bitmask = torch.zeros(len(matchers), words, dtype=torch.int32)
        self._executor.unsafe_compute_mask_ptr(
            [(m, i) for i, m in enumerate(matchers)], bitmask.data_ptr(), words * 4, len(matchers)
        )
        # Bit j of word i is token 32 i + j: little-endian words, least significant bit first.
        bits = numpy.unpackbits(bitmask.numpy().view(numpy.uint8), axis=1, bitorder="little")[:, : self.vocab_size]
        bits = numpy.ascontiguousarray(bits)
        counts = numpy.count_nonzero(bits, axis=1)
        only = [int(bits[i].argmax()) if count == 1 else None for i, count in enumerate(counts)]
        return torch.from_numpy(bits).view(torch.bool), only

    def allowed_after(
        self, matcher: llguidance.LLMatcher, drafts: Sequence[int]
    ) -> tuple[torch.Tensor, list[int | None]]:
        """allowed_tokens at each draft's place: after the first, the first two, ... of `drafts` (each
        one the grammar accepts: `accepted_drafts`). The matcher ends where it began (rolled back)."""
        masks, only = [], []
        for token in drafts:
            if not matcher.consume_token(token):
                raise ValueError(f"the grammar refuses draft token {token}")
            allowed, single = self.allowed_tokens([matcher])
            masks.append(allowed[0])
            only += single
        matcher.rollback(len(drafts))
        return torch.stack(masks) if masks else torch.zeros(0, self.vocab_size, dtype=torch.bool), only

    def accepted_drafts(self, matcher: llguidance.LLMatcher, drafts: list[int]) -> list[int]:
        """The longest beginning of `drafts` the grammar accepts from where the matcher is, which it
        does not leave (an id the tokenizer does not have ends it: the matcher would fail on it)."""
        known = next((i for i, token in enumerate(drafts) if token >= self._tokenizer.vocab_size), len(drafts))
        return drafts[: matcher.validate_tokens(drafts[:known])] if known else []


class _TokenTable:
    """Each token's bytes, for tokenizers llguidance cannot read itself (no byte-level or
    byte-fallback decoder): a token's bytes are its text; special tokens are marked as llguidance
    expects (a 0xFF byte, then the name)."""

    def __init__(self, tokenizer: Tokenizer):
        backend = tokenizer.backend
        self._tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else None
        self.bos_token_id = tokenizer.bos_token_id
        specials = {token.content for token in backend.get_added_tokens_decoder().values() if token.special}
        self.special_token_ids = [i for i in range(tokenizer.vocab_size) if backend.id_to_token(i) in specials]
        self.tokens = [
            b"\xff" + text.encode() if text in specials else text.encode()
            for text in (backend.id_to_token(i) or "" for i in range(tokenizer.vocab_size))
        ]

    def __call__(self, text: str) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=False)


def _grammar_source(spec: StructuredOutputs) -> str:
    """The llguidance grammar of a spec. Raises InvalidRequestError for a grammar that is neither
    Lark nor GBNF."""
    match spec.kind:
        case "json":
            schema = closed_objects(json.loads(spec.json))
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        case "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
        case "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.regex)
        case "choice":
            alternatives = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in spec.choice)
            return llguidance.LLMatcher.grammar_from_lark(f"start: {alternatives}\n")
        case _:
            try:
                return llguidance.LLMatcher.grammar_from_lark(any_to_lark(spec.grammar))
            except Exception as exc:  # the GBNF converter raises bare exceptions on bad input
                raise InvalidRequestError(f"the grammar does not parse: {_short(str(exc))}", spec.param) from exc


# Keywords whose value is one schema, a list of schemas, or a map of names to schemas.
_ONE_SCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains", "propertyNames")
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def closed_objects(schema: object, in_all_of: bool = False) -> object:
    """The schema with every object that lists `properties` and says nothing of more closed to them
    (additionalProperties false), as xgrammar and outlines read a schema (vLLM's guidance backend has
    disable_additional_properties for it): a model otherwise free to add properties may add them
    forever. An object that says what more it takes keeps it; the parts of an allOf stay open, each
    being one part of the object."""
    if not isinstance(schema, dict):
        return schema
    closed = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            closed[key] = {name: closed_objects(part) for name, part in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            closed[key] = [closed_objects(part, in_all_of=key == "allOf") for part in value]
        elif key in _ONE_SCHEMA:
            closed[key] = closed_objects(value)
        else:
            closed[key] = value
    open_ended = ("additionalProperties", "patternProperties", "unevaluatedProperties")
    if "properties" in closed and not in_all_of and not any(key in closed for key in open_ended):
        closed["additionalProperties"] = False
    return closed


def _described(spec: StructuredOutputs) -> str:
    return {"json": "JSON schema", "json_object": "JSON object grammar"}.get(spec.kind, spec.kind)


def _short(message: str) -> str:
    message = message.strip()
    return message if len(message) <= MAX_ERROR_CHARS else message[:MAX_ERROR_CHARS] + "..."
