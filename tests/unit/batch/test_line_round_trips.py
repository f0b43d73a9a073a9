"""A batch line is parsed once per read and its body stored as the text it came in;
an answer's bytes are set into its output line as they are (where they are ASCII,
as most are). What a client reads from the files is what it read before: each line
parses to the same object as the line written from the parsed answer (``json.dumps``
of the whole line), stays ASCII and stays one line."""

from __future__ import annotations

import json
import random
import uuid
from typing import Any

import httpx
import pytest
from fastapi.responses import JSONResponse

from proxy.batch.lines import answered, check_line, line_request
from proxy.openai.answers import Answer
from proxy.openai.bodies import parse_json
from tests.unit.api.helpers import (
    CHAT,
    USAGE,
    Call,
    FakeEngines,
    chat_events,
    running,
    stream_response,
)

Json = dict[str, Any]
UNICODE = 'é 中文 😀 \u2028 \x85 "quoted" \\"é\\ back\\'
MESSAGES = [{"role": "user", "content": "hi"}]


def old_line(line_id: str, custom_id: str, status: int, request_id: str, body: Json) -> Json:
    """The output line as it was written before: the whole line through ``json.dumps``."""
    line = {
        "id": line_id,
        "custom_id": custom_id,
        "response": {"status_code": status, "request_id": request_id, "body": body},
        "error": None,
    }
    return json.loads(json.dumps(line))  # type: ignore[no-any-return]


def assert_as_before(text: str, custom_id: str, status: int, body: Json) -> None:
    assert text.isascii()
    assert len(text.splitlines()) == 1
    new = json.loads(text)
    assert new["id"].startswith("batch_req_") and new["response"]["request_id"].startswith("req_")
    request_id = new["response"]["request_id"]
    assert new == old_line(new["id"], custom_id, status, request_id, body)


def chat_answer(content: str) -> Json:
    return {
        "id": "chatcmpl-1", "object": "chat.completion", "created": 17, "model": "m",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                     "finish_reason": "stop"}],
        "usage": USAGE,
    }  # fmt: skip


@pytest.mark.parametrize(
    ("status", "body"),
    [
        pytest.param(200, chat_answer("x" * 2048), id="ascii"),
        pytest.param(200, chat_answer(UNICODE), id="unicode"),
        pytest.param(500, {"error": {"message": f"engine died: {UNICODE}", "code": 500}},
                     id="engine error mid-answer"),
    ],
)  # fmt: skip
def test_an_answer_line_parses_as_the_line_written_from_the_object(status: int, body: Json) -> None:
    """The answer's bytes as the request path makes them (a JSON response's body)."""
    custom_id = f"c-{UNICODE}"
    answer = Answer(status, bytes(JSONResponse(body, status_code=status).body), body)
    result = answered(custom_id, answer, {})
    assert_as_before(result.line, custom_id, status, body)
    assert result.ok == (status == 200)
    ok = (USAGE["prompt_tokens"], USAGE["completion_tokens"]) if status == 200 else (0, 0)
    assert (result.prompt_tokens, result.completion_tokens) == ok


def test_any_text_in_an_answer_parses_as_before() -> None:
    """Answers drawn from the characters JSON escapes or leaves alone, next to one
    another in every order."""
    draw = random.Random(7)
    alphabet = ["a", "/", '"', "\\", "\n", "\x00", "é", "中", "😀", "\u2028", "\x85", "\\u"]
    for _ in range(300):
        body = chat_answer("".join(draw.choices(alphabet, k=draw.randint(0, 12))))
        answer = Answer(200, bytes(JSONResponse(body).body), body)
        assert_as_before(answered("c", answer, {}).line, "c", 200, body)


def test_an_error_made_by_the_proxy_parses_as_before() -> None:
    body = {"error": {"message": "No engine serves `m`.", "type": "invalid_request_error"}}
    result = answered("c1", Answer.of(404, body), {})
    assert not result.ok and result.quality == ""
    assert_as_before(result.line, "c1", 404, body)


def test_the_quality_check_reads_the_answers_object() -> None:
    asked = {"response_format": {"type": "json_object"}}
    good, bad = chat_answer('{"a": "é"}'), chat_answer("not json")
    assert answered("c", Answer.of(200, good), asked).quality == "valid"
    assert answered("c", Answer.of(200, bad), asked).quality == "invalid"


@pytest.mark.anyio
async def test_the_request_paths_answer_is_the_clients_body_in_the_line() -> None:
    """Through the proxy: a line's answer parses to the body a client gets for the
    same request, and an engine's own error (pretty-printed) to that error."""
    engines = FakeEngines()

    def generate(call: Call) -> httpx.Response:
        if call.body["messages"][0]["content"] == "fail":
            raw = json.dumps({"error": {"message": UNICODE}}, indent=2).encode()
            return httpx.Response(400, content=raw, headers={"content-type": "application/json"})
        return stream_response(chat_events(("Hé", "llo ", UNICODE), model="m"))

    engines.generate = generate
    async with running(engines.settings(), engines) as (client, state):
        asked = {"model": "m", "messages": MESSAGES}
        response = await client.post(CHAT, json=asked)
        assert response.status_code == 200
        answer = await state.forwarder.complete(line_request(asked, CHAT), f"j/{uuid.uuid4()}/1")
        assert answer.raw == response.content
        assert_as_before(answered("c1", answer, asked).line, "c1", 200, response.json())
        failing = {"model": "m", "messages": [{"role": "user", "content": "fail"}]}
        error = await state.forwarder.complete(line_request(failing, CHAT), f"j/{uuid.uuid4()}/1")
    assert error.status == 400 and error.body == {"error": {"message": UNICODE}}
    assert_as_before(answered("c2", error, failing).line, "c2", 400, error.body)


# -- input lines ------------------------------------------------------------------------


def test_a_lines_body_is_stored_as_the_object_it_came_in() -> None:
    body_text = '{ "messages" : [{"role": "user", "content": "é \\u00e9 😀"}],\t"model": "m" }'
    raw = (
        '{"custom_id": "a", "body": ' + body_text + ', "method": "POST", '
        '"url": "/v1/chat/completions"}\n'
    ).encode()
    spec = check_line(raw, 1, CHAT)
    assert json.loads(spec.body) == json.loads(body_text) == parse_json(raw)["body"]
