"""What ``/openapi.json`` says about the Files and Batch API: OpenAI's objects (the
file, the batch, a list page, a deleted file), the request bodies and parameters the
handlers read themselves, and every status each route answers (:data:`ROUTE_DOCS`).

These models document; :mod:`proxy.batch.shapes` builds the answers, and the
conformance tests (``tests/integration/test_openapi_conformance.py``) hold the two
together."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from pydantic import BaseModel

from proxy.api.docs import described_errors, inline
from proxy.openai.bodies import ID_PATTERN, BatchRequest

Json = dict[str, Any]


class FileObject(BaseModel):
    id: str
    object: Literal["file"]
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["processed"]
    status_details: str | None


class FileList(BaseModel):
    object: Literal["list"]
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"]
    deleted: bool


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None
    line: int | None


class BatchErrors(BaseModel):
    object: Literal["list"]
    data: list[BatchError]


class RequestCounts(BaseModel):
    """OpenAI's ``total``, ``completed`` and ``failed``; ``valid`` and ``invalid``:
    the completed lines whose answer holds a completion that follows the structured
    output the line asked for, if any, and the others (they add up to ``completed``)."""

    total: int
    completed: int
    failed: int
    valid: int
    invalid: int


class BatchEstimate(BaseModel):
    """The proxy's estimate of an active job (``None`` fields: not measured yet);
    ``basis``: what its rate was measured over (``measured over 120 lines in 60 s
    busy``, ``after restart, from the stored rate: ...``, a model's rate, or ``not
    measured yet``)."""

    estimated_completion_at: int | None
    records_per_hour: float | None
    valid_records_per_hour: float | None
    window_reachable: bool | None
    basis: str


class BatchObject(BaseModel):
    """OpenAI's batch object, and ``whoseturn``: the estimate of an active job."""

    id: str
    object: Literal["batch"]
    endpoint: str
    errors: BatchErrors | None
    input_file_id: str
    completion_window: str
    status: Literal[
        "validating", "failed", "in_progress", "finalizing",
        "completed", "expired", "cancelling", "cancelled",
    ]  # fmt: skip
    output_file_id: str | None
    error_file_id: str | None
    created_at: int
    expires_at: int | None
    request_counts: RequestCounts
    metadata: dict[str, str] | None
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    whoseturn: BatchEstimate | None


class BatchList(BaseModel):
    object: Literal["list"]
    data: list[BatchObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


# -- requests: parameters and bodies ------------------------------------------------------


def _path_id(name: str) -> Json:
    return {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}


PAGE_QUERY: Json = {
    "parameters": [
        {
            "name": "after",
            "in": "query",
            "required": False,
            "schema": {"type": "string", "pattern": ID_PATTERN},
            "description": "The last id of the page before.",
        },
        {
            "name": "limit",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 1, "maximum": 10_000, "default": 20},
        },
    ]
}
MAX_FORM_FIELDS = 8
"""The fields an upload's form may hold beside its one file."""
FILE_ID: Json = {"parameters": [_path_id("file_id")]}
BATCH_ID: Json = {"parameters": [_path_id("batch_id")]}
UPLOAD: Json = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "properties": {
                        "file": {"type": "string", "format": "binary"},
                        "purpose": {"type": "string", "enum": ["batch"]},
                    },
                    "required": ["file", "purpose"],
                    "maxProperties": MAX_FORM_FIELDS + 1,
                    "additionalProperties": {"type": "string"},
                }
            }
        },
    }
}
CREATE: Json = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": inline(BatchRequest)}},
    }
}

# -- answers ------------------------------------------------------------------------------

OFF = "the Batch API is off (no batch store set: `batch_store_path` or `batch_dsn`)"
COMMON = {
    401: "Missing or unknown API key (when `api_keys` is set).",
    403: "The API key may only read.",
    404: f"Every route: {OFF}.",
    503: "The batch store does not answer (a database outage), or the proxy holds as "
    "many request bodies as it may: retry after `Retry-After` seconds.",
}


def _errors(own: Mapping[int, str]) -> dict[int | str, Json]:
    """The route's own errors beside the ones every route gives."""
    return described_errors({**COMMON, **own}, retry_after=True)


def _missing(what: str) -> str:
    return f"No {what} with that id, or {OFF}."


PAGE_400 = "`after` or `limit` is not valid (the message names which)."
JSONL: Json = {
    "description": "The file's bytes (JSONL).",
    "content": {"application/jsonl": {"schema": {"type": "string"}}},
}


def _route(model: type[BaseModel], own: Mapping[int, str], extra: Json) -> Json:
    """A route's ``response_model``, its ``responses`` and its ``openapi_extra``."""
    return {"response_model": model, "responses": _errors(own), "openapi_extra": extra}


# The keyword arguments of each route's decorator, by route name.
ROUTE_DOCS: dict[str, Json] = {
    "list_file": _route(FileList, {400: PAGE_400}, PAGE_QUERY),
    "get_file": _route(FileObject, {404: _missing("file")}, FILE_ID),
    "upload": _route(
        FileObject,
        {
            400: "Not a multipart form with a `file` and `purpose=batch`.",
            408: "No bytes of the body arrived for `body_timeout_s`.",
            413: "The file is larger than `batch_max_file_bytes`.",
        },
        UPLOAD,
    ),
    "content": {
        "responses": {200: JSONL, **_errors({404: _missing("file")})},
        "openapi_extra": FILE_ID,
    },
    "delete": _route(FileDeleted, {404: _missing("file")}, FILE_ID),
    "list_batch": _route(BatchList, {400: PAGE_400}, PAGE_QUERY),
    "get_batch": _route(BatchObject, {404: _missing("batch")}, BATCH_ID),
    "create": _route(
        BatchObject,
        {
            400: "The body, its input file or a line of the file is not valid (the "
            "message names which).",
            408: "No bytes of the body arrived for `body_timeout_s`.",
            413: "The body is larger than `max_body_bytes`.",
        },
        CREATE,
    ),
    "cancel": _route(
        BatchObject, {400: "The batch is final already.", 404: _missing("batch")}, BATCH_ID
    ),
}
