"""``/openapi.json`` tells the truth: the completion routes' request bodies as the
proxy reads them, their answers, and the OpenAI-shaped errors."""

from __future__ import annotations

import json
from typing import Any

import pytest

from .helpers import CHAT, COMPLETIONS, FakeEngines, running

pytestmark = pytest.mark.anyio

Json = dict[str, Any]


async def openapi() -> Json:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
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
