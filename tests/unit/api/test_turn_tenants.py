"""Tenants as ``/turn``, ``/turn/log``, ``/metrics`` and ``/status`` show them.

A scripted scheduler (virtual time, no engine): two tenants of weights 1 and 3 each
get one chat answered, then queue one more, so both waited and the interactive
fairness index is judged; one tenant also queues a batch line. ``/turn`` gives each
class's tenants by name with what they were served against what they are owed, and
the index (null where fewer than two tenants waited); each decision in ``/turn/log``
names its tenant; the metrics label a tenant by its name only where the config names
it, and sum every other tenant into ``other``.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from fastapi import FastAPI
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from proxy.admission import Admission
from proxy.api.status import install_status_route
from proxy.api.turn import fairness_words, install_turn_routes
from proxy.clock import VirtualClock
from proxy.config import EngineConfig
from proxy.metrics import ProxyMetrics
from proxy.scheduler import Job, Scheduler, TrafficClass

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

CHAT, BATCH = TrafficClass.INTERACTIVE, TrafficClass.BATCH
WEIGHTS = {"team-a": 1.0, "team-b": 3.0}
ANSWERS = {"team-a": 50, "team-b": 250}  # output tokens of each tenant's first chat
PROMPT = 100


def job(scheduler: Scheduler, id: str, tenant: str, cls: TrafficClass = CHAT) -> Job:
    return Job(
        id=id,
        cls=cls,
        model="m",
        prompt_tokens=PROMPT,
        arrival=scheduler.clock.now(),
        tenant=tenant,
        flow="batch_1" if cls is BATCH else "",
        weight=WEIGHTS.get(tenant, 1.0),
    )


def scripted(*others: str) -> Scheduler:
    """team-a and team-b each served one chat (prompt 100; answers 50 and 250
    tokens: 150 and 350 served, shares 0.3 and 0.7, owed 0.25 and 0.75), then each
    queue one more chat; team-a queues a batch line too; ``others`` (weight 1) each
    queue a chat."""
    clock = VirtualClock()
    engine = EngineConfig(name="e0", models=frozenset({"m"}))
    scheduler = Scheduler([engine], clock)
    for tenant in WEIGHTS:
        scheduler.submit(job(scheduler, f"{tenant}-1", tenant))
    assert {d.job.id for d in scheduler.dispatch()} == {"team-a-1", "team-b-1"}
    clock.advance(0.1)
    for tenant, output in ANSWERS.items():
        scheduler.on_first_token(f"{tenant}-1")
        scheduler.on_finished(f"{tenant}-1", output)
    clock.advance(0.1)
    for tenant in (*WEIGHTS, *others):
        scheduler.submit(job(scheduler, f"{tenant}-2", tenant))
    scheduler.submit(job(scheduler, "batch_1-line-0", "team-a", BATCH))
    return scheduler


def jain(xs: list[float]) -> float:
    return sum(xs) ** 2 / (len(xs) * sum(x * x for x in xs))


@pytest.fixture
def scheduler() -> Scheduler:
    return scripted()


@pytest.fixture
async def client(scheduler: Scheduler) -> AsyncIterator[httpx.AsyncClient]:
    app = FastAPI()
    admission = Admission(scheduler)
    install_turn_routes(app, lambda _: admission)
    install_status_route(app)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as c:
        yield c


async def test_turn_gives_each_class_its_tenants_and_fairness(
    client: httpx.AsyncClient,
) -> None:
    body = (await client.get("/turn")).json()
    chat = {t["tenant"]: t for t in body["tenants"]["interactive"]}
    assert set(chat) == {"team-a", "team-b"}
    a, b = chat["team-a"], chat["team-b"]
    assert (a["weight"], a["tier"], a["queued"], a["in_flight"]) == (1.0, "standard", 1, 0)
    assert (b["weight"], b["tier"], b["queued"], b["in_flight"]) == (3.0, "standard", 1, 0)
    assert (a["tokens"], b["tokens"]) == (PROMPT + 50, PROMPT + 250)
    assert (a["share"], b["share"]) == pytest.approx((0.3, 0.7))
    assert (a["owed"], b["owed"]) == pytest.approx((0.25, 0.75))
    # both waited (each has a chat queued): Jain's index of tokens over weight
    assert body["fairness"]["interactive"] == pytest.approx(jain([150 / 1, 350 / 3]))
    (line,) = body["tenants"]["batch"]
    assert (line["tenant"], line["queued"], line["tokens"]) == ("team-a", 1, 0)
    assert body["fairness"]["batch"] is None  # one tenant alone is not judged
    assert body["fairness_window_s"] == 60


async def test_turn_text_says_share_against_owed_and_the_verdict(
    client: httpx.AsyncClient,
) -> None:
    text = (await client.get("/turn?format=text")).text
    lines = text.splitlines()
    index = jain([150 / 1, 350 / 3])
    assert (
        f"interactive tenants, last 60 s: fairness {index:.2f}, nearly fair — "
        "team-b 70% of tokens (owed 75%; 1 queued, 0 in flight); "
        "team-a 30% of tokens (owed 25%; 1 queued, 0 in flight)"
    ) in lines
    assert (
        "batch tenants, last 60 s: fairness n/a — team-a 0% of tokens (owed 100%; "
        "1 queued, 0 in flight); not judged: fewer than two tenants waited"
    ) in lines


def test_the_verdicts_are_drawn_close_to_one() -> None:
    # two tenants, one served twice its part over the other: Jain's index 0.9
    assert jain([2.0, 1.0]) == pytest.approx(0.9)
    assert fairness_words(1.0) == "fair"
    assert fairness_words(jain([1.1, 1.0])) == "fair"
    assert fairness_words(jain([1.5, 1.0])) == "nearly fair"
    assert fairness_words(jain([2.2, 1.0])) == "unfair"
    assert fairness_words(None).startswith("not judged")


async def test_no_tenant_active_gives_empty_sections() -> None:
    engine = EngineConfig(name="e0", models=frozenset({"m"}))
    admission = Admission(Scheduler([engine], VirtualClock()))
    app = FastAPI()
    install_turn_routes(app, lambda _: admission)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://proxy"
    ) as c:
        body = (await c.get("/turn")).json()
        text = (await c.get("/turn?format=text")).text
    assert body["tenants"] == {"interactive": [], "batch": []}
    assert body["fairness"] == {"interactive": None, "batch": None}
    assert "tenants" not in text


async def test_turn_log_names_each_decisions_tenant(client: httpx.AsyncClient) -> None:
    decisions = (await client.get("/turn/log")).json()["decisions"]
    admitted = {d["request_id"]: d["tenant"] for d in decisions if d["admitted"]}
    assert admitted == {"team-a-1": "team-a", "team-b-1": "team-b"}


# -- metrics --------------------------------------------------------------------------


def samples(metrics: ProxyMetrics) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Each family's samples (name as exposed) with their labels, from ``/metrics``."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(generate_latest(metrics.registry).decode()):
        for s in family.samples:
            out.setdefault(s.name, []).append((s.labels, s.value))
    return out


def by(
    found: dict[str, list[tuple[dict[str, str], float]]], name: str, **match: str
) -> dict[str, float]:
    """tenant -> value of ``name``'s samples whose labels include ``match``."""
    return {
        labels["tenant"]: value
        for labels, value in found.get(name, [])
        if all(labels.get(k) == v for k, v in match.items())
    }


def test_metrics_label_a_configured_tenant_by_name_and_every_other_as_other() -> None:
    """team-a is named in the config; team-b, a key's hash and the anonymous tenant
    are not, so they share ``other``, whose gauges are their sums."""
    scheduler = scripted("key-0badf00d")
    metrics = ProxyMetrics(scheduler, 0.3, tenant_names=("team-a",))
    tenants = metrics.tenants
    assert [tenants.label(t) for t in ("team-a", "team-b", "key-0badf00d", "")] == [
        "team-a",
        "other",
        "other",
        "other",
    ]
    tenants.request("team-a", CHAT, waited_s=0.02, ttft_s=0.05)
    tenants.request("team-b", CHAT, waited_s=0.5, ttft_s=0.8)
    tenants.request("key-0badf00d", CHAT, waited_s=0.1, ttft_s=None)  # no first token
    tenants.request("", BATCH, waited_s=3.0, ttft_s=4.0)
    tenants.tokens("team-b", CHAT, 100, 250)
    tenants.tokens("key-0badf00d", CHAT, 40, 0)
    tenants.limited("key-0badf00d", "tokens_per_minute")
    found = samples(metrics)

    names = {
        labels["tenant"] for family in found.values() for labels, _ in family if "tenant" in labels
    }
    assert names == {"team-a", "other"}
    chat = {"class": "interactive"}
    assert by(found, "whoseturn_tenant_requests_total", **chat) == {"team-a": 1, "other": 2}
    assert by(found, "whoseturn_tenant_requests_total", **{"class": "batch"}) == {
        "team-a": 0,
        "other": 1,
    }
    assert by(found, "whoseturn_tenant_wait_seconds_count", **chat) == {"team-a": 1, "other": 2}
    assert by(found, "whoseturn_tenant_ttft_seconds_count", **chat) == {"team-a": 1, "other": 1}
    assert by(found, "whoseturn_tenant_ttft_seconds_sum", **chat) == pytest.approx(
        {"team-a": 0.05, "other": 0.8}
    )
    assert by(found, "whoseturn_tenant_tokens_total", kind="prompt", **chat) == {
        "team-a": 0,
        "other": 140,
    }
    assert by(found, "whoseturn_tenant_tokens_total", kind="completion", **chat) == {
        "team-a": 0,
        "other": 250,
    }
    assert by(found, "whoseturn_tenant_limited_total", limit="tokens_per_minute") == {
        "team-a": 0,
        "other": 1,
    }

    # read from the scheduler: team-b and key-0badf00d summed into other (weights 3 + 1
    # of 5 owed; team-b's 350 of 500 tokens served)
    assert by(found, "whoseturn_tenant_queued", **chat) == {"team-a": 1, "other": 2}
    assert by(found, "whoseturn_tenant_in_flight", **chat) == {"team-a": 0, "other": 0}
    assert by(found, "whoseturn_tenant_share", **chat) == pytest.approx(
        {"team-a": 0.3, "other": 0.7}
    )
    assert by(found, "whoseturn_tenant_owed_share", **chat) == pytest.approx(
        {"team-a": 0.2, "other": 0.8}
    )
    assert by(found, "whoseturn_tenant_queued", **{"class": "batch"}) == {"team-a": 1}
    index = {labels["class"]: v for labels, v in found["whoseturn_fairness_index"]}
    assert index == pytest.approx({"interactive": jain([150 / 1, 350 / 3, 0 / 1])})


def test_without_tenants_the_gauges_and_the_index_are_absent() -> None:
    engine = EngineConfig(name="e0", models=frozenset({"m"}))
    metrics = ProxyMetrics(Scheduler([engine], VirtualClock()), 0.3)
    found = samples(metrics)
    for name in (
        "whoseturn_tenant_queued",
        "whoseturn_tenant_in_flight",
        "whoseturn_tenant_share",
        "whoseturn_tenant_owed_share",
        "whoseturn_fairness_index",
    ):
        assert name not in found
    # the counters start at zero for the one label a tenant can have without a config
    assert by(found, "whoseturn_tenant_requests_total", **{"class": "interactive"}) == {"other": 0}


# -- the status page ------------------------------------------------------------------


async def test_status_page_has_a_tenants_panel_and_a_tenant_column(
    client: httpx.AsyncClient,
) -> None:
    """The page is static: the panel (hidden until the page's poll of ``/turn``
    finds an active tenant) and the decisions table's tenant column are in what it
    serves; tests/browser/test_status_tenants.py draws them in Chromium."""
    page = (await client.get("/status")).text
    assert '<section class="panel" id="tenants" hidden>' in page
    assert "<th>class</th><th>tenant</th><th>decision</th>" in page
    for hook in ("body.tenants", "body.fairness", "renderTenants(body)", "d.tenant"):
        assert hook in page
