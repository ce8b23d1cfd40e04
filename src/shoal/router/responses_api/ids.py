"""Ids of responses and of their items, shaped as OpenAI's ("resp_..." and "msg_...")."""

from __future__ import annotations

import uuid


def new_response_id() -> str:
    return "resp_" + uuid.uuid4().hex


def new_message_id() -> str:
    return "msg_" + uuid.uuid4().hex
