"""A conversation with a running cluster over the Responses API (`shoal chat --url`): each turn is
streamed, and carries the previous turn's response id, so the router (or another one sharing its
state store) continues the conversation with its full history whichever worker serves it."""

from __future__ import annotations

from collections.abc import Iterator

import httpx

from shoal.protocol.sse import data_of, is_done, json_data

TURN_TIMEOUT_S = 600.0


class ChatError(Exception):
    """The cluster refused or failed a turn; the message says why."""


class RemoteChat:
    """Invariant: `previous_response_id` is the id of the last turn that completed (None before
    the first), so a failed turn can be retried without losing the conversation."""

    def __init__(
        self,
        url: str,
        model: str,
        api_key: str | None = None,
        temperature: float | None = None,
        max_output_tokens: int | None = None,
    ):
        self.url = url.rstrip("/")
        self.model = model
        self.options = {
            k: v for k, v in (("temperature", temperature), ("max_output_tokens", max_output_tokens)) if v is not None
        }
        self.headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.previous_response_id: str | None = None

    def turn(self, text: str) -> Iterator[str]:
        """Sends one user message; yields the reply's text as it arrives."""
        body = {
            "model": self.model,
            "input": text,
            "stream": True,
            **self.options,
            **({"previous_response_id": self.previous_response_id} if self.previous_response_id else {}),
        }
        try:
            with httpx.stream(
                "POST", f"{self.url}/v1/responses", json=body, headers=self.headers, timeout=TURN_TIMEOUT_S
            ) as reply:
                if reply.status_code != 200:
                    reply.read()
                    raise ChatError(_error_message(reply))
                yield from self._events(reply)
        except httpx.HTTPError as exc:
            raise ChatError(f"cannot reach {self.url}: {exc}") from None

    def _events(self, reply: httpx.Response) -> Iterator[str]:
        for line in reply.iter_lines():
            data = data_of(line)
            if data is None or is_done(data):
                continue
            event = json_data(data)
            kind = event.get("type")
            if kind == "response.output_text.delta":
                yield event["delta"]
            elif kind in ("response.completed", "response.incomplete"):
                self.previous_response_id = event["response"]["id"]
            elif kind == "response.failed":
                error = event["response"].get("error") or {}
                raise ChatError(error.get("message", "the cluster failed this turn"))
            elif kind == "error":
                raise ChatError(event.get("message", "the cluster failed this turn"))


def _error_message(reply: httpx.Response) -> str:
    try:
        return f"{reply.status_code}: {reply.json()['error']['message']}"
    except (ValueError, KeyError, TypeError):
        return f"{reply.status_code}: {reply.text[:200]}"
