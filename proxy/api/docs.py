"""What ``/openapi.json`` says about the proxy's own routes: the request bodies the
completion routes read (the models of :mod:`proxy.openai.bodies`), their answers, and
the OpenAI-shaped errors every route may give. The handlers read their bodies
themselves (strictly, see :mod:`proxy.openai.bodies`), so FastAPI would otherwise
document none."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Literal

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel

from proxy.openai.bodies import ChatCompletionRequest, CompletionRequest

Json = dict[str, Any]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    # A string naming the condition, or null, in every error the proxy answers
    # itself; an engine's own error answer is relayed as the engine wrote it (vLLM's
    # `code` is its HTTP status), hence the integer.
    code: str | int | None


class ErrorResponse(BaseModel):
    """OpenAI's error shape, used by every error the proxy answers itself."""

    error: ErrorDetail


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]


class StoreState(BaseModel):
    """The batch store's health (:mod:`proxy.batch.health`)."""

    up: bool
    for_s: float
    cause: str | None
    outages: int


class Readiness(BaseModel):
    """Ready when an engine is up; the batch store's state is reported, not required
    (chat does not need it)."""

    ready: bool
    engines_up: list[str]
    batch_store: StoreState | None = None


# One server-sent event (a JSON chunk, an error object, or ``[DONE]`` in ``data``).
SSE_EVENT: Json = {
    "type": "object",
    "properties": {
        "event": {"type": "string"},
        "data": {"type": "string"},
        "id": {"type": "string"},
        "retry": {"type": "integer"},
    },
}

ERRORS = {
    400: "The body is not a request the proxy can read (JSON, types, stream options).",
    401: "Missing or unknown API key (when `api_keys` is set).",
    403: "The API key may not use this route, class or class header.",
    404: "No engine serves the model.",
    408: "No bytes of the body arrived for `body_timeout_s` (the connection is closed).",
    413: "The body is larger than `max_body_bytes`.",
    415: "The body is not declared `application/json`.",
    422: "A query parameter is not valid (the message names it).",
    502: "The engine failed in the middle of a whole (not streamed) answer.",
    503: "No engine serving the model is reachable, the proxy is draining, or it holds "
    "as many request bodies as `max_body_bytes_in_flight` allows.",
}
# The headers an error answer carries: 401 asks for a key; a 503 says when to retry
# where a retry is worth it (required where every 503 of the route carries it).
ERROR_HEADERS: dict[int, Json] = {
    401: {
        "WWW-Authenticate": {
            "description": "Bearer or Basic credentials.",
            "required": True,
            "schema": {"type": "string"},
        }
    },
    503: {
        "Retry-After": {
            "description": "Seconds after which a retry may succeed.",
            "required": False,
            "schema": {"type": "integer", "minimum": 0},
        }
    },
}
ENGINE_ERROR: Json = {
    "description": "The engine's own error answer, passed through unchanged (its status, "
    "body and content type)."
}


def inline(model: type[BaseModel]) -> Json:
    """``model``'s JSON schema with its ``$defs`` written in place (no references
    to resolve; the request models are not recursive)."""
    schema = model.model_json_schema()
    defs: Json = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    resolved: Json = resolve(schema)
    return resolved


def publish_as_written(app: FastAPI) -> None:
    """Publish each route's ``openapi_extra`` (its body, its parameters) as written:
    FastAPI's OpenAPI model writes every numeric bound as a float, and
    ``2**63 - 1`` as a float is ``2**63``, a bound the proxy refuses."""
    build = app.openapi

    def openapi() -> Json:
        fresh = app.openapi_schema is None
        schema = build()
        for route in app.routes if fresh else ():
            if isinstance(route, APIRoute) and route.include_in_schema and route.openapi_extra:
                for method in route.methods or ():
                    schema["paths"][route.path_format][method.lower()].update(route.openapi_extra)
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def error_responses(*statuses: int) -> dict[int | str, Json]:
    """The proxy's own errors ``statuses``, as :data:`ERRORS` describes them."""
    return described_errors({s: ERRORS[s] for s in statuses})


def described_errors(
    descriptions: Mapping[int, str], *, retry_after: bool = False
) -> dict[int | str, Json]:
    """OpenAI-shaped errors, one per status with its description, and the headers
    they carry; ``retry_after``: every 503 carries ``Retry-After``."""
    docs: dict[int | str, Json] = {}
    for status, description in descriptions.items():
        doc: Json = {"model": ErrorResponse, "description": description}
        headers = {name: dict(h) for name, h in ERROR_HEADERS.get(status, {}).items()}
        if retry_after and "Retry-After" in headers:
            headers["Retry-After"]["required"] = True
        if headers:
            doc["headers"] = headers
        docs[status] = doc
    return docs


def completion_route_docs(chat: bool) -> Json:
    """``openapi_extra`` and ``responses`` for a completion route."""
    model = ChatCompletionRequest if chat else CompletionRequest
    body = {"required": True, "content": {"application/json": {"schema": inline(model)}}}
    answer = {
        "description": "The engine's answer: one JSON body, or with `stream: true` "
        "server-sent events ending with `data: [DONE]`.",
        "content": {
            "application/json": {"schema": {"type": "object", "additionalProperties": True}},
            "text/event-stream": {"schema": SSE_EVENT},
        },
    }
    responses: dict[int | str, Json] = {200: answer, "default": ENGINE_ERROR}
    responses |= error_responses(400, 401, 403, 404, 408, 413, 415, 502, 503)
    return {"openapi_extra": {"requestBody": body}, "responses": responses}


class Health(BaseModel):
    status: Literal["ok"]


def _object(**required: Json) -> Json:
    """A JSON object schema: these properties, all required (others may follow)."""
    return {"type": "object", "required": list(required), "properties": required}


def _json(description: str, schema: Json) -> Json:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


_TIME: Json = {"type": "string", "description": "ISO 8601, UTC, milliseconds."}
_LIST: Json = {"type": "array", "items": {"type": "object"}}
# ``GET /turn``, ``/turn/log`` and ``/turn/history`` (:mod:`proxy.api.turn`): reads of
# the scheduler's state (their entries: docs/scheduling.md).
TURN: dict[int | str, Json] = {
    200: {
        "description": "Whose turn it is on each engine: JSON, or one sentence per engine "
        "as text (`?format=text`, or `Accept: text/plain`).",
        "content": {
            "application/json": {
                "schema": _object(time=_TIME, replica={"type": ["string", "null"]}, engines=_LIST)
            },
            "text/plain": {"schema": {"type": "string"}},
        },
    },
    **error_responses(401),
}
TURN_QUERY: Json = {
    "parameters": [
        {
            "name": "format",
            "in": "query",
            "required": False,
            "schema": {"type": "string"},
            "description": "`text`: one sentence per engine, as text; anything else: JSON.",
        },
        {
            "name": "scope",
            "in": "query",
            "required": False,
            "schema": {"type": "string"},
            "description": "`worker`: one of a box's workers answers for itself only; "
            "else its answer holds every worker's in `box`.",
        },
    ]
}
TURN_LOG: dict[int | str, Json] = {
    200: _json(
        "The latest decisions, budget moves and piecing choices, oldest first.",
        _object(budget=_LIST, piecing=_LIST, decisions=_LIST),
    ),
    **error_responses(401, 422),
}
TURN_HISTORY: dict[int | str, Json] = {
    200: _json(
        "Each engine's last seconds, with the share of each spent in each turn.",
        _object(time=_TIME, seconds={"type": "integer"}, engines=_LIST),
    ),
    **error_responses(401, 422),
}
