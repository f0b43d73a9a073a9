"""``/openapi.json`` tells the truth: the completion routes' request bodies as the
proxy reads them, their answers, and the OpenAI-shaped errors; the Files and Batch
API's objects and every status its routes give. And HTTP's rules on methods: a 405
lists every method of the path, and every ``GET`` route answers ``HEAD``.
(schemathesis holds the schema to the answers: tests/integration/test_openapi_conformance.py.)"""

from __future__ import annotations

import json
from typing import Any

import pytest

from .helpers import CHAT, COMPLETIONS, FakeEngines, running

pytestmark = pytest.mark.anyio

Json = dict[str, Any]


async def openapi(**settings: Any) -> Json:
    engines = FakeEngines()
    async with running(engines.settings(**settings), engines) as (client, _):
        response = await client.get("/openapi.json")
    assert response.status_code == 200
    document: Json = response.json()
    return document


@pytest.mark.parametrize(
    ("path", "required"),
    [
        (CHAT, ["model", "messages"]),
        ("/batch" + CHAT, ["model", "messages"]),
        (COMPLETIONS, ["model", "prompt"]),
        ("/batch" + COMPLETIONS, ["model", "prompt"]),
    ],
)
async def test_completion_routes_declare_their_bodies_and_answers(
    path: str, required: list[str]
) -> None:
    operation = (await openapi())["paths"][path]["post"]
    body = operation["requestBody"]
    assert body["required"] is True  # an empty POST is not a valid request
    schema = body["content"]["application/json"]["schema"]
    assert schema["required"] == required
    assert schema["additionalProperties"] is True  # other fields go to the engine
    assert {"type": "boolean"} in schema["properties"]["stream"]["anyOf"]
    # stream_options only with stream: true, as the proxy (and vLLM) refuses it
    assert schema["then"] == {"required": ["stream"], "properties": {"stream": {"const": True}}}
    assert "$ref" not in json.dumps(schema)  # nothing left unresolved
    answers = operation["responses"]
    assert set(answers["200"]["content"]) == {"application/json", "text/event-stream"}
    for status in ("400", "401", "403", "404", "413", "415", "503"):
        ref = answers[status]["content"]["application/json"]["schema"]["$ref"]
        assert ref == "#/components/schemas/ErrorResponse"


async def test_the_error_shape_is_openais() -> None:
    schemas = (await openapi())["components"]["schemas"]
    assert schemas["ErrorResponse"]["required"] == ["error"]
    assert schemas["ErrorDetail"]["required"] == ["message", "type", "param", "code"]


async def test_reads_declare_their_answers() -> None:
    paths = (await openapi())["paths"]
    for path in ("/v1/models", "/batch/v1/models"):
        schema = paths[path]["get"]["responses"]["200"]["content"]["application/json"]["schema"]
        assert schema["$ref"] == "#/components/schemas/ModelList"
    assert "text/plain" in paths["/metrics"]["get"]["responses"]["200"]["content"]
    readyz = paths["/readyz"]["get"]["responses"]
    assert {readyz[s]["content"]["application/json"]["schema"]["$ref"] for s in ("200", "503")} == {
        "#/components/schemas/Readiness"
    }


async def test_integer_bounds_are_published_as_written() -> None:
    """Not as floats: ``2**63 - 1`` as a float is ``2**63``, which the proxy refuses."""
    paths = (await openapi())["paths"]
    body = paths[COMPLETIONS]["post"]["requestBody"]["content"]["application/json"]["schema"]
    bounds = body["properties"]["max_tokens"]["anyOf"][0]
    assert (bounds["minimum"], bounds["maximum"]) == (0, 2**63 - 1)
    assert type(bounds["maximum"]) is int


def ref(answer: Json) -> str:
    return str(answer["content"]["application/json"]["schema"]["$ref"])


BATCH_ROUTES = [
    ("get", "/v1/files", "FileList", {400}),
    ("post", "/v1/files", "FileObject", {400, 408, 413}),
    ("get", "/v1/files/{file_id}", "FileObject", set()),
    ("delete", "/v1/files/{file_id}", "FileDeleted", set()),
    ("get", "/v1/batches", "BatchList", {400}),
    ("post", "/v1/batches", "BatchObject", {400, 408, 413}),
    ("get", "/v1/batches/{batch_id}", "BatchObject", set()),
    ("post", "/v1/batches/{batch_id}/cancel", "BatchObject", {400}),
]


@pytest.mark.parametrize(("method", "path", "model", "own"), BATCH_ROUTES)
async def test_batch_routes_declare_every_answer(
    method: str, path: str, model: str, own: set[int]
) -> None:
    document = await openapi()
    answers = document["paths"][path][method]["responses"]
    assert ref(answers["200"]) == f"#/components/schemas/{model}"
    assert set(answers) == {"200", "401", "403", "404", "503", *map(str, own)}
    for status in set(answers) - {"200"}:
        assert ref(answers[status]) == "#/components/schemas/ErrorResponse"
    # the store down: retry later, and when (every 503 of these routes says)
    assert answers["503"]["headers"]["Retry-After"]["required"] is True
    assert answers["401"]["headers"]["WWW-Authenticate"]["required"] is True
    schemas = document["components"]["schemas"]
    assert "HTTPValidationError" not in schemas  # no 422 these routes cannot give


async def test_batch_objects_are_described() -> None:
    schemas = (await openapi())["components"]["schemas"]
    batch = schemas["BatchObject"]
    assert batch["properties"]["status"]["enum"] == [
        "validating", "failed", "in_progress", "finalizing",
        "completed", "expired", "cancelling", "cancelled",
    ]  # fmt: skip
    assert {"request_counts", "whoseturn", "errors", "metadata"} <= set(batch["required"])
    assert schemas["FileObject"]["properties"]["object"]["const"] == "file"
    page = {"object", "data", "first_id", "last_id", "has_more"}
    assert set(schemas["BatchList"]["required"]) == page


async def test_batch_requests_are_described() -> None:
    paths = (await openapi())["paths"]
    create = paths["/v1/batches"]["post"]["requestBody"]["content"]["application/json"]
    assert create["schema"]["required"] == ["input_file_id", "endpoint", "completion_window"]
    upload = paths["/v1/files"]["post"]["requestBody"]["content"]["multipart/form-data"]
    assert upload["schema"]["required"] == ["file", "purpose"]
    limit = {p["name"]: p for p in paths["/v1/batches"]["get"]["parameters"]}["limit"]
    assert (limit["schema"]["minimum"], limit["schema"]["maximum"]) == (1, 10_000)
    ids = paths["/v1/files/{file_id}/content"]["get"]["parameters"]
    assert [(p["name"], p["in"]) for p in ids] == [("file_id", "path")]


async def test_every_route_is_published_with_its_answers() -> None:
    paths = (await openapi())["paths"]
    for path, item in paths.items():
        for method, operation in item.items():
            assert "200" in operation["responses"], (method, path)
    turn = paths["/turn"]["get"]["responses"]["200"]["content"]
    assert set(turn) == {"application/json", "text/plain"}
    assert ref(paths["/turn/log"]["get"]["responses"]["422"]).endswith("/ErrorResponse")
    assert ref(paths["/healthz"]["get"]["responses"]["200"]).endswith("/Health")


# -- methods -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "allowed"),
    [
        ("/v1/files", "GET, HEAD, POST"),
        ("/v1/files/file-1", "DELETE, GET, HEAD"),
        ("/v1/batches/batch_1/cancel", "POST"),
        (CHAT, "POST"),
        ("/turn", "GET, HEAD"),
    ],
)
async def test_a_405_lists_every_method_of_the_path(path: str, allowed: str) -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        response = await client.request("PATCH", path)
    assert response.status_code == 405
    assert response.headers["allow"] == allowed
    assert response.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/models", "/healthz", "/turn", "/metrics", "/openapi.json"])
async def test_head_answers_as_get_without_the_body(path: str) -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        got = await client.get(path)
        head = await client.head(path)
    assert (head.status_code, got.status_code) == (200, 200)
    assert head.content == b""
    assert head.headers["content-type"] == got.headers["content-type"]
    if path in ("/v1/models", "/healthz", "/openapi.json"):  # the same body each time
        assert head.headers["content-length"] == got.headers["content-length"]
    assert "x-request-id" in head.headers


async def test_head_on_a_post_route_is_a_405() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        response = await client.head(CHAT)
    assert (response.status_code, response.headers["allow"]) == (405, "POST")


async def test_head_asks_for_the_key_as_get_does() -> None:
    engines = FakeEngines()
    async with running(engines.settings(api_keys=("k",)), engines) as (client, _):
        refused = await client.head("/v1/models")
        allowed = await client.head("/v1/models", headers={"Authorization": "Bearer k"})
    assert (refused.status_code, allowed.status_code) == (401, 200)
