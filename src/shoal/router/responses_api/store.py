"""The contract between /v1/responses and wherever stored responses live."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol


class StoreUnavailable(Exception):
    """The store could not be read or written (answered as 503; the router goes on)."""


@dataclass(frozen=True)
class StoredTurn:
    """One stored response with what produced it. Invariant: `response` is the Response object as
    the client received it; `input_items` are that request's own input items (normalised, with ids),
    not its instructions nor earlier turns; `owner` is the client name that created it."""

    response: dict
    input_items: list[dict]
    owner: str

    @property
    def response_id(self) -> str:
        return self.response["id"]

    @property
    def previous_response_id(self) -> str | None:
        return self.response.get("previous_response_id")

    def to_json(self) -> str:
        return json.dumps({"response": self.response, "input_items": self.input_items, "owner": self.owner})

    @classmethod
    def from_json(cls, text: str | bytes) -> StoredTurn:
        return cls(**json.loads(text))


class ResponseStore(Protocol):
    """Invariants: `get` returns what the last `put` of that id stored, to any router sharing the
    store, until `delete`; `delete` says whether the id was there. Failures raise StoreUnavailable."""

    async def put(self, turn: StoredTurn) -> None: ...

    async def get(self, response_id: str) -> StoredTurn | None: ...

    async def delete(self, response_id: str) -> bool: ...

    async def close(self) -> None: ...
