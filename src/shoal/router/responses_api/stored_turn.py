"""A stored response with what produced it, as kept in the router's state store."""

from __future__ import annotations

from dataclasses import dataclass

from shoal.router.state.records import Record

KIND = "response"


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

    def record(self) -> Record:
        created_at = self.response.get("created_at") or 0
        return Record(
            KIND, self.response_id, self.owner, created_at, {"response": self.response, "input_items": self.input_items}
        )

    @classmethod
    def from_record(cls, record: Record) -> StoredTurn:
        return cls(record.body["response"], record.body["input_items"], record.owner)
