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
