"""Stored chat completions: `POST /v1/chat/completions` with `store: true` keeps the completion
(streamed or not) with its request's messages and metadata; `GET /v1/chat/completions` lists them
(by `model` and `metadata[KEY]=VALUE`, paged), and `GET`, `POST` (metadata) and `DELETE
/v1/chat/completions/{id}` and `GET /v1/chat/completions/{id}/messages` read, label and delete
one. They live in the router's state store, so every router sharing it serves them."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from shoal.errors import error_body
from shoal.protocol.sse import data_event, data_values, is_done, json_data
from shoal.router.admission.auth import Client
from shoal.router.body_fields import metadata_field
from shoal.router.front_door import FrontDoor, header_dict
from shoal.router.list_pages import PageQuery, list_object
from shoal.router.placement.route_request import RequestError
from shoal.router.state.open_records import SharedRecords
from shoal.router.state.records import Record, StoreUnavailable, owned_record
from shoal.router.stored_completions.stored_completion import (
    KIND,
    completion_record,
    listed_message,
    metadata_filter,
)
from shoal.router.streams.assembly import assemble
from shoal.router.streams.proxy import error_response, invalid_request, store_unavailable

log = logging.getLogger(__name__)


class StoredCompletions:
    """Invariants: only a completion that finished (no error) is stored, and only when its request
    said `store: true`; it is stored before its client gets the end of it (the JSON body, or the
    stream's [DONE]); workers never see `store`. A client sees only the completions its own key
    stored (another key's ids are unknown to it)."""

    def __init__(self, front_door: FrontDoor, records: SharedRecords):
        self.front_door = front_door
        self.records = records

    def routes(self) -> APIRouter:
        routes = APIRouter()
        routes.add_api_route("/v1/chat/completions", self.list, methods=["GET"])
        routes.add_api_route("/v1/chat/completions/{completion_id}", self.retrieve, methods=["GET"])
        routes.add_api_route("/v1/chat/completions/{completion_id}", self.update, methods=["POST"])
        routes.add_api_route("/v1/chat/completions/{completion_id}", self.delete, methods=["DELETE"])
        routes.add_api_route("/v1/chat/completions/{completion_id}/messages", self.messages, methods=["GET"])
        return routes

    async def around(self, body: object, client: Client, dispatch: Callable[[object], Awaitable[Response]]) -> Response:
        """Serves a chat completion request (FrontDoor.handle), storing its answer if it asks to."""
        if not isinstance(body, dict) or "store" not in body:
            return await dispatch(body)
        store = body["store"]
        if store is not None and not isinstance(store, bool):
            return invalid_request(RequestError("`store` must be a boolean", "store"))
        forwarded = {key: value for key, value in body.items() if key != "store"}
        if not store:
            return await dispatch(forwarded)
        try:
            metadata_field(body)
        except RequestError as exc:
            return invalid_request(exc)
        answer = await dispatch(forwarded)
        if answer.status_code != 200:
            return answer
        if isinstance(answer, StreamingResponse):
            answer.body_iterator = self._kept_stream(answer.body_iterator, body, client)
            return answer
        try:
            await self.records.store.put(completion_record(json.loads(answer.body), body, client.name))
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        return answer

    async def _kept_stream(self, chunks: AsyncIterator[bytes], request: dict, client: Client) -> AsyncIterator[bytes]:
        """The stream as it comes; at its [DONE], its events assembled into the completion are
        stored first (a store that fails sends an error event before the [DONE]). A chunk holds
        whole events, [DONE] last where it has it."""
        events = []
        async for chunk in chunks:
            values = data_values(chunk)
            if not values or not is_done(values[-1]):
                events += map(json_data, values)
                yield chunk
                continue
            before = chunk[: chunk.rindex(b"data:")]
            events += map(json_data, values[:-1])
            failure = await self._keep_streamed(events, request, client)
            yield before + (failure or b"") + chunk[len(before) :]

    async def _keep_streamed(self, events: list[dict], request: dict, client: Client) -> bytes | None:
        if not events or any("error" in event for event in events):
            return None
        try:
            await self.records.store.put(completion_record(assemble(events, True), request, client.name))
        except StoreUnavailable as exc:
            log.warning("state store unavailable: %s", exc)
            message = f"the completion was generated but could not be stored: {exc}"
            return data_event(error_body(message, 503, "service_unavailable"))
        return None

    async def list(self, request: Request) -> Response:
        client = self.front_door.client(header_dict(request))
        if isinstance(client, Response):
            return client
        try:
            query = PageQuery.parse(request.query_params, "asc")
        except RequestError as exc:
            return invalid_request(exc)
        model, metadata = request.query_params.get("model"), metadata_filter(request.query_params.multi_items())

        def match(record: Record) -> bool:
            completion = record.body["completion"]
            labels = completion.get("metadata") or {}
            return (model is None or completion["model"] == model) and all(
                labels.get(key) == value for key, value in metadata.items()
            )

        try:
            page = await self.records.store.page(KIND, client.name, query.after, query.limit, query.order, match)
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        return JSONResponse(list_object([r.body["completion"] for r in page.records], page.has_more))

    async def retrieve(self, completion_id: str, request: Request) -> Response:
        found = await self._lookup(completion_id, request)
        return found if isinstance(found, Response) else JSONResponse(found.body["completion"])

    async def update(self, completion_id: str, request: Request) -> Response:
        """Sets a stored completion's metadata: the only field that can change."""
        read = await self.front_door.read(request, header_dict(request))
        if isinstance(read, Response):
            return read
        client, body = read
        found = await self._owned(completion_id, client)
        if isinstance(found, Response):
            return found
        try:
            if not isinstance(body, dict) or "metadata" not in body:
                raise RequestError("the body must be a JSON object with `metadata`", "metadata")
            unknown = sorted(set(body) - {"metadata"})
            if unknown:
                raise RequestError(f"only `metadata` can be updated, not `{unknown[0]}`", unknown[0])
            metadata = metadata_field(body)
        except RequestError as exc:
            return invalid_request(exc)
        completion = {**found.body["completion"], "metadata": metadata}
        try:
            await self.records.store.put(
                Record(KIND, found.id, found.owner, found.created_at, {**found.body, "completion": completion})
            )
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        return JSONResponse(completion)

    async def delete(self, completion_id: str, request: Request) -> Response:
        found = await self._lookup(completion_id, request)
        if isinstance(found, Response):
            return found
        try:
            await self.records.store.delete(KIND, completion_id)
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        return JSONResponse({"object": "chat.completion.deleted", "id": completion_id, "deleted": True})

    async def messages(self, completion_id: str, request: Request) -> Response:
        found = await self._lookup(completion_id, request)
        if isinstance(found, Response):
            return found
        try:
            query = PageQuery.parse(request.query_params, "asc")
            page = query.of(found.body["messages"], "a message of this completion")
        except RequestError as exc:
            return invalid_request(exc)
        return JSONResponse({**page, "data": [listed_message(m) for m in page["data"]]})

    async def _lookup(self, completion_id: str, request: Request) -> Record | Response:
        """The caller's stored completion, or the error to answer (401, 404, 503)."""
        client = self.front_door.client(header_dict(request))
        return client if isinstance(client, Response) else await self._owned(completion_id, client)

    async def _owned(self, completion_id: str, client: Client) -> Record | Response:
        try:
            record = await owned_record(self.records.store, KIND, completion_id, client.name)
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        if record is None:
            return error_response(404, f"no stored chat completion found with id {completion_id!r}", "not_found_error")
        return record
