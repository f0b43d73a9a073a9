"""The shared ledger in a SQLite file, as the worker processes of one box use it (one
connection each): each replica sees the others' sum, a reservation counts them and
writes its own, reservations at once never pass the budget together, a dead
replica's rows stop counting after the lease, and a file that cannot be written or
stays locked is a LedgerError within the time limit."""

from __future__ import annotations

import asyncio
import sqlite3
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from proxy.replicas import LedgerError, Others
from proxy.replicas.sqlite import SQLiteLedger
from proxy.scheduler import ReplicaLoad, Reservation

pytestmark = [pytest.mark.anyio, pytest.mark.timeout(60)]

ENGINE = "http://10.0.0.1:8000"


def reservation(tokens: int, in_prefill: int, budget: int = 1000) -> Reservation:
    return Reservation("j", "a", tokens, in_prefill, budget, beside_interactive=False)


@pytest.fixture
async def pair(tmp_path: Path) -> AsyncIterator[tuple[SQLiteLedger, SQLiteLedger]]:
    a = SQLiteLedger(tmp_path / "ledger.sqlite3", "a", lease_s=3.0)
    b = SQLiteLedger(tmp_path / "ledger.sqlite3", "b", lease_s=3.0)
    await a.open()
    await b.open()
    yield a, b
    await a.close()
    await b.close()


async def test_each_replica_sees_the_sum_of_the_others(
    pair: tuple[SQLiteLedger, SQLiteLedger], tmp_path: Path
) -> None:
    a, b = pair
    c = SQLiteLedger(tmp_path / "ledger.sqlite3", "c", lease_s=3.0)
    await c.open()
    await b.publish({ENGINE: ReplicaLoad(300, False)})
    await c.publish({ENGINE: ReplicaLoad(200, True), "http://other:1": ReplicaLoad(5, False)})
    seen = await a.publish({ENGINE: ReplicaLoad(100, False)})
    assert seen == {
        ENGINE: Others(ReplicaLoad(500, True), replicas=2),
        "http://other:1": Others(ReplicaLoad(5, False), replicas=1),
    }
    await c.close()
    assert (await a.publish({}))[ENGINE] == Others(ReplicaLoad(300, False), 1), "c's rows left"


async def test_a_reservation_counts_the_others_and_writes_its_own(
    pair: tuple[SQLiteLedger, SQLiteLedger],
) -> None:
    a, b = pair
    await b.publish({ENGINE: ReplicaLoad(600, False)})
    refused = await a.reserve(ENGINE, reservation(500, in_prefill=500))
    assert not refused.granted and refused.others == ReplicaLoad(600, False)
    assert (await b.publish({ENGINE: ReplicaLoad(600, False)}))[ENGINE].load == ReplicaLoad()
    assert (await a.reserve(ENGINE, reservation(400, in_prefill=400))).granted
    seen = await b.publish({ENGINE: ReplicaLoad(600, False)})
    assert seen[ENGINE].load.batch_prefill_tokens == 400


async def test_a_hold_for_interactive_refuses_batch(
    pair: tuple[SQLiteLedger, SQLiteLedger],
) -> None:
    a, b = pair
    await b.publish({ENGINE: ReplicaLoad(0, True)})
    assert not (await a.reserve(ENGINE, reservation(10, in_prefill=10))).granted


async def test_reservations_at_once_never_pass_the_budget_together(tmp_path: Path) -> None:
    """Eight replicas (eight connections, each call on its own thread) reserve at
    once, each job alone within the budget; the file's write lock lets the sum
    through only as far as the budget."""
    path = tmp_path / "ledger.sqlite3"
    ledgers = [SQLiteLedger(path, f"r{i}", lease_s=3.0) for i in range(8)]
    for ledger in ledgers:
        await ledger.open()
        await ledger.publish({ENGINE: ReplicaLoad(0, False)})
    for _ in range(5):
        for ledger in ledgers:
            await ledger.publish({ENGINE: ReplicaLoad(10, False)})
        verdicts = await asyncio.gather(
            *(x.reserve(ENGINE, reservation(290, in_prefill=300)) for x in ledgers)
        )
        # each holds 10 and asks for 290 more: one after the other, exactly 3 fit in 1,000
        assert sum(v.granted for v in verdicts) == 3, [v.granted for v in verdicts]
    for ledger in ledgers:
        await ledger.close()


async def test_a_dead_replicas_rows_stop_counting_after_the_lease(tmp_path: Path) -> None:
    path = tmp_path / "ledger.sqlite3"
    a = SQLiteLedger(path, "a", lease_s=0.5)
    dead = SQLiteLedger(path, "dead", lease_s=0.5)
    await a.open()
    await dead.open()
    await dead.publish({ENGINE: ReplicaLoad(900, True)})  # then dies without closing
    assert not (await a.reserve(ENGINE, reservation(200, in_prefill=200))).granted
    await asyncio.sleep(0.7)
    verdict = await a.reserve(ENGINE, reservation(200, in_prefill=200))
    assert verdict.granted and verdict.others == ReplicaLoad()
    await a.close()


async def test_a_file_that_cannot_be_made_is_a_ledger_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    ledger = SQLiteLedger(tmp_path / "file" / "ledger.sqlite3", "a", lease_s=3.0)
    with pytest.raises(LedgerError, match="cannot open the ledger"):
        await ledger.open()


async def test_a_file_locked_by_another_is_a_ledger_error_within_the_limit(
    tmp_path: Path,
) -> None:
    """Another process holds the write lock and never lets go: the reservation gives
    up within its time limit (SQLite's busy timeout), and answers again once the
    lock is gone."""
    path = tmp_path / "ledger.sqlite3"
    ledger = SQLiteLedger(path, "a", lease_s=3.0, timeout_s=0.3)
    await ledger.open()
    locked, release = threading.Event(), threading.Event()

    def hold() -> None:
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("BEGIN IMMEDIATE")
        locked.set()
        release.wait(10)
        db.execute("ROLLBACK")
        db.close()

    holder = threading.Thread(target=hold)
    holder.start()
    locked.wait(5)
    started = asyncio.get_running_loop().time()
    with pytest.raises(LedgerError):
        await ledger.reserve(ENGINE, reservation(10, in_prefill=10))
    assert asyncio.get_running_loop().time() - started < 2.0
    release.set()
    holder.join()
    assert (await ledger.reserve(ENGINE, reservation(10, in_prefill=10))).granted
    await ledger.close()
