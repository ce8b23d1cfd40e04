"""The Anthropic Messages API on the router: `POST /v1/messages` (streamed or not) and
`POST /v1/messages/count_tokens`.

A message is the chat completion of its request (messages_request), sent through the front door
like any chat request: authentication (Bearer or x-api-key), rate limits, admission and
priorities, placement, and token-exact failover mid-stream, since the translation into Anthropic's
events happens here, above the relayed chat stream. With a stream journal, a stream's events carry
ids, and a client that reconnects with Last-Event-ID (to any router sharing the journal) gets the
rest of the same message. Token counts come from a worker: the prompt
tokens of a one-token completion of the same rendered request (workers have no tokenize endpoint;
this renders the prompt with the model's own template and tools, and warms its prefix cache for
the message that usually follows).
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from shoal.router.admission.auth import Client
from shoal.router.front_door import FrontDoor, header_dict
from shoal.router.messages_api.errors import anthropic_error, anthropic_shaped
from shoal.router.messages_api.event_stream import MessagesPosition, message_events
from shoal.router.messages_api.message_object import message_object, new_message_id
from shoal.router.messages_api.messages_request import MessagesRequest
from shoal.router.placement.route_request import CHAT_PATH, RequestError


class MessagesApi:
    """Invariants: every refusal is in Anthropic's error shape, with the status the router's chat
    path gives (400, 401, 404, 413, 429, 503 overloaded, 500); nothing is stored."""

    def __init__(self, front_door: FrontDoor):
        self.front_door = front_door

    def routes(self) -> APIRouter:
        routes = APIRouter()
        routes.add_api_route("/v1/messages", self.create, methods=["POST"])
        routes.add_api_route("/v1/messages/count_tokens", self.count_tokens, methods=["POST"])
        return routes

    async def create(self, request: Request) -> Response:
        resumed = None
        if "last-event-id" in request.headers:
            try:
                resumed = MessagesPosition.parse(request.headers["last-event-id"])
            except RequestError as exc:
                return anthropic_error(400, f"invalid request: {exc}")
        answered = await self._answered(request, counting=False, resumed=resumed)
        if isinstance(answered, Response):
            return answered
        parsed, answer = answered
        shoal_headers = {k: v for k, v in answer.headers.items() if k.startswith("x-shoal-") or k == "x-request-id"}
        message_id = new_message_id()
        if parsed.stream:
            # The chat stream's background task releases its worker even if this stream is never read.
            return StreamingResponse(
                message_events(answer.body_iterator, message_id, parsed.model, resumed),
                media_type="text/event-stream",
                headers=shoal_headers,
                background=answer.background,
            )
        try:
            message = message_object(message_id, json.loads(answer.body))
        except ValueError as exc:
            return anthropic_error(500, str(exc), shoal_headers)
        return JSONResponse(message, headers=shoal_headers)

    async def count_tokens(self, request: Request) -> Response:
        answered = await self._answered(request, counting=True)
        if isinstance(answered, Response):
            return answered
        _, answer = answered
        return JSONResponse({"input_tokens": json.loads(answer.body)["usage"]["prompt_tokens"]})

    async def _answered(
        self, request: Request, counting: bool, resumed: MessagesPosition | None = None
    ) -> Response | tuple[MessagesRequest, Response]:
        """(the parsed request, the chat path's 200 answer to it: to count_body when `counting`, else
        to chat_body, resumable, or `resumed` from where its client stands), or the Anthropic-shaped
        error to answer."""
        read = await self._read(request, counting)
        if isinstance(read, Response):
            return read
        headers, client, parsed = read
        body = parsed.count_body() if counting else parsed.chat_body()
        if resumed is not None:
            headers = {**headers, "last-event-id": resumed.chat_event_id}
        answer = await self.front_door.dispatch(body, headers, CHAT_PATH, True, client, resumable=not counting)
        return (parsed, answer) if answer.status_code == 200 else anthropic_shaped(answer)

    async def _read(
        self, request: Request, counting: bool
    ) -> Response | tuple[Mapping[str, str], Client, MessagesRequest]:
        """(headers, client, the parsed request), or the Anthropic-shaped error to answer."""
        headers = header_dict(request)
        read = await self.front_door.read(request, headers)
        if isinstance(read, Response):
            return anthropic_shaped(read)
        client, body = read
        try:
            return headers, client, MessagesRequest.parse(body, counting)
        except RequestError as exc:
            return anthropic_error(400, f"invalid request: {exc}")
