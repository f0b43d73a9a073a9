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
replicas' clocks never meet.

One connection, used by one call at a time (the replica's calls are one at a time
anyway), made again on the next call once it is lost. Every call has a time limit
(``timeout_s``), kept on this side: a database that is paused (``SIGSTOP``, a frozen
VM) answers nothing, so no server-side timeout would fire. Past the limit the
connection is closed, never reused half-way through a statement; past it, or on any
database error, the call raises :class:`~proxy.replicas.LedgerError`. No pool sits in
between: a pool's reconnection back-off would keep the replica off the ledger for
seconds after the database is back, where the next call here reconnects at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from typing import Any

import anyio
import psycopg
from psycopg import AsyncConnection

from proxy.replicas._ledger import LedgerError, Others, Verdict, granted
from proxy.scheduler import ReplicaLoad, Reservation

logger = logging.getLogger(__name__)
OPEN_TIMEOUT_S = 30.0  # the first connection and the schema, at startup

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
SELECT engine, coalesce(sum(batch_prefill_tokens), 0)::bigint, coalesce(bool_or(hold), false),
    count(*)
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
        self._dsn = dsn
        self._conn: AsyncConnection[Any] | None = None
        self._lock = asyncio.Lock()

    async def open(self) -> None:
        try:
            async with self._transaction(OPEN_TIMEOUT_S) as conn:
                await conn.execute("SELECT pg_advisory_xact_lock(hashtext('whoseturn_ledger'))")
                await conn.execute(SCHEMA)
        except LedgerError as exc:
            raise LedgerError(f"cannot open the ledger: {exc}") from exc
        logger.info("shared budget: replica %s, ledger in PostgreSQL", self.replica)

    async def close(self) -> None:
        for attempt in (1, 2):  # the first may find a connection the database dropped
            try:
                async with self._transaction() as conn:
                    sql = "DELETE FROM whoseturn_ledger WHERE replica = %s"
                    await conn.execute(sql, (self.replica,))
                break
            except LedgerError as exc:
                if attempt == 2 or isinstance(exc.__cause__, TimeoutError):
                    logger.warning("ledger: could not remove this replica's rows: %s", exc)
                    break
        async with self._lock:
            await self._drop()

    async def publish(self, loads: Mapping[str, ReplicaLoad]) -> dict[str, Others]:
        rows = [(e, self.replica, x.batch_prefill_tokens, x.hold_for_interactive)
                for e, x in sorted(loads.items())]  # fmt: skip
        async with self._transaction() as conn:
            async with conn.cursor() as cur:
                await cur.executemany(UPSERT, rows)
            cur = await conn.execute(OTHERS.format(where=""), (self.replica, self.lease_s))
            return {
                row[0]: Others(ReplicaLoad(int(row[1]), bool(row[2])), int(row[3]))
                for row in await cur.fetchall()
            }

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
    async def _transaction(
        self, limit_s: float | None = None
    ) -> AsyncIterator[AsyncConnection[Any]]:
        """The connection (made again if it was lost) in a transaction, under the
        time limit (``timeout_s`` unless ``limit_s``), one call at a time. Database
        errors and the time limit come out as :class:`LedgerError`; a connection that
        timed out or broke is closed, and the next call makes a new one."""
        limit = self.timeout_s if limit_s is None else limit_s
        async with self._lock:
            try:
                with anyio.fail_after(limit):
                    if self._conn is None or self._conn.closed or self._conn.broken:
                        await self._drop()
                        self._conn = await AsyncConnection.connect(self._dsn)
                    async with self._conn.transaction():
                        yield self._conn
            except TimeoutError as exc:
                await self._drop()  # stuck mid-statement: never to be used again
                raise LedgerError(f"no answer within {limit:g} s") from exc
            except psycopg.Error as exc:
                if self._conn is not None and self._conn.broken:
                    await self._drop()
                raise LedgerError(str(exc) or type(exc).__name__) from exc

    async def _drop(self) -> None:
        """Close the connection, if any (it sends no more than a goodbye, and waits
        for no answer)."""
        conn, self._conn = self._conn, None
        if conn is not None and not conn.closed:
            await conn.close()
