"""Every number a route reads or forwards is held to its bounds (OpenAI's, integers
within int64, floats finite) and a value outside them is a 400 naming its field:
the completion bodies, the Batch API's body and its list queries."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from proxy.openai.bodies import (
    INT64_MAX,
    INT64_MIN,
    MAX_WINDOW_S,
    BatchRequest,
    BodyError,
    ChatCompletionRequest,
    CompletionRequest,
    check_batch,
    check_completion,
    check_page,
    parse_json,
    window_seconds,
)

from .helpers import CHAT, COMPLETIONS, MESSAGES, FakeEngines, running

Json = dict[str, Any]


def body(chat: bool, **fields: Any) -> Json:
    if chat:
        return {"model": "m", "messages": MESSAGES, **fields}
    return {"model": "m", "prompt": "Say hello.", **fields}


# (field, chat route?, completions route?, values refused, values taken at the bounds)
BOUNDS: list[tuple[str, bool, bool, list[Any], list[Any]]] = [
    ("max_tokens", True, True, [-1, INT64_MAX + 1, 1.5, True, "16"], [0, 1, INT64_MAX, None]),
    ("max_completion_tokens", True, False, [-1, INT64_MAX + 1, 2.0], [0, INT64_MAX]),
    ("n", True, True, [0, 129, -(2**70), 1.0], [1, 128]),
    ("temperature", True, True, [-0.01, 2.01, 10**400, True, "1"], [0, 0.0, 2, 2.0, 0.7]),
    ("top_p", True, True, [-0.1, 1.01, 2], [0, 1, 0.95]),
    ("presence_penalty", True, True, [-2.5, 2.01], [-2, 2, 0.0]),
    ("frequency_penalty", True, True, [-2.01, 3], [-2.0, 2]),
    ("seed", True, True, [INT64_MAX + 1, INT64_MIN - 1, 10**30, 1.0], [INT64_MIN, INT64_MAX, 0]),
    ("top_logprobs", True, False, [-1, 21], [0, 20]),
    ("logprobs", False, True, [-1, 6, True], [0, 5]),
    ("best_of", False, True, [-1, 21], [0, 20]),
]
CASES = [
    (field, chat, refused, taken)
    for field, on_chat, on_completions, refused, taken in BOUNDS
    for chat in (True, False)
    if (on_chat if chat else on_completions)
]


@pytest.mark.parametrize(
    ("field", "chat", "refused", "taken"),
    [pytest.param(*case, id=f"{case[0]}-{'chat' if case[1] else 'completions'}") for case in CASES],
)
def test_each_number_is_refused_outside_its_bounds_naming_the_field(
    field: str, chat: bool, refused: list[Any], taken: list[Any]
) -> None:
    for value in refused:
        with pytest.raises(BodyError) as caught:
            check_completion(body(chat, **{field: value}), chat=chat)
        assert caught.value.param == field, value
        assert caught.value.message.startswith(f"`{field}`: "), caught.value.message
    for value in taken:
        assert check_completion(body(chat, **{field: value}), chat=chat)[field] == value


def test_logit_bias_values_are_held_to_100_either_way() -> None:
    assert check_completion(body(True, logit_bias={"50256": -100, "11": 100.0}), chat=True)
    for value in (-100.5, 101, True):
        with pytest.raises(BodyError) as caught:
            check_completion(body(True, logit_bias={"11": value}), chat=True)
        assert caught.value.param == "logit_bias.11"


def test_chat_logprobs_is_a_boolean_and_token_ids_are_non_negative_int64() -> None:
    with pytest.raises(BodyError) as caught:
        check_completion(body(True, logprobs=3), chat=True)
    assert caught.value.param == "logprobs"
    assert check_completion(body(False, prompt=[0, INT64_MAX]), chat=False)
    for prompt in ([-1], [INT64_MAX + 1], [[1], [2**64]]):
        with pytest.raises(BodyError) as caught:
            check_completion(body(False, prompt=prompt), chat=False)
        assert caught.value.param == "prompt"


def test_fields_the_proxy_does_not_read_still_pass_through() -> None:
    extra = {"top_k": 10**30, "min_p": 5, "guided_json": {"type": "object"}, "echo": "yes"}
    assert check_completion(body(True, **extra), chat=True) == body(True, **extra)


def test_a_non_finite_number_anywhere_is_refused_by_its_path() -> None:
    raw = b'{"model": "m", "messages": [{"role": "user", "content": [{"x": NaN}]}]}'
    with pytest.raises(BodyError) as caught:
        parse_json(raw)
    assert caught.value.param == "messages.0.content.0.x"
    assert caught.value.message == "`messages.0.content.0.x`: NaN is not a JSON number."


def test_a_long_key_is_cut_in_the_fields_name() -> None:
    raw = json.dumps({"k" * 5000: {"a": 1}}).encode().replace(b"1}", b"Infinity}")
    with pytest.raises(BodyError) as caught:
        parse_json(raw)
    assert caught.value.param is not None and len(caught.value.param) == 200


def test_the_published_schema_carries_the_bounds() -> None:
    chat = ChatCompletionRequest.model_json_schema()["properties"]
    assert {"type": "number", "minimum": 0, "maximum": 2} in chat["temperature"]["anyOf"]
    assert {"type": "integer", "minimum": 0, "maximum": 20} in chat["top_logprobs"]["anyOf"]
    completions = CompletionRequest.model_json_schema()["properties"]
    assert {"type": "integer", "minimum": 0, "maximum": 5} in completions["logprobs"]["anyOf"]
    batch = BatchRequest.model_json_schema()["properties"]
    assert batch["completion_window"]["pattern"] == "^[1-9][0-9]{0,8}[hms]$"


# -- the Batch API ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("window", "seconds"),
    [
        ("24h", 86_400),
        ("1s", 1),
        ("90m", 5_400),
        ("8760h", MAX_WINDOW_S),
        ("31536000s", 31_536_000),
    ],
)
def test_completion_windows_within_a_year_are_taken(window: str, seconds: int) -> None:
    assert window_seconds(window) == seconds
    request = {"input_file_id": "file-1", "endpoint": CHAT, "completion_window": window}
    assert check_batch(request).completion_window == window


@pytest.mark.parametrize(
    "window",
    ["9999999999999999h", "8761h", "31536001s", "0h", "0024h", "24h\n", "\uff12\uff14h", "24",
     "24d", "-1h", "", 24, None],
)  # fmt: skip
def test_other_completion_windows_are_a_400_naming_the_field(window: Any) -> None:
    request = {"input_file_id": "file-1", "endpoint": CHAT, "completion_window": window}
    with pytest.raises(BodyError) as caught:
        check_batch(request)
    assert caught.value.param == "completion_window"


@pytest.mark.parametrize(
    ("change", "param"),
    [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"input_file_id": "file\x00x"}, "input_file_id"),
        ({"input_file_id": 7}, "input_file_id"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
    ],
)
def test_the_rest_of_a_batch_request_is_checked(change: Json, param: str) -> None:
    request = {"input_file_id": "file-1", "endpoint": CHAT, "completion_window": "24h", **change}
    with pytest.raises(BodyError) as caught:
        check_batch(request)
    assert caught.value.param == param


@pytest.mark.parametrize(
    ("query", "param"),
    [
        ({"limit": "0"}, "limit"),
        ({"limit": "10001"}, "limit"),
        ({"limit": "9" * 30}, "limit"),
        ({"limit": "\u00b2"}, "limit"),  # a digit to str.isdigit, not to int()
        ({"limit": "lots"}, "limit"),
        ({"after": "batch\x00"}, "after"),
        ({"after": "x" * 300}, "after"),
    ],
)
def test_list_queries_out_of_bounds_are_refused(query: dict[str, str], param: str) -> None:
    with pytest.raises(BodyError) as caught:
        check_page(query)
    assert caught.value.param == param


def test_list_queries_within_bounds() -> None:
    assert (check_page({}).after, check_page({}).limit) == (None, 20)
    page = check_page({"limit": "10000", "after": "batch_0f"})
    assert (page.after, page.limit) == ("batch_0f", 10_000)


# -- through the app --------------------------------------------------------------------


@pytest.mark.anyio
@pytest.mark.parametrize("route", [CHAT, COMPLETIONS, "/batch" + CHAT])
async def test_an_out_of_range_number_is_a_400_and_reaches_no_engine(route: str) -> None:
    engines = FakeEngines()
    chat = route.endswith(CHAT)
    async with running(engines.settings(), engines) as (client, _):
        refused = await client.post(route, json=body(chat, max_tokens=2**64))
        served = await client.post(route, json=body(chat, max_tokens=2**62, temperature=2))
    assert refused.status_code == 400
    assert refused.json()["error"]["param"] == "max_tokens"
    assert served.status_code == 200
    assert len(engines.seen(route.removeprefix("/batch"))) == 1  # the good one only


@pytest.mark.anyio
async def test_the_batch_routes_answer_400_where_they_gave_500(tmp_path: Path) -> None:
    """The window seen in the field (OverflowError in the store), and list queries."""
    engines = FakeEngines()
    config = engines.settings(batch_store_path=str(tmp_path / "b.db"))
    line = {"custom_id": "a", "method": "POST", "url": CHAT, "body": body(True)}
    async with running(config, engines) as (client, _):
        files = {"file": ("in.jsonl", json.dumps(line).encode() + b"\n")}
        uploaded = await client.post("/v1/files", files=files, data={"purpose": "batch"})
        create = {"input_file_id": uploaded.json()["id"], "endpoint": CHAT}
        huge = await client.post(
            "/v1/batches", json={**create, "completion_window": "9999999999999999h"}
        )
        nan = await client.post(
            "/v1/batches",
            content=json.dumps({**create, "completion_window": "24h"})[:-1] + ', "x": NaN}',
        )
        limit = await client.get("/v1/batches", params={"limit": "\u00b2"})
        after = await client.get("/v1/files", params={"after": "file\x00"})
        year = await client.post("/v1/batches", json={**create, "completion_window": "8760h"})
    assert huge.status_code == 400 and huge.json()["error"]["param"] == "completion_window"
    assert "8760h" in huge.json()["error"]["message"]
    assert nan.status_code == 400 and nan.json()["error"]["param"] == "x"
    assert limit.status_code == 400 and limit.json()["error"]["param"] == "limit"
    assert after.status_code == 400 and after.json()["error"]["param"] == "after"
    assert year.status_code == 200
    assert year.json()["expires_at"] - year.json()["created_at"] == MAX_WINDOW_S
