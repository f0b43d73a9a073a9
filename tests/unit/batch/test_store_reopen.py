"""A line once recorded is never handed out again by ``claim``, however the store was
closed and opened again: after a clean close, and after one that left its leases
behind as a crash does. On both backends (a SQLite file; a real PostgreSQL
database per test)."""

from __future__ import annotations

import io
import json
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import anyio
import pytest

from proxy.batch.lines import read_lines
from proxy.batch.postgres import PostgresStore
from proxy.batch.sqlite import SQLiteStore
from proxy.batch.store import BatchStore, LineResult, NewBatch

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.integration)]
LEASE_S = 0.2
Opener = Callable[[], BatchStore]


@pytest.fixture(params=BACKENDS)
def opener(request: pytest.FixtureRequest, tmp_path: Path) -> Opener:
    """Makes a new store on the same file or database each time it is called."""
    if request.param == "sqlite":
        return lambda: SQLiteStore(tmp_path / "b.db", lambda: 1000.0)
    dsn = request.getfixturevalue("postgres_db")
    return lambda: PostgresStore(dsn, lambda: 1000.0, pool_size=2)


@asynccontextmanager
async def opened(opener: Opener) -> AsyncIterator[BatchStore]:
    store = opener()
    await store.open()
    try:
        yield store
    finally:
        await store.close()


async def new_job(store: BatchStore, n: int) -> None:
    body = {"model": "tiny", "messages": [{"role": "user", "content": "x"}]}
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": CHAT, "body": body} for i in range(n)]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    await store.add_batch(NewBatch("batch_1", CHAT, "file-x", "24h", 86400, None))
    await store.fill_batch("batch_1", read_lines(io.BytesIO(data), CHAT, 1000))


async def claim_all(store: BatchStore, owner: str) -> list[int]:
    """Every line ``claim`` hands ``owner``, two at a time, until it hands none."""
    got: list[int] = []
    while page := await store.claim("batch_1", owner, 2, LEASE_S):
        got.extend(p.idx for p in page)
    return got


async def test_a_recorded_line_is_never_claimed_again_after_a_reopen(opener: Opener) -> None:
    async with opened(opener) as store:
        await new_job(store, 6)
        assert await claim_all(store, "first") == [1, 2, 3, 4, 5, 6]
        assert await store.record("batch_1", 2, LineResult(True, "ok 2"))
        assert await store.record("batch_1", 5, LineResult(False, "failed 5"))
        # Closed with the other lines still leased to "first": as a crash leaves them.
    async with opened(opener) as store:
        await anyio.sleep(2 * LEASE_S)  # the dead owner's leases lapse (PostgreSQL's last)
        assert await claim_all(store, "second") == [1, 3, 4, 6]
        assert await store.record("batch_1", 1, LineResult(True, "ok 1"))
        assert await store.record("batch_1", 6, LineResult(True, "ok 6"))
        assert await store.release("batch_1", "second") == 2  # 3 and 4: a clean stop
    async with opened(opener) as store:
        assert await claim_all(store, "third") == [3, 4]
        await anyio.sleep(2 * LEASE_S)  # "third" never renews: its leases lapse too
        assert await claim_all(store, "fourth") == [3, 4]
        for idx in (3, 4):
            assert await store.record("batch_1", idx, LineResult(True, f"ok {idx}"))
    async with opened(opener) as store:
        await anyio.sleep(2 * LEASE_S)
        assert await store.claim("batch_1", "fifth", 10, LEASE_S) == []
        batch = await store.get_batch("batch_1")
        assert batch is not None and (batch.completed, batch.failed) == (5, 1)
