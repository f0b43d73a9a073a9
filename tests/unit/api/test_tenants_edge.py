"""Tenants at the HTTP edge: the Batch API behind the batch class, 429 with
Retry-After for a tenant over its limits, a tenant for every caller with no config
(by key, else by address), its tier in the engine's ``priority``, and its requests
(batch lines too) counted against its limits from start to end."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from proxy.clock import VirtualClock
from proxy.config import ApiKey, Settings, TenantLimits, key_tenant_name
from proxy.openai.request import describe
from proxy.scheduler import Job, TrafficClass
from proxy.server import ProxyState, create_app

from .helpers import CHAT, MESSAGES, Call, FakeEngines

pytestmark = pytest.mark.anyio

BODY = {"model": "m", "messages": MESSAGES}


def bearer(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@asynccontextmanager
async def running(
    settings: Settings,
    engines: FakeEngines,
    clock: VirtualClock | None = None,
    client: tuple[str, int] = ("127.0.0.1", 123),
) -> AsyncIterator[tuple[httpx.AsyncClient, ProxyState]]:
    """The proxy in front of ``engines`` over ``clock``, called from ``client``."""
    app: FastAPI = create_app(settings, transport=httpx.MockTransport(engines), clock=clock)
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app, client=client)
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as http:
            yield http, app.state.proxy


def admitted_jobs(state: ProxyState, monkeypatch: pytest.MonkeyPatch) -> list[Job]:
    """Every job the request path queues, as it queues it."""
    jobs: list[Job] = []
    admit = state.admission.admit

    async def spy(job: Job) -> Any:
        jobs.append(job)
        return await admit(job)

    monkeypatch.setattr(state.admission, "admit", spy)
    return jobs


# -- the Batch API behind the batch class ------------------------------------------------

CHAT_ONLY, BOTH = "sk-chat-only", "sk-both"
BATCH_ROUTES = [
    ("POST", "/batch" + CHAT),
    ("GET", "/batch/v1/models"),
    ("GET", "/v1/batches"),
    ("POST", "/v1/batches"),
    ("GET", "/v1/batches/batch_x"),
    ("POST", "/v1/batches/batch_x/cancel"),
    ("GET", "/v1/files"),
    ("POST", "/v1/files"),
    ("GET", "/v1/files/file-x/content"),
    ("DELETE", "/v1/files/file-x"),
]


async def test_a_key_without_the_batch_class_may_not_use_the_batch_api(tmp_path: Path) -> None:
    engines = FakeEngines()
    keys = (ApiKey(key=CHAT_ONLY, classes=("interactive",)), BOTH)
    settings = engines.settings(api_keys=keys, batch_store_path=str(tmp_path / "b.db"))
    async with running(settings, engines) as (client, _):
        for method, path in BATCH_ROUTES:
            body = BODY if path.endswith("completions") else None
            refused = await client.request(method, path, json=body, headers=bearer(CHAT_ONLY))
            assert refused.status_code == 403, (method, path, refused.text)
            error = refused.json()["error"]
            assert error["type"] == "permission_error"
            assert error["message"] == "This API key may not use the batch class."
            allowed = await client.request(method, path, json=body, headers=bearer(BOTH))
            assert allowed.status_code != 403, (method, path, allowed.text)
        chat = await client.post(CHAT, json=BODY, headers=bearer(CHAT_ONLY))
        assert chat.status_code == 200  # its own class still served
        assert (await client.get("/v1/models", headers=bearer(CHAT_ONLY))).status_code == 200


# -- limits: 429 with Retry-After ----------------------------------------------------------


def limited(**limits: int) -> ApiKey:
    return ApiKey(key="sk-team-a", tenant="team-a", limits=TenantLimits(**limits))


BATCH_CHAT = "/batch" + CHAT  # batch prompts are tokenized: each counts 4321 tokens here


async def test_over_its_tokens_per_minute_a_tenant_gets_429_and_when_to_retry() -> None:
    engines = FakeEngines()  # the engine's /tokenize counts engines.token_count (4321)
    clock = VirtualClock(100.0)
    settings = engines.settings(api_keys=(limited(tokens_per_minute=9000), "sk-b"))
    async with running(settings, engines, clock) as (client, state):
        first = await client.post(BATCH_CHAT, json=BODY, headers=bearer("sk-team-a"))
        assert first.status_code == 200
        clock.advance(20.5)
        second = await client.post(BATCH_CHAT, json=BODY, headers=bearer("sk-team-a"))
        assert second.status_code == 200  # 4324 (prompt and 3 completion) + 4321 < 9000
        clock.advance(5.0)
        refused = await client.post(BATCH_CHAT, json=BODY, headers=bearer("sk-team-a"))
        other = await client.post(BATCH_CHAT, json=BODY, headers=bearer("sk-b"))
        registry = state.metrics.registry
        count = registry.get_sample_value(
            "whoseturn_tenant_limited_total", {"tenant": "team-a", "limit": "tokens_per_minute"}
        )
    assert refused.status_code == 429
    # the first request's 4321 prompt tokens leave the window 60 s after it: 34.5 s on
    assert refused.headers["retry-after"] == "35"
    assert refused.json() == {
        "error": {
            "message": "Rate limit reached for tenant team-a: tokens_per_minute 9000 "
            "(used 8648); retry after 35 s",
            "type": "tokens",
            "param": None,
            "code": "rate_limit_exceeded",
        }
    }
    assert other.status_code == 200  # another tenant is not held back by it
    assert len(engines.seen(CHAT)) == 3  # the refused request never reached an engine
    assert count == 1


async def test_over_its_requests_per_minute_a_tenant_gets_429() -> None:
    engines = FakeEngines()
    clock = VirtualClock()
    settings = engines.settings(api_keys=(limited(requests_per_minute=1),))
    async with running(settings, engines, clock) as (client, _):
        assert (await client.post(CHAT, json=BODY, headers=bearer("sk-team-a"))).is_success
        clock.advance(59.5)
        refused = await client.post(CHAT, json=BODY, headers=bearer("sk-team-a"))
        clock.advance(0.5)
        again = await client.post(CHAT, json=BODY, headers=bearer("sk-team-a"))
    assert refused.status_code == 429
    assert refused.headers["retry-after"] == "1"  # 0.5 s: whole seconds, at least one
    assert refused.json()["error"]["type"] == "requests"
    assert "requests_per_minute 1 (used 1)" in refused.json()["error"]["message"]
    assert again.status_code == 200  # the window slid past the first


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("engine_status", [200, 400])
async def test_a_request_is_counted_from_its_start_to_its_end(
    stream: bool, engine_status: int
) -> None:
    """Whichever way it ends (an answer, a stream, an engine's refusal), the request
    leaves its tenant's streams, and its completion tokens stay in the window."""
    engines = FakeEngines()
    if engine_status != 200:
        engines.generate = lambda call: httpx.Response(engine_status, json={"error": {}})
    settings = engines.settings(api_keys=(limited(streams=1, tokens_per_minute=10**6),))
    async with running(settings, engines, VirtualClock()) as (client, state):
        body = {**BODY, "stream": stream}
        for _ in range(2):  # a stream left open would refuse the second
            response = await client.post(BATCH_CHAT, json=body, headers=bearer("sk-team-a"))
            assert response.status_code == engine_status, response.text
        meter = state.forwarder.services.meter
        assert meter is not None
        usage = meter.usage("team-a")
    assert usage.streams == 0 and usage.requests == 2
    assert usage.tokens == 2 * (4321 + (3 if engine_status == 200 else 0))


async def test_a_batch_line_counts_against_its_tenant_and_is_never_refused() -> None:
    engines = FakeEngines()
    key = limited(requests_per_minute=1)
    async with running(engines.settings(api_keys=(key,)), engines, VirtualClock()) as (_, state):
        tenant = state.settings.access.tenant("team-a")
        line = describe(BODY, CHAT, TrafficClass.BATCH, tenant=tenant, flow="batch_1")
        answers = [await state.forwarder.complete(line, f"line-{i}") for i in range(2)]
        meter = state.forwarder.services.meter
        assert meter is not None
        usage = meter.usage("team-a")
    assert [a.status for a in answers] == [200, 200]  # over its limit, but not refused
    assert (usage.requests, usage.streams, usage.tokens) == (2, 0, 2 * 4324)


# -- tenants with no config ----------------------------------------------------------------


async def test_with_no_keys_each_key_sent_and_each_address_is_a_tenant(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engines = FakeEngines()
    async with running(engines.settings(), engines, client=("10.1.2.3", 4000)) as (client, st):
        jobs = admitted_jobs(st, monkeypatch)
        await client.post(CHAT, json=BODY, headers=bearer("sk-anything"))
        await client.post(CHAT, json=BODY, headers=bearer("sk-else"))
        await client.post(CHAT, json=BODY)
    names = [j.tenant for j in jobs]
    assert names == [key_tenant_name("sk-anything"), key_tenant_name("sk-else"), "addr-10.1.2.3"]
    assert names[0].startswith("key-") and "sk-anything" not in names[0]
    assert all(j.weight == 1.0 and j.tier.value == "standard" for j in jobs)


async def test_a_job_carries_its_tenants_policy_and_expected_output(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engines = FakeEngines()
    key = ApiKey(key="sk-a", tenant="team-a", weight=3, tier="critical")
    async with running(engines.settings(api_keys=(key,)), engines) as (client, state):
        jobs = admitted_jobs(state, monkeypatch)
        finished: list[tuple[str, int | None]] = []
        finish = state.admission.finished

        def spy(job_id: str, output_tokens: int | None = None) -> None:
            finished.append((job_id, output_tokens))
            finish(job_id, output_tokens)

        monkeypatch.setattr(state.admission, "finished", spy)
        await client.post(CHAT, json={**BODY, "max_tokens": 64}, headers=bearer("sk-a"))
        await client.post(CHAT, json={**BODY, "max_completion_tokens": 32}, headers=bearer("sk-a"))
        await client.post(CHAT, json=BODY, headers=bearer("sk-a"))
    assert [(j.tenant, j.weight, j.tier.value, j.flow) for j in jobs] == [
        ("team-a", 3.0, "critical", "")
    ] * 3
    assert [j.expected_output for j in jobs] == [64, 32, 0]
    assert [tokens for _, tokens in finished] == [3, 3, 3]  # the engine's completion_tokens


# -- the tier in the engine's priority -----------------------------------------------------


@pytest.mark.parametrize(
    ("tier", "path", "priority"),
    [
        ("critical", CHAT, -11),
        ("standard", CHAT, -10),
        ("sheddable", CHAT, -9),
        ("critical", "/batch" + CHAT, -1),
        ("sheddable", "/batch" + CHAT, 1),
    ],
)
async def test_the_tier_moves_the_priority_under_the_priority_policy(
    tier: str, path: str, priority: int
) -> None:
    engines = FakeEngines()
    config = engines.config("a", scheduling_policy="priority")
    key = ApiKey(key="sk-t", tenant="t", tier=tier)
    settings = engines.settings(engines=(config,), api_keys=(key,))
    async with running(settings, engines) as (client, _):
        response = await client.post(path, json={**BODY, "priority": 99}, headers=bearer("sk-t"))
    assert response.status_code == 200, response.text
    (call,) = engines.seen(CHAT)
    assert call.body["priority"] == priority  # the proxy's, not the client's 99


async def test_no_priority_is_sent_under_fcfs() -> None:
    engines = FakeEngines()
    key = ApiKey(key="sk-t", tenant="t", tier="critical")
    async with running(engines.settings(api_keys=(key,)), engines) as (client, _):
        await client.post(CHAT, json={**BODY, "priority": 5}, headers=bearer("sk-t"))
    calls: list[Call] = engines.seen(CHAT)
    assert "priority" not in calls[0].body
