"""One replica's shared budget with a ledger that fails for a while
(proxy.replicas.SharedBudget): when the ledger counts as down, the local share of
each engine's budget batch keeps to meanwhile, and the way back.

The replica is a real admission and scheduler on a virtual clock; batch requests
are clients that wait for their turn and reserve as the edge does. The ledger is a
fake whose answers the test sets, and which fails while ``down`` is set.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import AsyncIterator, Mapping

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from proxy.admission import Admission
from proxy.api.turn import ledger_sentence, turn_body
from proxy.clock import VirtualClock
from proxy.config import BudgetConfig, EngineConfig
from proxy.metrics import LedgerCollector
from proxy.replicas import (
    LedgerError,
    LocalShare,
    Others,
    SharedBudget,
    Verdict,
    granted,
    local_share,
)
from proxy.scheduler import Job, ReplicaLoad, Reservation, Scheduler, TrafficClass

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(30)]

URL = "http://engine-a:8000"
BUDGET = 600
TIMEOUT_S = 1.0
LEASE_S = 3.0
_ids = itertools.count()


class FlakyLedger:
    """Another replica's load (``others``, ``replicas`` of them) on the one engine;
    every call raises :class:`LedgerError` while ``down`` is set, after taking
    ``slow_s`` of the virtual clock (a call that runs out its time)."""

    def __init__(self, clock: VirtualClock) -> None:
        self.clock = clock
        self.down = False
        self.slow_s = 0.0
        self.others = ReplicaLoad()
        self.replicas = 1
        self.published: list[dict[str, ReplicaLoad]] = []
        self.reserved: list[str] = []
        self.calls = 0

    def _call(self) -> None:
        self.calls += 1
        if self.down:
            self.clock.advance(self.slow_s)
            raise LedgerError("connection refused")

    async def open(self) -> None:
        pass

    async def close(self) -> None:
        pass

    async def publish(self, loads: Mapping[str, ReplicaLoad]) -> dict[str, Others]:
        self._call()
        self.published.append(dict(loads))
        return {URL: Others(self.others, self.replicas)}

    async def reserve(self, engine: str, reservation: Reservation) -> Verdict:
        self._call()
        ok = granted(reservation, self.others)
        if ok:
            self.reserved.append(reservation.job_id)
        return Verdict(ok, self.others)


class Replica:
    """An admission over one engine with a fixed budget, its shared budget on
    :class:`FlakyLedger`, and the batch requests it has sent (reserved)."""

    def __init__(self) -> None:
        self.clock = VirtualClock()
        budget = BudgetConfig(initial_tokens=BUDGET, min_tokens=BUDGET, max_tokens=BUDGET)
        config = EngineConfig(
            name="a", url=URL, models=frozenset({"m"}), budget=budget, batch_max_inflight=64
        )
        self.admission = Admission(Scheduler([config], self.clock))
        self.ledger = FlakyLedger(self.clock)
        self.shared = SharedBudget(
            self.ledger,
            self.admission,
            lambda name: URL if name == "a" else None,
            interval_s=5.0,  # real seconds: a request whose reservation failed waits past the test
            timeout_s=TIMEOUT_S,
            lease_s=LEASE_S,
            clock=self.clock.now,
        )
        self.sent: list[str] = []
        self.tokens: dict[str, int] = {}
        self.clients: list[asyncio.Task[None]] = []

    async def batch(self, tokens: int, count: int = 1) -> None:
        """``count`` batch requests of ``tokens`` prompt tokens each, waiting for
        their turn as the edge does; returns once every one has sent or waits."""
        for _ in range(count):
            job_id = f"b{next(_ids)}"
            self.tokens[job_id] = tokens
            self.clients.append(asyncio.create_task(self._client(job_id, tokens)))
        await settle()

    async def _client(self, job_id: str, tokens: int) -> None:
        job = Job(
            id=job_id, cls=TrafficClass.BATCH, model="m", prompt_tokens=tokens,
            arrival=self.clock.now(),
        )  # fmt: skip
        await self.admission.admit(job)
        while not await self.shared.reserve(job_id):
            await self.admission.readmit(job_id)
        self.sent.append(job_id)

    async def first_token(self, job_id: str) -> None:
        """The engine answered ``job_id``: its prompt left prefill."""
        self.admission.first_token(job_id)
        await self.shared.sync_once()
        await settle()

    def in_prefill(self) -> int:
        """This replica's batch prompt tokens in prefill, as it publishes them."""
        return self.admission.own_loads()["a"].batch_prefill_tokens

    async def down(self, fails: int = 3) -> None:
        self.ledger.down = True
        for _ in range(fails):
            await self.shared.sync_once()
        await settle()

    async def close(self) -> None:
        """Stop the requests still waiting; any client that failed fails the test."""
        for task in self.clients:
            task.cancel()
        results = await asyncio.gather(*self.clients, return_exceptions=True)
        errors = [r for r in results if not isinstance(r, (type(None), asyncio.CancelledError))]
        assert errors == []


async def settle() -> None:
    """Let every ready task run until nothing moves (real time stands still)."""
    for _ in range(50):
        await asyncio.sleep(0)


@pytest.fixture
async def replica() -> AsyncIterator[Replica]:
    r = Replica()
    r.ledger.replicas = 1  # one other replica: k = 2, a share of 300
    assert await r.shared.sync_once()
    yield r
    await r.close()


@pytest.mark.parametrize(
    ("budget", "replicas", "last", "share", "hold", "idle"),
    [
        (600, 1, None, 600, False, True),  # alone at the last look: the whole budget
        (600, 2, None, 300, False, True),
        (600, 3, None, 200, False, True),
        (600, 2, ReplicaLoad(0, False), 300, False, True),
        (600, 2, ReplicaLoad(400, False), 200, False, False),  # the others' load counts
        (600, 2, ReplicaLoad(900, True), 0, True, False),  # more than the budget: nothing
    ],
)
def test_the_local_share(
    budget: int, replicas: int, last: ReplicaLoad | None, share: int, hold: bool, idle: bool
) -> None:
    assert local_share(budget, replicas, last) == LocalShare(budget, share, hold, idle)


def test_what_the_local_share_grants() -> None:
    def res(tokens: int, in_prefill: int, beside: bool = False) -> Reservation:
        return Reservation("j", "a", tokens, in_prefill, 600, beside)

    share = LocalShare(600, 300, hold=False, others_idle=True)
    assert share.grants(res(100, 300)) and not share.grants(res(100, 301))
    assert share.grants(res(500, 500)), "a prompt larger than the share, alone"
    assert not LocalShare(600, 300, False, others_idle=False).grants(res(500, 500))
    held = LocalShare(600, 300, hold=True, others_idle=True)
    assert not held.grants(res(100, 100)) and held.grants(res(100, 100, beside=True))
    assert share.view(own_tokens=100) == ReplicaLoad(300, False)
    assert share.view(own_tokens=0) == ReplicaLoad(0, False)


async def test_three_fast_failures_in_a_row_put_the_ledger_down(
    replica: Replica, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "proxy.replicas._shared")
    replica.ledger.down = True
    for _ in range(2):
        assert not await replica.shared.sync_once()
    assert replica.shared.up, "two failures may be a blip"
    await replica.shared.sync_once()
    assert not replica.shared.up and replica.shared.outages == 1
    for _ in range(20):
        await replica.shared.sync_once()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, "one warning per outage"
    assert "connection refused" in warnings[0].getMessage()


async def test_one_call_that_runs_out_its_time_puts_it_down(replica: Replica) -> None:
    replica.ledger.down, replica.ledger.slow_s = True, TIMEOUT_S
    await replica.shared.sync_once()
    assert not replica.shared.up


async def test_a_blip_is_not_an_outage(replica: Replica) -> None:
    replica.ledger.down = True
    await replica.shared.sync_once()
    await replica.shared.sync_once()
    replica.ledger.down = False
    await replica.shared.sync_once()
    replica.ledger.down = True
    await replica.shared.sync_once()
    await replica.shared.sync_once()
    assert replica.shared.up and replica.shared.outages == 0


async def test_while_it_fails_but_is_not_down_no_batch_is_sent(replica: Replica) -> None:
    replica.ledger.down = True
    await replica.shared.sync_once()  # one failure: not down yet
    await replica.batch(100)
    assert replica.sent == []
    assert replica.shared.failures == 2  # the reservation failed too
    assert replica.shared.up


async def test_down_batch_keeps_to_its_share_of_the_budget(replica: Replica) -> None:
    await replica.down()
    calls = replica.ledger.calls
    await replica.batch(100, count=6)
    assert len(replica.sent) == 3 and replica.in_prefill() == 300, "B / k, k = 2"
    assert replica.ledger.calls == calls, "no reservation waited on the ledger"
    assert replica.shared.local_grants == 3
    await replica.first_token(replica.sent[0])
    assert len(replica.sent) == 4 and replica.in_prefill() == 300
    for job_id in list(replica.sent):
        await replica.first_token(job_id)
    assert len(replica.sent) == 6, "every request went, within the share"


async def test_three_replicas_leave_each_a_third(replica: Replica) -> None:
    replica.ledger.replicas = 2
    await replica.shared.sync_once()
    await replica.down()
    await replica.batch(100, count=4)
    assert replica.in_prefill() == 200


async def test_the_others_last_load_counts_until_the_lease_ends(replica: Replica) -> None:
    replica.ledger.others = ReplicaLoad(400, True)
    await replica.shared.sync_once()
    await replica.down()
    await replica.batch(100, count=4)
    assert replica.sent == [], "another replica's chat held the engine at the last look"
    replica.clock.advance(LEASE_S)
    await replica.shared.sync_once()  # fails; the lease is over: the share alone
    await settle()
    assert len(replica.sent) == 3 and replica.in_prefill() == 300


async def test_the_others_last_tokens_shrink_the_share(replica: Replica) -> None:
    replica.ledger.others = ReplicaLoad(400, False)
    await replica.shared.sync_once()
    await replica.down()
    await replica.batch(100, count=4)
    assert replica.in_prefill() == 200, "600 - 400"


async def test_a_prompt_larger_than_the_share_runs_alone(replica: Replica) -> None:
    await replica.down()
    await replica.batch(500)
    await replica.batch(100)
    assert len(replica.sent) == 1 and replica.in_prefill() == 500
    await replica.first_token(replica.sent[0])
    assert len(replica.sent) == 2 and replica.in_prefill() == 100


async def test_it_rejoins_when_the_ledger_answers(
    replica: Replica, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "proxy.replicas._shared")
    await replica.down()
    await replica.batch(100, count=2)
    assert replica.shared.local_grants == 2
    replica.clock.advance(7.0)
    replica.ledger.down = False
    assert await replica.shared.sync_once()
    assert replica.shared.up and replica.shared.outages == 1
    assert replica.ledger.published[-1] == {URL: ReplicaLoad(200, False)}, (
        "what it reserved locally is in the ledger"
    )
    back = [r.getMessage() for r in caplog.records if "back after" in r.getMessage()]
    assert len(back) == 1 and "back after 7.0 s" in back[0]
    await replica.batch(100)
    assert replica.ledger.reserved == [replica.sent[-1]], "reserved through the ledger again"
    assert replica.shared.local_grants == 2


async def test_the_outage_on_turn_and_metrics(replica: Replica) -> None:
    registry = CollectorRegistry()
    registry.register(LedgerCollector(replica.shared))

    def metric(name: str) -> float:
        text = generate_latest(registry).decode()
        return next(float(x.split()[1]) for x in text.splitlines() if x.startswith(name + " "))

    assert metric("whoseturn_ledger_up") == 1.0
    assert turn_body(replica.admission, ledger=replica.shared.report())["ledger"]["up"] is True
    await replica.down()
    await replica.batch(100)
    replica.clock.advance(2.5)
    assert metric("whoseturn_ledger_up") == 0.0
    assert metric("whoseturn_ledger_outages_total") == 1.0
    assert metric("whoseturn_ledger_local_reservations_total") == 1.0
    ledger = turn_body(replica.admission, ledger=replica.shared.report())["ledger"]
    assert ledger["up"] is False and ledger["down_for_s"] == pytest.approx(2.5)
    assert "connection refused" in ledger["cause"] and ledger["down_since"]
    assert ledger["engines"] == {"a": {"replicas": 2, "local_share_tokens": 300}}
    assert ledger_sentence(ledger).startswith("shared ledger: DOWN for 2.5 s")
    replica.ledger.down = False
    await replica.shared.sync_once()
    assert metric("whoseturn_ledger_up") == 1.0


async def test_back_it_counts_a_replica_not_back_yet_for_one_lease(replica: Replica) -> None:
    """The other replica's rows aged out during the outage; it is likely still on its
    local share: for a lease after the ledger answers, that share stays counted."""
    await replica.down()
    replica.ledger.down, replica.ledger.replicas = False, 0
    assert await replica.shared.sync_once()
    await replica.batch(100, count=6)
    assert replica.in_prefill() == 300, "the absent replica's share still counts"
    assert replica.ledger.reserved, "through the ledger"
    replica.clock.advance(LEASE_S)
    await replica.shared.sync_once()
    await settle()
    assert replica.in_prefill() == 600, "after the lease it is gone: the whole budget"


async def test_back_a_replica_that_is_back_counts_as_the_ledger_says(replica: Replica) -> None:
    await replica.down()
    replica.ledger.down, replica.ledger.others = False, ReplicaLoad(100, False)
    assert await replica.shared.sync_once()
    await replica.batch(100, count=6)
    assert replica.in_prefill() == 500
