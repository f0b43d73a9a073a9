"""Every proxied response carries ``X-Request-Id``; a sane id the client sent is
kept, anything else is replaced by a new one; and the decisions in ``/turn/log``
name the request by that same id."""

from __future__ import annotations

import anyio
import httpx
import pytest

from proxy.api.request_ids import sane_request_id

from .helpers import (
    CHAT,
    COMPLETIONS,
    MESSAGES,
    Call,
    FakeEngines,
    completion_events,
    running,
    stream_response,
)

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]
CHAT_BODY = {"model": "m", "messages": MESSAGES}


def logged_ids(log: httpx.Response) -> set[str]:
    return {d["request_id"] for d in log.json()["decisions"]}


@pytest.mark.parametrize("stream", [False, True])
async def test_a_response_carries_its_id_and_the_log_uses_it(stream: bool) -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        response = await client.post(CHAT, json={**CHAT_BODY, "stream": stream})
        log = await client.get("/turn/log")
    assert response.status_code == 200
    rid = response.headers["x-request-id"]
    assert rid.startswith("wt-") and logged_ids(log) == {rid}


async def test_a_sane_client_id_is_kept_end_to_end() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        headers = {"X-Request-Id": "order-42.retry:1"}
        response = await client.post(CHAT, json=CHAT_BODY, headers=headers)
        log = await client.get("/turn/log")
    assert response.headers["x-request-id"] == "order-42.retry:1"
    assert logged_ids(log) == {"order-42.retry:1"}


@pytest.mark.parametrize("bad", ["", " spaces ", "x" * 129, "-leading", "semi;colon", "ünï"])
async def test_an_insane_client_id_is_replaced(bad: str) -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        headers = {"X-Request-Id": bad.encode()}
        response = await client.post(CHAT, json=CHAT_BODY, headers=headers)
        log = await client.get("/turn/log")
    rid = response.headers["x-request-id"]
    assert rid != bad and rid.startswith("wt-") and logged_ids(log) == {rid}


async def test_an_id_in_use_by_a_request_in_flight_is_replaced() -> None:
    engines = FakeEngines()
    release = anyio.Event()
    arrived = [anyio.Event(), anyio.Event()]

    async def slow(call: Call) -> httpx.Response:
        arrived[len(engines.seen(COMPLETIONS)) - 1].set()
        await release.wait()
        return stream_response(completion_events())

    engines.generate = slow
    headers = {"X-Request-Id": "same"}
    body = {"model": "m", "prompt": "hi"}
    async with running(engines.settings(), engines) as (client, _):
        responses: list[httpx.Response] = []

        async def post() -> None:
            responses.append(await client.post(COMPLETIONS, json=body, headers=headers))

        async with anyio.create_task_group() as group:
            group.start_soon(post)
            with anyio.fail_after(5):
                await arrived[0].wait()
            group.start_soon(post)
            with anyio.fail_after(5):
                await arrived[1].wait()
            release.set()
        log = await client.get("/turn/log")
    ids = sorted(r.headers["x-request-id"] for r in responses)
    assert [r.status_code for r in responses] == [200, 200]
    assert "same" in ids and len(set(ids)) == 2
    assert logged_ids(log) == set(ids)


async def test_errors_and_reads_carry_an_id_too() -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines) as (client, _):
        unknown = await client.post(CHAT, json={**CHAT_BODY, "model": "nope"})
        turn = await client.get("/turn", headers={"X-Request-Id": "probe-1"})
    assert unknown.status_code == 404 and unknown.headers["x-request-id"].startswith("wt-")
    assert turn.headers["x-request-id"] == "probe-1"


def test_sane_request_ids() -> None:
    assert sane_request_id("abc-123") == "abc-123"
    assert sane_request_id("a" * 128) == "a" * 128
    for bad in (None, "", "a" * 129, "a b", "<script>", "-x", "a\r\nb"):
        assert sane_request_id(bad) is None
