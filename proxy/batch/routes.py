"""The Files API (purpose ``batch``) and the Batch API, OpenAI's routes and shapes.

Every route checks the API key as the completion routes do. Creating a batch
checks the request, the input file's record and every line of the file, as a stream
(400 naming the first bad line; nothing is stored); the job is then stored
``validating`` and the runner reads its lines into the store (a line it still
refuses, say a file deleted meanwhile, fails the job with OpenAI's ``errors``).
"""

from __future__ import annotations

import json
import shutil
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import UploadFile

from proxy.api.errors import APIError, bad_request
from proxy.api.inputs import check_api_key
from proxy.batch.lines import ENDPOINTS, check_file
from proxy.batch.runner import BatchRunner
from proxy.batch.shapes import batch_object, file_object, page, window_seconds
from proxy.batch.store import (
    BatchRecord,
    BatchStore,
    FileRecord,
    Json,
    LineError,
    NewBatch,
)
from proxy.batch.view import jobs_body
from proxy.config import Settings

R = TypeVar("R", FileRecord, BatchRecord)
FORM_SLACK_BYTES = 64 * 1024  # multipart framing and the other fields


@dataclass
class BatchAPI:
    """What the routes need: the settings (keys, limits), the store and the runner."""

    settings: Settings
    store: BatchStore
    runner: BatchRunner


Getter = Callable[[Request], "BatchAPI | None"]


def _api(request: Request, get: Getter) -> BatchAPI:
    api = get(request)
    if api is None:
        raise APIError(
            503,
            "The Batch API is off: set batch_store_path (or batch_dsn).",
            err_type="service_unavailable",
        )
    check_api_key(request, api.settings)
    return api


def not_found(what: str, ident: str) -> APIError:
    return APIError(404, f"No {what} with id `{ident}`.", code="not_found")


def install_batch_routes(app: FastAPI, get: Getter) -> None:
    """``/v1/files...``, ``/v1/batches...`` and ``/status/batches`` (the status
    page's batch section); ``get`` finds the running :class:`BatchAPI`."""
    _file_routes(app, get)
    _batch_routes(app, get)
    _read_routes(
        app, get, "/v1/files", "file",
        lambda store: store.list_files, lambda store: store.get_file,
        lambda _, record: file_object(record),
    )  # fmt: skip
    _read_routes(
        app, get, "/v1/batches", "batch",
        lambda store: store.list_batches, lambda store: store.get_batch, _batch_object,
    )  # fmt: skip

    @app.get("/status/batches", include_in_schema=False)
    async def status_batches(request: Request) -> JSONResponse:
        api = get(request)
        return JSONResponse(await jobs_body(api.runner if api is not None else None))


def _batch_object(api: BatchAPI, record: BatchRecord) -> Json:
    return batch_object(record, api.runner.estimate(record))


def _limit(request: Request) -> int:
    raw = request.query_params.get("limit", "20")
    if not raw.isdigit() or not 1 <= int(raw) <= 10_000:
        raise bad_request("`limit` must be an integer from 1 to 10000.", param="limit")
    return int(raw)


def _read_routes(
    app: FastAPI,
    get: Getter,
    path: str,
    what: str,
    lister: Callable[[BatchStore], Callable[[str | None, int], Awaitable[list[R]]]],
    getter: Callable[[BatchStore], Callable[[str], Awaitable[R | None]]],
    render: Callable[[BatchAPI, R], Json],
) -> None:
    """``GET path`` (a page: ``after``, ``limit``) and ``GET path/{id}`` of ``what``."""

    @app.get(path, name=f"list_{what}")
    async def listing(request: Request) -> JSONResponse:
        api, limit = _api(request, get), _limit(request)
        found = await lister(api.store)(request.query_params.get("after"), limit + 1)
        return JSONResponse(page([render(api, x) for x in found], limit))

    @app.get(path + "/{ident}", name=f"get_{what}")
    async def one(request: Request, ident: str) -> JSONResponse:
        api = _api(request, get)
        found = await getter(api.store)(ident)
        if found is None:
            raise not_found(what, ident)
        return JSONResponse(render(api, found))


def _file_routes(app: FastAPI, get: Getter) -> None:
    @app.post("/v1/files")
    async def upload(request: Request) -> JSONResponse:
        api = _api(request, get)
        return JSONResponse(file_object(await _store_upload(request, api)))

    @app.get("/v1/files/{file_id}/content")
    async def content(request: Request, file_id: str) -> StreamingResponse:
        store = _api(request, get).store
        found = await store.get_file(file_id)
        if found is None:
            raise not_found("file", file_id)
        headers = {"content-length": str(found.bytes)}
        return StreamingResponse(
            store.read_file(file_id), media_type="application/jsonl", headers=headers
        )

    @app.delete("/v1/files/{file_id}")
    async def delete(request: Request, file_id: str) -> JSONResponse:
        if not await _api(request, get).store.delete_file(file_id):
            raise not_found("file", file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The file is larger than the limit of {limit} bytes.", param="file")


async def _store_upload(request: Request, api: BatchAPI) -> FileRecord:
    """The upload, checked (size before it is read where the client says it)."""
    limit = api.settings.batch_max_file_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + FORM_SLACK_BYTES:
        raise _too_large(limit)
    async with request.form(max_files=1, max_fields=8) as form:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise bad_request("`file` is required (multipart form).", param="file")
        if purpose != "batch":
            raise bad_request("`purpose` must be `batch`.", param="purpose")
        if upload.size is not None and upload.size > limit:
            raise _too_large(limit)
        spool = api.store.spool_path()
        await anyio.to_thread.run_sync(_copy, upload, spool)
        return await api.store.add_file("batch", upload.filename or "upload.jsonl", spool)


def _copy(upload: UploadFile, to: Path) -> None:
    with to.open("wb") as out:
        shutil.copyfileobj(upload.file, out)


def _batch_routes(app: FastAPI, get: Getter) -> None:
    @app.post("/v1/batches")
    async def create(request: Request) -> JSONResponse:
        api = _api(request, get)
        created = await _create(api, await _read_body(request))
        return JSONResponse(_batch_object(api, created))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel(request: Request, batch_id: str) -> JSONResponse:
        api = _api(request, get)
        moved = await api.store.set_status(batch_id, "cancelling", ("validating", "in_progress"))
        found = await api.store.get_batch(batch_id)
        if found is None:
            raise not_found("batch", batch_id)
        if not moved and found.status not in ("cancelling", "cancelled"):
            raise bad_request(f"A batch that is `{found.status}` cannot be cancelled.")
        api.runner.cancel(batch_id)
        return JSONResponse(_batch_object(api, found))


async def _create(api: BatchAPI, body: Json) -> BatchRecord:
    endpoint, window = body.get("endpoint"), body.get("completion_window")
    if endpoint not in ENDPOINTS:
        raise bad_request(f"`endpoint` must be one of {list(ENDPOINTS)}.", param="endpoint")
    window_s = window_seconds(window)
    if window_s is None:
        raise bad_request("`completion_window` must be like `24h`.", param="completion_window")
    metadata = body.get("metadata")
    if metadata is not None and not (
        isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())
    ):
        raise bad_request("`metadata` must map strings to strings.", param="metadata")
    file_id = body.get("input_file_id")
    await _input_file(api, file_id)
    await _check_lines(api, str(file_id), str(endpoint))
    meta: Mapping[str, str] | None = metadata
    new = NewBatch(
        f"batch_{uuid.uuid4().hex}", str(endpoint), str(file_id), str(window), window_s, meta
    )
    return await api.store.add_batch(new)


async def _check_lines(api: BatchAPI, file_id: str, endpoint: str) -> None:
    """Every line of the input file checked before the job exists (a stream, off the
    event loop): a bad one is a 400 naming it, and nothing is stored."""
    limit = api.settings.batch_max_lines
    try:
        async with api.store.local_file(file_id) as path:
            await anyio.to_thread.run_sync(check_file, path, endpoint, limit)
    except LineError as exc:
        raise bad_request(str(exc), param="input_file_id") from None
    except OSError:
        raise bad_request(f"The input file `{file_id}` is gone.", param="input_file_id") from None


async def _input_file(api: BatchAPI, file_id: object) -> FileRecord:
    found = await api.store.get_file(file_id) if isinstance(file_id, str) else None
    if found is None:
        raise bad_request(f"No input file with id `{file_id}`.", param="input_file_id")
    if found.purpose != "batch":
        raise bad_request(
            f"File `{file_id}` has purpose `{found.purpose}`, not `batch`.", param="input_file_id"
        )
    if found.bytes > api.settings.batch_max_file_bytes:
        raise bad_request(
            f"File `{file_id}` is larger than the limit of "
            f"{api.settings.batch_max_file_bytes} bytes.",
            param="input_file_id",
        )
    return found


async def _read_body(request: Request) -> Json:
    try:
        body = json.loads(await request.body())
    except ValueError as exc:
        raise bad_request(f"The request body is not valid JSON: {exc}") from exc
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    return body
