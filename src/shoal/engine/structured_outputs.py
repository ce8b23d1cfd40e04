"""What a request's output must match: a JSON schema, any JSON object, a regular expression, one of
a list of strings, or a grammar (Lark, or GBNF/EBNF as llama.cpp and vLLM write it).

The fields and their meaning are vLLM's `StructuredOutputsParams`. The spec is a frozen value, so it
is the key of the compiled-grammar cache: two requests with the same constraint share one grammar.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from shoal.errors import InvalidRequestError

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutputs:
    """Exactly one constraint. `json` is the schema as compact JSON text in the client's key order
    (property order is part of the constraint), so equal schemas are equal specs; `param` (not
    part of equality) names the request field it came from, for error messages."""

    json: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    param: str = field(default="structured_outputs", compare=False)

    def __post_init__(self) -> None:
        if self.choice is not None:
            object.__setattr__(self, "choice", tuple(self.choice))
        given = [kind for kind in KINDS if getattr(self, kind) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequestError(
                f"give exactly one of {', '.join(KINDS)}; got {', '.join(given) or 'none'}", param=self.param
            )
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings", param=self.param)
        for kind in ("regex", "grammar"):
            value = getattr(self, kind)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidRequestError(f"{kind} must be a non-empty string", param=self.param)

    @classmethod
    def from_schema(cls, schema: object, param: str) -> StructuredOutputs:
        """A JSON-schema constraint from a parsed schema (an object, or `true` for any JSON value)."""
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise InvalidRequestError("a JSON schema must be an object (or `true`)", param=param)
        return cls(json=json.dumps(schema, separators=(",", ":")), param=param)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if getattr(self, kind) not in (None, False))
