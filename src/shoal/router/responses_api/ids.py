"""Ids of responses and of their items, shaped as OpenAI's ("resp_...", "msg_...", "rs_...", "fc_...")."""

from __future__ import annotations

import uuid


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex


def new_reasoning_id() -> str:
    return "rs_" + uuid.uuid4().hex


def new_function_call_id(prefix: str = "fc_") -> str:
    return prefix + uuid.uuid4().hex


class ItemIds:
    """The ids of a response's output items as its events name them: random, or, for a response
    that may be generated again elsewhere (a background response taken over by another router),
    derived from the response id and the item's place, so a second run names its items as the first
    did. A derived call id replaces the one the worker chose."""

    def __init__(self, derived_from: str | None = None):
        self.base = derived_from.removeprefix("resp_") if derived_from else None
        self.issued = 0

    def _derived(self, prefix: str) -> str:
        self.issued += 1
        return f"{prefix}{self.base}_{self.issued}"

    def reasoning(self) -> str:
        return self._derived("rs_") if self.base else new_reasoning_id()

    def function_call(self) -> str:
        return self._derived("fc_") if self.base else new_function_call_id()

    def call(self, given: str | None) -> str:
        if self.base:
            return self._derived("call_")
        return given or new_function_call_id("call_")
