"""The shared ledger on a real PostgreSQL: two replicas' rows, reservations under the
engine's lock, a dead replica's lease, failures as LedgerError, and a database that
stops answering (paused) or goes away and comes back (restarted)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest

from proxy.replicas import LedgerError, Others
from proxy.replicas.postgres import PostgresLedger
from proxy.scheduler import ReplicaLoad, Reservation
from tests.support.postgres import fresh_database, paused, postgres_cluster, start, stop
from tests.support.processes import closed_port_url

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

ENGINE = "http://10.0.0.1:8000"


def reservation(tokens: int, in_prefill: int, budget: int = 1000) -> Reservation:
    return Reservation("j", "a", tokens, in_prefill, budget, beside_interactive=False)


@pytest.fixture
async def pair(postgres_db: str) -> AsyncIterator[tuple[PostgresLedger, PostgresLedger]]:
    a = PostgresLedger(postgres_db, "a", lease_s=3.0)
    b = PostgresLedger(postgres_db, "b", lease_s=3.0)
    await a.open()
    await b.open()
    yield a, b
    await a.close()
    await b.close()


async def test_each_replica_sees_the_sum_of_the_others(
    pair: tuple[PostgresLedger, PostgresLedger], postgres_db: str
) -> None:
    a, b = pair
    c = PostgresLedger(postgres_db, "c", lease_s=3.0)
    await c.open()
    try:
        await b.publish({ENGINE: ReplicaLoad(300, False)})
        await c.publish({ENGINE: ReplicaLoad(200, True), "http://other:1": ReplicaLoad(5, False)})
        seen = await a.publish({ENGINE: ReplicaLoad(100, False)})
        assert seen == {
            ENGINE: Others(ReplicaLoad(500, True), replicas=2),
            "http://other:1": Others(ReplicaLoad(5, False), replicas=1),
        }
        assert (await b.publish({ENGINE: ReplicaLoad(300, False)}))[ENGINE] == Others(
            ReplicaLoad(300, True), replicas=2
        )
    finally:
        await c.close()
    seen = await a.publish({})
    assert seen[ENGINE] == Others(ReplicaLoad(300, False), 1), "c's rows left with it"


async def test_a_reservation_counts_the_others_and_writes_its_own(
    pair: tuple[PostgresLedger, PostgresLedger],
) -> None:
    a, b = pair
    await b.publish({ENGINE: ReplicaLoad(600, False)})
    refused = await a.reserve(ENGINE, reservation(500, in_prefill=500))
    assert not refused.granted and refused.others == ReplicaLoad(600, False)
    assert (await b.publish({ENGINE: ReplicaLoad(600, False)}))[ENGINE].load == ReplicaLoad()
    ok = await a.reserve(ENGINE, reservation(400, in_prefill=400))
    assert ok.granted
    seen = await b.publish({ENGINE: ReplicaLoad(600, False)})
    assert seen[ENGINE].load.batch_prefill_tokens == 400


async def test_concurrent_reservations_never_exceed_the_budget(
    pair: tuple[PostgresLedger, PostgresLedger],
) -> None:
    """Both replicas ask at once, each job alone within the budget; the engine's row
    lock lets the sum through only as far as the budget."""
    a, b = pair
    await a.publish({ENGINE: ReplicaLoad(10, False)})
    await b.publish({ENGINE: ReplicaLoad(10, False)})
    verdicts = await asyncio.gather(
        a.reserve(ENGINE, reservation(590, in_prefill=600)),
        b.reserve(ENGINE, reservation(590, in_prefill=600)),
    )
    assert sorted(v.granted for v in verdicts) == [False, True]


async def test_a_dead_replicas_rows_stop_counting_after_the_lease(postgres_db: str) -> None:
    a = PostgresLedger(postgres_db, "a", lease_s=0.5)
    dead = PostgresLedger(postgres_db, "dead", lease_s=0.5)
    await a.open()
    await dead.open()
    await dead.publish({ENGINE: ReplicaLoad(900, True)})
    # it dies without closing (its rows stay in the table)
    assert not (await a.reserve(ENGINE, reservation(200, in_prefill=200))).granted
    await asyncio.sleep(0.7)
    verdict = await a.reserve(ENGINE, reservation(200, in_prefill=200))
    assert verdict.granted and verdict.others == ReplicaLoad()
    await a.close()
    await dead.close()


async def test_an_unreachable_store_is_a_ledger_error() -> None:
    url = closed_port_url().replace("http://", "postgresql://x@")
    ledger = PostgresLedger(url + "/db?connect_timeout=1", "a", lease_s=3.0, timeout_s=0.5)
    with pytest.raises(LedgerError):
        await ledger.publish({ENGINE: ReplicaLoad()})


async def test_a_paused_database_times_out_and_one_back_answers_at_once() -> None:
    """Paused (SIGSTOP: connections open, nothing answers), each call gives up within
    its time limit, the stuck connection included; restarted, the next call
    reconnects at once (no back-off keeps the replica off the ledger)."""
    with postgres_cluster() as cluster:
        ledger = PostgresLedger(fresh_database(cluster.dsn()), "a", lease_s=3.0, timeout_s=0.3)
        await ledger.open()
        await ledger.publish({ENGINE: ReplicaLoad(1, False)})
        with paused(cluster):
            for _ in range(2):  # on the open connection, then on a new one
                started = time.monotonic()
                with pytest.raises(LedgerError, match="no answer within"):
                    await ledger.publish({ENGINE: ReplicaLoad(2, False)})
                assert time.monotonic() - started < 0.3 * 3
        assert await ledger.publish({ENGINE: ReplicaLoad(3, False)}) == {}
        stop(cluster)
        with pytest.raises(LedgerError):
            await ledger.publish({ENGINE: ReplicaLoad(4, False)})
        start(cluster)
        started = time.monotonic()
        assert await ledger.publish({ENGINE: ReplicaLoad(5, False)}) == {}
        assert time.monotonic() - started < 0.5
        await ledger.close()
