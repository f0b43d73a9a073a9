"""The shared ledger in a SQLite file: the worker processes of one box
(``serve --workers N``) share each engine's budget with no database server.

The same two tables as :mod:`proxy.replicas.postgres`, in one file (WAL mode, so
readers never wait for the writer)::

    ledger (engine, replica PRIMARY KEY,     each replica's load on each engine,
            batch_prefill_tokens, hold,      and its heartbeat (epoch seconds:
            updated_at)                      the workers share one clock)

A reservation is one ``BEGIN IMMEDIATE`` transaction: SQLite's write lock is the
whole file's, so it serializes every reservation on the box, which is the engine
lock's job on PostgreSQL (and more than it: reservations on two engines wait for
each other too, for the tens of microseconds one takes).

Calls run on a worker thread, one at a time, so the event loop never waits on the
file's lock; each has a time limit (``timeout_s``, also SQLite's busy timeout), past
which it raises :class:`~proxy.replicas.LedgerError`, as every database error does.
The file is soft state: a replica's rows stop counting ``lease_s`` after its last
write, and each replica removes its own when it stops.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread

from proxy.replicas._ledger import LedgerError, Others, Verdict, granted
from proxy.scheduler import ReplicaLoad, Reservation

logger = logging.getLogger(__name__)
T = TypeVar("T")

SCHEMA = """
CREATE TABLE IF NOT EXISTS ledger (
    engine TEXT NOT NULL,
    replica TEXT NOT NULL,
    batch_prefill_tokens INTEGER NOT NULL DEFAULT 0,
    hold INTEGER NOT NULL DEFAULT 0,
    updated_at REAL NOT NULL,
    PRIMARY KEY (engine, replica)
);
"""

UPSERT = """
INSERT INTO ledger (engine, replica, batch_prefill_tokens, hold, updated_at)
VALUES (?, ?, ?, ?, ?)
ON CONFLICT (engine, replica) DO UPDATE SET batch_prefill_tokens = excluded.batch_prefill_tokens,
    hold = excluded.hold, updated_at = excluded.updated_at
"""

UPSERT_TOKENS = """
INSERT INTO ledger (engine, replica, batch_prefill_tokens, updated_at) VALUES (?, ?, ?, ?)
ON CONFLICT (engine, replica) DO UPDATE SET batch_prefill_tokens = excluded.batch_prefill_tokens,
    updated_at = excluded.updated_at
"""

OTHERS = """
SELECT engine, coalesce(sum(batch_prefill_tokens), 0), coalesce(max(hold), 0), count(*)
FROM ledger WHERE replica <> ? AND updated_at > ? {where} GROUP BY engine
"""


class SQLiteLedger:
    """:class:`~proxy.replicas.Ledger` in the SQLite file at ``path``, for ``replica``.

    ``now`` gives epoch seconds (every process on the box reads the same clock); a
    row counts while its heartbeat is younger than ``lease_s``."""

    def __init__(
        self,
        path: Path,
        replica: str,
        *,
        lease_s: float,
        timeout_s: float = 1.0,
        now: Callable[[], float] = time.time,
    ) -> None:
        self.path = path
        self.replica = replica
        self.lease_s = lease_s
        self.timeout_s = timeout_s
        self._now = now
        self._db: sqlite3.Connection | None = None
        self._one = anyio.CapacityLimiter(1)  # one call at a time on the one connection

    async def open(self) -> None:
        def create() -> None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            db = self._connection()
            with db:
                db.execute("PRAGMA journal_mode=WAL")
                db.executescript(SCHEMA)

        try:
            await self._call(lambda _: create())
        except LedgerError as exc:
            raise LedgerError(f"cannot open the ledger at {self.path}: {exc}") from exc
        logger.info("shared budget: replica %s, ledger in %s", self.replica, self.path)

    async def close(self) -> None:
        def remove(db: sqlite3.Connection) -> None:
            with db:
                db.execute("DELETE FROM ledger WHERE replica = ?", (self.replica,))

        try:
            await self._call(remove)
        except LedgerError as exc:
            logger.warning("ledger: could not remove this replica's rows: %s", exc)
        db, self._db = self._db, None
        if db is not None:
            db.close()

    async def publish(self, loads: Mapping[str, ReplicaLoad]) -> dict[str, Others]:
        def publish(db: sqlite3.Connection) -> dict[str, Others]:
            now = self._now()
            rows = [(e, self.replica, x.batch_prefill_tokens, int(x.hold_for_interactive), now)
                    for e, x in sorted(loads.items())]  # fmt: skip
            with db:
                db.executemany(UPSERT, rows)
                found = db.execute(
                    OTHERS.format(where=""), (self.replica, now - self.lease_s)
                ).fetchall()
            return {
                row[0]: Others(ReplicaLoad(int(row[1]), bool(row[2])), int(row[3])) for row in found
            }

        return await self._call(publish)

    async def reserve(self, engine: str, reservation: Reservation) -> Verdict:
        def reserve(db: sqlite3.Connection) -> Verdict:
            db.execute("BEGIN IMMEDIATE")  # the file's write lock: one reservation at a time
            try:
                now = self._now()
                sql = OTHERS.format(where="AND engine = ?")
                row = db.execute(sql, (self.replica, now - self.lease_s, engine)).fetchone()
                others = ReplicaLoad(int(row[1]), bool(row[2])) if row else ReplicaLoad()
                ok = granted(reservation, others)
                mine = reservation.in_prefill - (0 if ok else reservation.tokens)
                db.execute(UPSERT_TOKENS, (engine, self.replica, max(0, mine), now))
            except BaseException:
                db.rollback()
                raise
            db.commit()
            return Verdict(ok, others)

        return await self._call(reserve)

    def _connection(self) -> sqlite3.Connection:
        if self._db is None:
            self._db = sqlite3.connect(  # ``with db:`` is one (deferred) transaction
                self.path, timeout=self.timeout_s, isolation_level="DEFERRED",
                check_same_thread=False,
            )  # fmt: skip
        return self._db

    async def _call(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """``fn`` on the connection, on a worker thread, within ``timeout_s``; SQLite's
        errors and the time limit come out as :class:`LedgerError`. A call past its
        limit is left to finish on its thread (SQLite's own busy timeout ends it); the
        next call waits for it, so the connection is never used by two at once."""
        try:
            with anyio.fail_after(self.timeout_s * 2):
                return await anyio.to_thread.run_sync(
                    lambda: fn(self._connection()), limiter=self._one
                )
        except TimeoutError as exc:
            raise LedgerError(f"no answer within {self.timeout_s * 2:g} s") from exc
        except (sqlite3.Error, OSError) as exc:
            raise LedgerError(str(exc) or type(exc).__name__) from exc
