"""The shared ledger in PostgreSQL (``psycopg`` 3, a small pool of its own).

Two tables::

    whoseturn_ledger_engines (engine PRIMARY KEY)       one row per engine URL: the
                                                        lock a reservation takes
    whoseturn_ledger (engine, replica PRIMARY KEY,      each replica's load there,
                      batch_prefill_tokens, hold,       and its heartbeat
                      updated_at)

Both tables are ``UNLOGGED``: the ledger is soft state, rewritten every publish
interval, so its writes skip the write-ahead log and its commits wait for no disk
flush (after a database crash the tables come back empty, which is what a lease
would make of them anyway). Times are the database's own ``now()``, so the
replicas' clocks never meet. Every
call has a time limit (``timeout_s``); past it, or on any database error, it raises
:class:`~proxy.replicas.LedgerError`.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import psycopg
from psycopg import AsyncConnection
from psycopg_pool import AsyncConnectionPool, PoolTimeout

from proxy.replicas._ledger import LedgerError, Verdict, granted
from proxy.scheduler import ReplicaLoad, Reservation

logger = logging.getLogger(__name__)

SCHEMA = """
CREATE UNLOGGED TABLE IF NOT EXISTS whoseturn_ledger_engines (engine text PRIMARY KEY);
CREATE UNLOGGED TABLE IF NOT EXISTS whoseturn_ledger (
    engine text NOT NULL,
    replica text NOT NULL,
    batch_prefill_tokens bigint NOT NULL DEFAULT 0,
    hold boolean NOT NULL DEFAULT false,
    updated_at timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (engine, replica)
);
"""

UPSERT = """
INSERT INTO whoseturn_ledger (engine, replica, batch_prefill_tokens, hold, updated_at)
VALUES (%s, %s, %s, %s, now())
ON CONFLICT (engine, replica) DO UPDATE SET batch_prefill_tokens = EXCLUDED.batch_prefill_tokens,
    hold = EXCLUDED.hold, updated_at = now()
"""

UPSERT_TOKENS = """
INSERT INTO whoseturn_ledger (engine, replica, batch_prefill_tokens, updated_at)
VALUES (%s, %s, %s, now())
ON CONFLICT (engine, replica) DO UPDATE SET batch_prefill_tokens = EXCLUDED.batch_prefill_tokens,
    updated_at = now()
"""

OTHERS = """
SELECT engine, coalesce(sum(batch_prefill_tokens), 0)::bigint, coalesce(bool_or(hold), false)
FROM whoseturn_ledger
WHERE replica <> %s AND updated_at > now() - make_interval(secs => %s) {where}
GROUP BY engine
"""

LOCK_ENGINE = """
INSERT INTO whoseturn_ledger_engines (engine) VALUES (%s)
ON CONFLICT (engine) DO UPDATE SET engine = EXCLUDED.engine
"""


class PostgresLedger:
    """:class:`~proxy.replicas.Ledger` in the database at ``dsn``, for ``replica``.

    A row counts while its heartbeat is younger than ``lease_s``."""

    def __init__(self, dsn: str, replica: str, *, lease_s: float, timeout_s: float = 1.0) -> None:
        self.replica = replica
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self._pool = AsyncConnectionPool(
            dsn, min_size=1, max_size=2, open=False, name="whoseturn-ledger", timeout=timeout_s
        )

    async def open(self) -> None:
        try:
            await self._pool.open(wait=True, timeout=30)
            async with self._pool.connection() as conn, conn.transaction():
                await conn.execute("SELECT pg_advisory_xact_lock(hashtext('whoseturn_ledger'))")
                await conn.execute(SCHEMA)
        except (psycopg.Error, PoolTimeout) as exc:
            raise LedgerError(f"cannot open the ledger: {exc}") from exc
        logger.info("shared budget: replica %s, ledger in PostgreSQL", self.replica)

    async def close(self) -> None:
        try:
            with anyio.fail_after(self.timeout_s):
                async with self._pool.connection() as conn:
                    sql = "DELETE FROM whoseturn_ledger WHERE replica = %s"
                    await conn.execute(sql, (self.replica,))
        except (psycopg.Error, PoolTimeout, TimeoutError) as exc:
            logger.warning("ledger: could not remove this replica's rows: %s", exc)
        await self._pool.close()

    async def publish(self, loads: Mapping[str, ReplicaLoad]) -> dict[str, ReplicaLoad]:
        rows = [(e, self.replica, x.batch_prefill_tokens, x.hold_for_interactive)
                for e, x in sorted(loads.items())]  # fmt: skip
        async with self._transaction() as conn:
            async with conn.cursor() as cur:
                await cur.executemany(UPSERT, rows)
            cur = await conn.execute(OTHERS.format(where=""), (self.replica, self.lease_s))
            return {row[0]: ReplicaLoad(int(row[1]), bool(row[2])) for row in await cur.fetchall()}

    async def reserve(self, engine: str, reservation: Reservation) -> Verdict:
        async with self._transaction() as conn:
            await conn.execute(LOCK_ENGINE, (engine,))
            sql = OTHERS.format(where="AND engine = %s")
            cur = await conn.execute(sql, (self.replica, self.lease_s, engine))
            row = await cur.fetchone()
            others = ReplicaLoad(int(row[1]), bool(row[2])) if row else ReplicaLoad()
            ok = granted(reservation, others)
            mine = reservation.in_prefill - (0 if ok else reservation.tokens)
            await conn.execute(UPSERT_TOKENS, (engine, self.replica, max(0, mine)))
            return Verdict(ok, others)

    @asynccontextmanager
    async def _transaction(self) -> AsyncIterator[AsyncConnection[Any]]:
        """A pooled connection in a transaction, under the time limit; database
        errors and the time limit come out as :class:`LedgerError`."""
        try:
            with anyio.fail_after(self.timeout_s):
                async with self._pool.connection() as conn, conn.transaction():
                    yield conn
        except TimeoutError as exc:
            raise LedgerError(f"no answer within {self.timeout_s:g} s") from exc
        except (psycopg.Error, PoolTimeout) as exc:
            raise LedgerError(str(exc) or type(exc).__name__) from exc
