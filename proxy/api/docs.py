"""What ``/openapi.json`` says about the proxy's own routes: the request bodies the
completion routes read (the models of :mod:`proxy.api.body`), their answers, and
the OpenAI-shaped errors every route may give. The handlers read their bodies
themselves (strictly, see :mod:`proxy.api.body`), so FastAPI would otherwise
document none."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from proxy.api.body import ChatCompletionRequest, CompletionRequest

Json = dict[str, Any]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
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


class Readiness(BaseModel):
    ready: bool
    engines_up: list[str]


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
    413: "The body is larger than `max_body_bytes`.",
    415: "The body is not declared `application/json`.",
    503: "No engine serving the model is reachable, or the proxy is draining.",
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


def error_responses(*statuses: int) -> dict[int | str, Json]:
    return {s: {"model": ErrorResponse, "description": ERRORS[s]} for s in statuses}


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
    responses: dict[int | str, Json] = {200: answer}
    responses |= error_responses(400, 401, 403, 404, 413, 415, 503)
    return {"openapi_extra": {"requestBody": body}, "responses": responses}
