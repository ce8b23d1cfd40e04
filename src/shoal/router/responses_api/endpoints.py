"""The OpenAI Responses API on the router: `POST /v1/responses` (streamed or not),
`GET` and `DELETE /v1/responses/{id}`, and `GET /v1/responses/{id}/input_items`.

A new response is the chat completion of its conversation: this request's instructions, then every
stored turn it continues (oldest first), then its input. It goes through the front door like any
chat request (admission, placement, token-exact failover), with the conversation's first response
id as its session, so a turn prefers the worker that holds the conversation's prefix cache; since
the whole history is sent, any other worker (behind any router sharing the store) continues it as
well.
"""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from shoal.router.admission.auth import Client
from shoal.router.front_door import FrontDoor, header_dict
from shoal.router.list_pages import PageQuery
from shoal.router.placement.route_request import CHAT_PATH, RequestError
from shoal.router.responses_api.background import BackgroundResponses
from shoal.router.responses_api.event_stream import response_events
from shoal.router.responses_api.ids import new_message_id, new_response_id
from shoal.router.responses_api.input_items import conversation_messages
from shoal.router.responses_api.response_object import (
    assistant_output,
    finished_response,
    output_status,
    response_skeleton,
)
from shoal.router.responses_api.responses_request import ResponsesRequest
from shoal.router.responses_api.stored_turn import KIND, StoredTurn
from shoal.router.state.open_records import SharedRecords
from shoal.router.state.records import StoreUnavailable, owned_record
from shoal.router.streams.proxy import error_response, invalid_request, store_unavailable


class UnknownResponse(LookupError):
    """No stored response with that id for this client (answered as 404 naming `param`)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _not_found(response_id: str, param: str | None = None) -> UnknownResponse:
    return UnknownResponse(f"no response found with id {response_id!r}", param)


class ResponsesApi:
    """Invariants: only finished responses (completed or incomplete) are stored, and only when the
    request asked for it; a client authenticates as for the other endpoints and sees only the
    responses its own key created (another key's ids are unknown to it); every refusal is an
    OpenAI-shaped error (400 bad input, 401, 404 unknown id, 503 store unavailable)."""

    def __init__(self, front_door: FrontDoor, records: SharedRecords):
        self.front_door = front_door
        self.records = records
        self.background = BackgroundResponses(front_door, records, front_door.api_keys)

    def routes(self) -> APIRouter:
        routes = APIRouter()
        routes.add_api_route("/v1/responses", self.create, methods=["POST"])
        routes.add_api_route("/v1/responses/{response_id}", self.retrieve, methods=["GET"])
        routes.add_api_route("/v1/responses/{response_id}", self.delete, methods=["DELETE"])
        routes.add_api_route("/v1/responses/{response_id}/cancel", self.cancel, methods=["POST"])
        routes.add_api_route("/v1/responses/{response_id}/input_items", self.input_items, methods=["GET"])
        return routes

    async def create(self, request: Request) -> Response:
        headers = header_dict(request)
        read = await self.front_door.read(request, headers)
        if isinstance(read, Response):
            return read
        client, body = read
        return await self.serve(body, headers, client)

    async def serve(self, body: object, headers: dict[str, str], client: Client) -> Response:
        """Creates a response from a parsed request body (a client's, or a batch's line)."""
        try:
            parsed = ResponsesRequest.parse(body)
            chain = await self._chain(parsed.previous_response_id, client)
        except RequestError as exc:
            return invalid_request(exc)
        except UnknownResponse as exc:
            return error_response(404, str(exc), "not_found_error", exc.param)
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        response_id, message_id = new_response_id(), new_message_id()
        skeleton = response_skeleton(response_id, parsed, int(time.time()))
        session = chain[0].response_id if chain else response_id
        chat_body = parsed.chat_body(conversation_messages(parsed.instructions, chain, parsed.input_items))
        if parsed.background:
            try:
                queued = await self.background.start(
                    chat_body, skeleton, message_id, session, parsed.input_items, client
                )
            except StoreUnavailable as exc:
                return store_unavailable(exc)
            return self.background.streamed(response_id, -1) if parsed.stream else JSONResponse(queued)
        answer = await self.front_door.dispatch(
            chat_body, {**headers, "x-shoal-session": session}, CHAT_PATH, True, client
        )
        if answer.status_code != 200 or not isinstance(answer, StreamingResponse if parsed.stream else JSONResponse):
            return answer
        shoal_headers = {k: v for k, v in answer.headers.items() if k.startswith("x-shoal-")}

        async def keep(response: dict) -> None:
            if parsed.store:
                await self.records.store.put(StoredTurn(response, parsed.input_items, client.name).record())

        if parsed.stream:
            # The chat stream's background task releases its worker even if this stream is never read.
            return StreamingResponse(
                response_events(answer.body_iterator, skeleton, message_id, keep, parsed.output_logprobs),
                media_type="text/event-stream",
                headers=shoal_headers,
                background=answer.background,
            )
        completion = json.loads(answer.body)
        choice = completion["choices"][0]
        logprobs = (choice.get("logprobs") or {}).get("content") or [] if parsed.output_logprobs else None
        output = assistant_output(message_id, choice["message"], output_status(choice["finish_reason"]), logprobs)
        response = finished_response(
            skeleton, output, choice["finish_reason"], completion.get("usage"), completion.get("model")
        )
        try:
            await keep(response)
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        return JSONResponse(response, headers=shoal_headers)

    async def retrieve(self, response_id: str, request: Request) -> Response:
        """The stored response; with `stream=true`, a background response's events after
        `starting_after` (from its first without), live until its end."""
        found = await self._lookup(response_id, request)
        if isinstance(found, Response):
            return found
        if request.query_params.get("stream") != "true":
            return JSONResponse(found.response)
        starting_after = request.query_params.get("starting_after", "-1")
        if not found.response.get("background"):
            return error_response(
                400,
                "invalid request: only a background response can be streamed again",
                "invalid_request_error",
                "stream",
            )
        if not starting_after.lstrip("-").isdigit():
            return error_response(
                400, "invalid request: `starting_after` must be an integer", "invalid_request_error", "starting_after"
            )
        return self.background.streamed(response_id, int(starting_after))

    async def cancel(self, response_id: str, request: Request) -> Response:
        """Stops a background response (answered once its router has stopped it)."""
        found = await self._lookup(response_id, request)
        if isinstance(found, Response):
            return found
        if not found.response.get("background"):
            return error_response(
                400, "invalid request: only a background response can be cancelled", "invalid_request_error"
            )
        if found.response["status"] in ("completed", "incomplete", "failed"):
            return error_response(
                409,
                f"response {response_id!r} is {found.response['status']} and cannot be cancelled",
                "invalid_request_error",
            )
        try:
            return await self.background.cancel(found)
        except StoreUnavailable as exc:
            return store_unavailable(exc)

    async def delete(self, response_id: str, request: Request) -> Response:
        found = await self._lookup(response_id, request)
        if isinstance(found, Response):
            return found
        try:
            await self.records.store.delete(KIND, response_id)
            await self.background.forget(response_id)
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def input_items(self, response_id: str, request: Request) -> Response:
        found = await self._lookup(response_id, request)
        if isinstance(found, Response):
            return found
        try:
            page = PageQuery.parse(request.query_params, "desc").of(found.input_items, "an input item of this response")
        except RequestError as exc:
            return invalid_request(exc)
        return JSONResponse(page)

    async def _lookup(self, response_id: str, request: Request) -> StoredTurn | Response:
        """The caller's stored turn, or the error to answer (401, 404, 503)."""
        client = self.front_door.client(header_dict(request))
        if isinstance(client, Response):
            return client
        try:
            return await self._owned(response_id, client)
        except UnknownResponse as exc:
            return error_response(404, str(exc), "not_found_error")
        except StoreUnavailable as exc:
            return store_unavailable(exc)

    async def _owned(self, response_id: str, client: Client, param: str | None = None) -> StoredTurn:
        record = await owned_record(self.records.store, KIND, response_id, client.name)
        if record is None:
            raise _not_found(response_id, param)
        return StoredTurn.from_record(record)

    async def _chain(self, previous_response_id: str | None, client: Client) -> list[StoredTurn]:
        """The stored turns a new response continues, oldest first. Raises UnknownResponse if the
        previous response, or one it continues, is not stored (never stored, or deleted)."""
        chain, next_id = [], previous_response_id
        while next_id is not None:
            try:
                turn = await self._owned(next_id, client, "previous_response_id")
            except UnknownResponse:
                if next_id == previous_response_id:
                    raise
                raise UnknownResponse(
                    f"response {previous_response_id!r} continues {next_id!r}, which is no longer stored",
                    "previous_response_id",
                ) from None
            chain.append(turn)
            next_id = turn.previous_response_id
        return chain[::-1]
