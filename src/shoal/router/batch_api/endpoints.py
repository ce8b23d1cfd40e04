"""OpenAI's Batch API on the router: `POST /v1/batches`, `GET /v1/batches` (`after`, `limit`,
newest first), `GET /v1/batches/{id}` and `POST /v1/batches/{id}/cancel`, for chat completions,
completions, responses and embeddings. The batches run on idle capacity (batch_runner)."""

from __future__ import annotations

import json
import time

from fastapi import APIRouter, Request
from starlette.responses import JSONResponse, Response

from shoal.protocol.admission_class import PRIORITY_HEADER
from shoal.router.admission.auth import Client
from shoal.router.batch_api.batch_object import (
    CANCEL_KIND,
    ENDPOINTS,
    FINISHED,
    KIND,
    as_seen,
    new_batch,
)
from shoal.router.body_fields import metadata_field, typed_field
from shoal.router.files_api.file_store import FileStore
from shoal.router.front_door import FrontDoor, header_dict
from shoal.router.list_pages import PageQuery, list_object
from shoal.router.placement.route_request import BATCH_PRIORITY, CHAT_PATH, RequestError
from shoal.router.responses_api.endpoints import ResponsesApi
from shoal.router.state.leased_work import mark_active
from shoal.router.state.records import Record, RecordStore, StoreUnavailable, owned_record
from shoal.router.streams.proxy import error_response, invalid_request, store_unavailable

CREATE_FIELDS = {"input_file_id", "endpoint", "completion_window", "metadata"}


class BatchesApi:
    """Invariants: a client sees only its own batches (another key's ids are unknown: 404); a batch
    is stored, then marked active for the routers to run; cancelling writes a request its runner
    acts on, never the batch itself (only the router holding a batch's lease writes it)."""

    def __init__(self, front_door: FrontDoor, files: FileStore, responses: ResponsesApi):
        self.front_door = front_door
        self.files = files
        self.responses = responses

    @property
    def store(self) -> RecordStore:
        return self.files.records.store

    def routes(self) -> APIRouter:
        routes = APIRouter()
        routes.add_api_route("/v1/batches", self.create, methods=["POST"])
        routes.add_api_route("/v1/batches", self.list, methods=["GET"])
        routes.add_api_route("/v1/batches/{batch_id}", self.retrieve, methods=["GET"])
        routes.add_api_route("/v1/batches/{batch_id}/cancel", self.cancel, methods=["POST"])
        return routes

    async def serve_line(self, endpoint: str, body: dict, client: Client) -> tuple[int, dict, str | None]:
        """One batch request, through the front door in the batch class (batch_runner.ServeLine)."""
        headers = {PRIORITY_HEADER: BATCH_PRIORITY}
        if endpoint == "/v1/responses":
            response = await self.responses.serve(body, headers, client)
        else:
            response = await self.front_door.dispatch(body, headers, endpoint, endpoint == CHAT_PATH, client)
        return response.status_code, json.loads(response.body), response.headers.get("x-request-id")

    async def create(self, request: Request) -> Response:
        read = await self.front_door.read(request, header_dict(request))
        if isinstance(read, Response):
            return read
        client, body = read
        try:
            if not isinstance(body, dict):
                raise RequestError("the body must be a JSON object")
            unknown = sorted(set(body) - CREATE_FIELDS)
            if unknown:
                raise RequestError(f"unknown or unsupported parameter `{unknown[0]}`", unknown[0])
            input_file_id = typed_field(body, "input_file_id", str, "a file id")
            if input_file_id is None:
                raise RequestError("`input_file_id` is required", "input_file_id")
            endpoint = body.get("endpoint")
            if endpoint not in ENDPOINTS:
                raise RequestError(f"`endpoint` must be one of {', '.join(ENDPOINTS)}", "endpoint")
            batch = new_batch(
                client.name,
                input_file_id,
                endpoint,
                body.get("completion_window"),
                metadata_field(body),
            )
        except RequestError as exc:
            return invalid_request(exc)
        try:
            source = await self.files.owned(input_file_id, client.name)
            if source is None:
                return error_response(
                    404, f"no file found with id {input_file_id!r}", "not_found_error", "input_file_id"
                )
            if source.body["purpose"] != "batch":
                return error_response(
                    400,
                    f"invalid request: file {input_file_id!r} was uploaded for {source.body['purpose']!r}, not batch",
                    "invalid_request_error",
                    "input_file_id",
                )
            await self.store.put(batch)
            await mark_active(self.store, KIND, batch.id, batch.created_at)
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        return JSONResponse(batch.body)

    async def list(self, request: Request) -> Response:
        client = self.front_door.client(header_dict(request))
        if isinstance(client, Response):
            return client
        try:
            query = PageQuery.parse(request.query_params, "desc")
        except RequestError as exc:
            return invalid_request(exc)
        try:
            page = await self.store.page(KIND, client.name, query.after, query.limit, query.order)
            shown = [as_seen(batch, await self.store.get(CANCEL_KIND, batch.id)) for batch in page.records]
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        return JSONResponse(list_object(shown, page.has_more))

    async def retrieve(self, batch_id: str, request: Request) -> Response:
        found = await self._lookup(batch_id, request)
        if isinstance(found, Response):
            return found
        try:
            return JSONResponse(as_seen(found, await self.store.get(CANCEL_KIND, batch_id)))
        except StoreUnavailable as exc:
            return store_unavailable(exc)

    async def cancel(self, batch_id: str, request: Request) -> Response:
        found = await self._lookup(batch_id, request)
        if isinstance(found, Response):
            return found
        if found.body["status"] in FINISHED:
            return error_response(
                409, f"batch {batch_id!r} is {found.body['status']} and cannot be cancelled", "invalid_request_error"
            )
        try:
            cancel = await self.store.get(CANCEL_KIND, batch_id)
            if cancel is None:
                cancel = Record(
                    CANCEL_KIND, batch_id, found.owner, found.created_at, {"cancelling_at": int(time.time())}
                )
                await self.store.put(cancel)
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        return JSONResponse(as_seen(found, cancel))

    async def _lookup(self, batch_id: str, request: Request) -> Record | Response:
        client = self.front_door.client(header_dict(request))
        if isinstance(client, Response):
            return client
        try:
            record = await owned_record(self.store, KIND, batch_id, client.name)
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        if record is None:
            return error_response(404, f"no batch found with id {batch_id!r}", "not_found_error")
        return record
