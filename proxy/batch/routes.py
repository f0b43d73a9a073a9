"""The Files API (purpose ``batch``) and the Batch API, OpenAI's routes and shapes.

Every route is behind the API key as the completion routes are (the key is checked
as a request comes in, :class:`proxy.api.auth.KeyCheck`). Creating a batch
checks the request, the input file's record and every line of the file, as a stream
(400 naming the first bad line; nothing is stored); the job is then stored
``validating`` and the runner reads its lines into the store (a line it still
refuses, say a file deleted meanwhile, fails the job with OpenAI's ``errors``).
The job is stored as the tenant's of the key that created it (the caller's, as the
key check found it): its lines run as that tenant's, under its weight and limits.
"""

from __future__ import annotations

import functools
import math
import re
import shutil
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.datastructures import UploadFile

from proxy.api.auth import caller
from proxy.batch.health import GuardedStore, StoreDown
from proxy.batch.lines import check_file
from proxy.batch.runner import BatchRunner
from proxy.batch.schema import MAX_FORM_FIELDS, ROUTE_DOCS
from proxy.batch.shapes import batch_object, file_object, page
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
from proxy.openai.bodies import (
    ID_PATTERN,
    BodyError,
    PageQuery,
    check_batch,
    check_page,
    parse_object,
    window_seconds,
)
from proxy.openai.errors import APIError, bad_request

R = TypeVar("R", FileRecord, BatchRecord)
FORM_SLACK_BYTES = 64 * 1024  # multipart framing and the other fields


@dataclass
class BatchAPI:
    """What the routes need: the settings (limits), the store and the runner."""

    settings: Settings
    store: GuardedStore
    runner: BatchRunner


Getter = Callable[[Request], "BatchAPI | None"]


def _api(request: Request, get: Getter) -> BatchAPI:
    api = get(request)
    if api is None:
        raise batch_api_off()
    return api


def batch_api_off() -> APIError:
    """The answer of every route while the Batch API is off: 404, as OpenAI answers
    what the caller cannot use (the SDKs retry a 503, which no retry would fix)."""
    return APIError(
        404,
        "The Batch API is off on this proxy (`batch_store: off`): set `batch_store: "
        "sqlite` (the default: a store under the data directory, or `batch_store_path`) "
        "or `batch_store: postgres` and `batch_dsn` to turn it on.",
        code="batch_api_off",
    )


_ID = re.compile(ID_PATTERN)


def _path_id(request: Request, what: str) -> str:
    """The ``{what}_id`` of the path; 404 for one no id could be (a NUL byte, say,
    which would reach the database)."""
    ident = str(request.path_params[f"{what}_id"])
    if not _ID.match(ident):
        raise not_found(what, ident.encode("ascii", "backslashreplace").decode()[:80])
    return ident


def not_found(what: str, ident: str) -> APIError:
    return APIError(404, f"No {what} with id `{ident}`.", code="not_found")


def install_batch_routes(app: FastAPI, get: Getter) -> None:
    """``/v1/files...``, ``/v1/batches...`` and ``/status/batches`` (the status
    page's batch section); ``get`` finds the running :class:`BatchAPI`. While the
    store is down they answer 503 with ``Retry-After`` (:func:`store_unavailable`)."""
    app.add_exception_handler(StoreDown, _on_store_down)
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


def store_unavailable(exc: StoreDown) -> APIError:
    """The answer while the store is down: retryable, and when."""
    retry = max(1, math.ceil(exc.retry_after_s))
    return APIError(
        503,
        f"The batch store is unavailable; try again in {retry} s.",
        err_type="service_unavailable",
        code="store_unavailable",
        headers={"Retry-After": str(retry)},
    )


async def _on_store_down(_: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StoreDown)
    return store_unavailable(exc).response()


def _batch_object(api: BatchAPI, record: BatchRecord) -> Json:
    return batch_object(record, api.runner.estimate(record))


def _page(request: Request) -> PageQuery:
    """``after`` and ``limit`` of a list request (400 naming the one out of bounds)."""
    try:
        return check_page(request.query_params)
    except BodyError as exc:
        raise bad_request(exc.message, param=exc.param) from None


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

    @app.get(path, name=f"list_{what}", **ROUTE_DOCS[f"list_{what}"])
    async def listing(request: Request) -> JSONResponse:
        api, query = _api(request, get), _page(request)
        found = await lister(api.store)(query.after, query.limit + 1)
        return JSONResponse(page([render(api, x) for x in found], query.limit))

    @app.get(path + f"/{{{what}_id}}", name=f"get_{what}", **ROUTE_DOCS[f"get_{what}"])
    async def one(request: Request) -> JSONResponse:
        api, ident = _api(request, get), _path_id(request, what)
        found = await getter(api.store)(ident)
        if found is None:
            raise not_found(what, ident)
        return JSONResponse(render(api, found))


def _file_routes(app: FastAPI, get: Getter) -> None:
    @app.post("/v1/files", **ROUTE_DOCS["upload"])
    async def upload(request: Request) -> JSONResponse:
        api = _api(request, get)
        return JSONResponse(file_object(await _store_upload(request, api)))

    @app.get("/v1/files/{file_id}/content", **ROUTE_DOCS["content"])
    async def content(request: Request) -> StreamingResponse:
        store, file_id = _api(request, get).store, _path_id(request, "file")
        found = await store.get_file(file_id)
        if found is None:
            raise not_found("file", file_id)
        headers = {"content-length": str(found.bytes)}
        return StreamingResponse(
            store.read_file(file_id), media_type="application/jsonl", headers=headers
        )

    @app.delete("/v1/files/{file_id}", **ROUTE_DOCS["delete"])
    async def delete(request: Request) -> JSONResponse:
        api = _api(request, get)
        file_id = _path_id(request, "file")
        if not await api.store.delete_file(file_id):
            raise not_found("file", file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})


def _too_large(limit: int) -> APIError:
    return APIError(413, f"The file is larger than the limit of {limit} bytes.", param="file")


async def _store_upload(request: Request, api: BatchAPI) -> FileRecord:
    """The upload, checked (size before it is read where the client says it)."""
    limit = api.settings.batch.max_file_bytes
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit + FORM_SLACK_BYTES:
        raise _too_large(limit)
    async with request.form(max_files=1, max_fields=MAX_FORM_FIELDS) as form:
        upload, purpose = form.get("file"), form.get("purpose")
        if not isinstance(upload, UploadFile):
            raise bad_request("`file` is required (multipart form).", param="file")
        if purpose != "batch":
            raise bad_request("`purpose` must be `batch`.", param="purpose")
        if upload.size is not None and upload.size > limit:
            raise _too_large(limit)
        spool = api.store.spool_path()
        await anyio.to_thread.run_sync(_copy, upload, spool)
        name = "".join(c for c in upload.filename or "" if c.isprintable())[:255]
        return await api.store.add_file("batch", name or "upload.jsonl", spool)


def _copy(upload: UploadFile, to: Path) -> None:
    with to.open("wb") as out:
        shutil.copyfileobj(upload.file, out)


def _batch_routes(app: FastAPI, get: Getter) -> None:
    @app.post("/v1/batches", **ROUTE_DOCS["create"])
    async def create(request: Request) -> JSONResponse:
        api = _api(request, get)
        tenant = caller(request.scope).tenant.name
        created = await _create(api, parse_object(await request.body()), tenant)
        return JSONResponse(_batch_object(api, created))

    @app.post("/v1/batches/{batch_id}/cancel", **ROUTE_DOCS["cancel"])
    async def cancel(request: Request) -> JSONResponse:
        api, batch_id = _api(request, get), _path_id(request, "batch")
        moved = await api.store.set_status(batch_id, "cancelling", ("validating", "in_progress"))
        found = await api.store.get_batch(batch_id)
        if found is None:
            raise not_found("batch", batch_id)
        if not moved and found.status not in ("cancelling", "cancelled"):
            raise bad_request(f"A batch that is `{found.status}` cannot be cancelled.")
        api.runner.cancel(batch_id)
        return JSONResponse(_batch_object(api, found))


async def _create(api: BatchAPI, body: Json, tenant: str) -> BatchRecord:
    """The job of ``tenant``, stored ``validating``: the request checked (the rules
    and bounds of :class:`proxy.openai.bodies.BatchRequest`), then its input file and
    every line."""
    try:
        asked = check_batch(body)
    except BodyError as exc:
        raise bad_request(exc.message, param=exc.param) from None
    window_s = window_seconds(asked.completion_window)
    assert window_s is not None  # the model checked it
    await _input_file(api, asked.input_file_id)
    await _check_lines(api, asked.input_file_id, asked.endpoint)
    new = NewBatch(
        f"batch_{uuid.uuid4().hex}", asked.endpoint, asked.input_file_id,
        asked.completion_window, window_s, asked.metadata, tenant,
    )  # fmt: skip
    return await api.store.add_batch(new)


async def _check_lines(api: BatchAPI, file_id: str, endpoint: str) -> None:
    """Every line of the input file checked before the job exists (a stream, off the
    event loop): a bad one is a 400 naming it, and nothing is stored."""
    limit = api.settings.batch.max_lines
    check = functools.partial(check_file, max_line_bytes=api.settings.edge.max_body_bytes)
    try:
        async with api.store.local_file(file_id) as path:
            await anyio.to_thread.run_sync(check, path, endpoint, limit)
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
    if found.bytes > api.settings.batch.max_file_bytes:
        raise bad_request(
            f"File `{file_id}` is larger than the limit of "
            f"{api.settings.batch.max_file_bytes} bytes.",
            param="input_file_id",
        )
    return found
