"""OpenAI's Files API on the router: `POST /v1/files` (multipart: `file`, `purpose`), `GET
/v1/files` (`purpose`, `after`, `limit`, `order`), `GET` and `DELETE /v1/files/{id}`, and `GET
/v1/files/{id}/content`. Files feed batches (purpose `batch`) and hold their results
(`batch_output`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi import APIRouter, Request
from starlette.datastructures import FormData, UploadFile
from starlette.responses import FileResponse, JSONResponse, Response

from shoal.router.files_api.file_store import KIND, FileStore, FileTooLarge
from shoal.router.front_door import FrontDoor, header_dict
from shoal.router.list_pages import PageQuery, list_object
from shoal.router.placement.route_request import RequestError
from shoal.router.state.records import Record, StoreUnavailable
from shoal.router.streams.proxy import error_response, invalid_request, store_unavailable

UPLOAD_PURPOSES = ("batch", "user_data")  # what a client may upload for; batch_output is the router's
PURPOSES = (*UPLOAD_PURPOSES, "batch_output")
CHUNK_BYTES = 1 << 20
FORM_OVERHEAD_BYTES = 64 << 10  # multipart headers and the other fields, beyond the file itself


def _counted(receive: Callable[[], Awaitable[dict]], limit: int) -> Callable[[], Awaitable[dict]]:
    """`receive`, raising FileTooLarge once the body passes `limit` bytes (before the multipart
    parser spools any more of it), with or without a Content-Length."""
    received = 0

    async def counted() -> dict:
        nonlocal received
        message = await receive()
        received += len(message.get("body", b""))
        if received > limit:
            raise FileTooLarge(f"the upload is larger than {limit} bytes")
        return message

    return counted


def _upload_fields(form: FormData) -> tuple[UploadFile, str]:
    """The upload form's file and purpose; RequestError names a missing, bad or unknown field."""
    unknown = sorted(set(form.keys()) - {"file", "purpose"})
    if unknown:
        raise RequestError(f"unknown or unsupported parameter `{unknown[0]}`", unknown[0])
    upload, purpose = form.get("file"), form.get("purpose")
    if not isinstance(upload, UploadFile):
        raise RequestError("`file` is required and must be a file", "file")
    if purpose not in UPLOAD_PURPOSES:
        raise RequestError(f"`purpose` must be one of {', '.join(UPLOAD_PURPOSES)}", "purpose")
    return upload, purpose


async def _chunks(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(CHUNK_BYTES):
        yield chunk


class FilesApi:
    """Invariants: a client sees only the files its own key uploaded or its batches wrote (another
    key's ids are unknown: 404); an upload over `max_file_bytes` is a 413 and leaves nothing; every
    refusal is OpenAI-shaped."""

    def __init__(self, front_door: FrontDoor, files: FileStore):
        self.front_door = front_door
        self.files = files

    def routes(self) -> APIRouter:
        routes = APIRouter()
        routes.add_api_route("/v1/files", self.upload, methods=["POST"])
        routes.add_api_route("/v1/files", self.list, methods=["GET"])
        routes.add_api_route("/v1/files/{file_id}", self.retrieve, methods=["GET"])
        routes.add_api_route("/v1/files/{file_id}", self.delete, methods=["DELETE"])
        routes.add_api_route("/v1/files/{file_id}/content", self.content, methods=["GET"])
        return routes

    def _too_large(self) -> Response:
        return error_response(
            413,
            f"the file is larger than this router's limit of {self.files.max_bytes} bytes",
            "invalid_request_error",
            "file",
        )

    async def upload(self, request: Request) -> Response:
        client = self.front_door.client(header_dict(request))
        if isinstance(client, Response):
            return client
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.files.max_bytes + FORM_OVERHEAD_BYTES:
            return self._too_large()
        limited = Request(request.scope, _counted(request.receive, self.files.max_bytes + FORM_OVERHEAD_BYTES))
        try:
            form = await limited.form(max_files=1, max_fields=8)
        except FileTooLarge:
            return self._too_large()
        except Exception as exc:  # Starlette's multipart parser raises its own errors for bad forms
            return error_response(
                400, f"invalid request: a multipart form is required ({exc})", "invalid_request_error"
            )
        try:
            upload, purpose = _upload_fields(form)
            record = await self.files.save(client.name, upload.filename or "upload", purpose, _chunks(upload))
        except RequestError as exc:
            return invalid_request(exc)
        except FileTooLarge:
            return self._too_large()
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        finally:
            await form.close()
        return JSONResponse(record.body)

    async def list(self, request: Request) -> Response:
        client = self.front_door.client(header_dict(request))
        if isinstance(client, Response):
            return client
        purpose = request.query_params.get("purpose")
        try:
            query = PageQuery.parse(request.query_params, "desc", max_limit=10_000)
            if purpose is not None and purpose not in PURPOSES:
                raise RequestError(f"`purpose` must be one of {', '.join(PURPOSES)}", "purpose")
        except RequestError as exc:
            return invalid_request(exc)

        def match(record: Record) -> bool:
            return purpose is None or record.body["purpose"] == purpose

        try:
            page = await self.files.records.store.page(KIND, client.name, query.after, query.limit, query.order, match)
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        return JSONResponse(list_object([r.body for r in page.records], page.has_more))

    async def retrieve(self, file_id: str, request: Request) -> Response:
        found = await self._lookup(file_id, request)
        return found if isinstance(found, Response) else JSONResponse(found.body)

    async def content(self, file_id: str, request: Request) -> Response:
        found = await self._lookup(file_id, request)
        if isinstance(found, Response):
            return found
        return FileResponse(self.files.path(file_id), media_type="application/octet-stream")

    async def delete(self, file_id: str, request: Request) -> Response:
        found = await self._lookup(file_id, request)
        if isinstance(found, Response):
            return found
        try:
            await self.files.delete(file_id)
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    async def _lookup(self, file_id: str, request: Request) -> Record | Response:
        client = self.front_door.client(header_dict(request))
        if isinstance(client, Response):
            return client
        try:
            record = await self.files.owned(file_id, client.name)
        except StoreUnavailable as exc:
            return store_unavailable(exc)
        if record is None:
            return error_response(404, f"no file found with id {file_id!r}", "not_found_error")
        return record
