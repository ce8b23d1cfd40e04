"""OpenAI's paged lists (`after`, `limit`, `order` in; `data`, `first_id`, `last_id`, `has_more`
out), read from a query string and built from a page of stored records or from a list in memory."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from shoal.router.placement.route_request import RequestError
from shoal.router.state.records import Order


@dataclass(frozen=True)
class PageQuery:
    after: str | None
    limit: int
    order: Order

    @classmethod
    def parse(cls, query: Mapping[str, str], default_order: Order, max_limit: int = 100) -> PageQuery:
        """The page a query asks for (`limit` 1..max_limit, default 20); RequestError names a bad one."""
        order = query.get("order", default_order)
        if order not in ("asc", "desc"):
            raise RequestError('`order` must be "asc" or "desc"', "order")
        limit = query.get("limit", "20")
        if not limit.isdigit() or not 1 <= int(limit) <= max_limit:
            raise RequestError(f"`limit` must be an integer from 1 to {max_limit}", "limit")
        return cls(query.get("after"), int(limit), order)

    def of(self, items: list[dict], what: str) -> dict:
        """This page of a list held in memory, oldest first; an `after` not in it is a RequestError."""
        ordered = items if self.order == "asc" else items[::-1]
        if self.after is not None:
            position = next((index for index, item in enumerate(ordered) if item["id"] == self.after), None)
            if position is None:
                raise RequestError(f"`after` {self.after!r} is not {what}", "after")
            ordered = ordered[position + 1 :]
        return list_object(ordered[: self.limit], len(ordered) > self.limit)


def list_object(data: list[dict], has_more: bool) -> dict:
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }
