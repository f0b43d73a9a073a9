"""The PostgreSQL batch store: several proxy replicas share one database, its files
and its job queue.

- **Files** live in the database (``file_chunks``: ``bytea`` chunks of
  :data:`CHUNK_BYTES`, written and read one chunk at a time), so replicas on
  different hosts serve each other's uploads and results without a shared disk.
  An upload is spooled to a local temporary folder first, then copied in.
- **The queue**: a replica claims a job's unrecorded lines with ``SELECT ... FOR
  UPDATE SKIP LOCKED`` under a lease (``claimed_by``, ``lease_until``, on the
  database's clock so replicas' clocks need not agree), renews the leases of the
  lines it runs, and releases what it did not run. A replica that dies stops
  renewing; its lines are claimed again once their lease runs out.
- **Exactly once**: :meth:`PostgresStore.record` stores a result only where none
  is, in one transaction with the job's counts (as SQLite's); the records that
  arrive while one is written are written together (group commit). :meth:`finalize`
  takes the job's row lock; a job already final is returned as it is, so the
  replicas that race to finalize write its files once.
- **Schema**: created and migrated at :meth:`PostgresStore.open` under an advisory
  lock (replicas starting together migrate once); ``schema_version`` holds the
  number of :data:`MIGRATIONS` applied. A database newer than this code stops it.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import tempfile
import uuid
from array import array
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
from psycopg import AsyncConnection
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.errors import UniqueViolation
from psycopg.rows import TupleRow
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from proxy.batch import store

logger = logging.getLogger(__name__)
CHUNK_BYTES = 1 << 20
INSERT_PAGE = 1000  # input lines parsed off the event loop at a time
MIGRATION_LOCK = 0x77686F7365  # pg_advisory_xact_lock key: "whose"
NOW = "extract(epoch from clock_timestamp())"

MIGRATIONS: tuple[str, ...] = (
    # 1: files (bytes in chunks), batches, lines with their leases.
    """
    CREATE TABLE files (
        seq bigserial UNIQUE, id text PRIMARY KEY, purpose text NOT NULL,
        filename text NOT NULL, bytes bigint NOT NULL, created_at bigint NOT NULL,
        deleted boolean NOT NULL DEFAULT false
    );
    CREATE TABLE file_chunks (
        file_id text NOT NULL, n integer NOT NULL, data bytea NOT NULL,
        PRIMARY KEY (file_id, n)
    );
    CREATE TABLE batches (
        seq bigserial UNIQUE, id text PRIMARY KEY, endpoint text NOT NULL,
        input_file_id text NOT NULL, completion_window text NOT NULL, status text NOT NULL,
        created_at bigint NOT NULL, expires_at bigint NOT NULL, metadata jsonb,
        total integer NOT NULL DEFAULT 0, completed integer NOT NULL DEFAULT 0,
        failed integer NOT NULL DEFAULT 0, valid integer NOT NULL DEFAULT 0,
        invalid integer NOT NULL DEFAULT 0, output_file_id text, error_file_id text,
        times jsonb NOT NULL DEFAULT '{}'
    );
    CREATE INDEX batches_active ON batches (seq) WHERE status IN
        ('validating', 'in_progress', 'finalizing', 'cancelling');
    CREATE TABLE lines (
        batch_id text NOT NULL, idx integer NOT NULL, custom_id text NOT NULL,
        body text NOT NULL, ok boolean, result text,
        claimed_by text, lease_until double precision,
        PRIMARY KEY (batch_id, idx), UNIQUE (batch_id, custom_id)
    );
    CREATE INDEX lines_pending ON lines (batch_id, idx) WHERE result IS NULL;
    """,
    # 2: a failed job's errors (OpenAI's errors.data).
    "ALTER TABLE batches ADD COLUMN errors jsonb;",
    # 3: the tenant of the key that created the job (the jobs before: anonymous).
    "ALTER TABLE batches ADD COLUMN tenant text NOT NULL DEFAULT '';",
    # 4: a job's measured pace, so that its estimate survives a restart (the jobs
    # before: nothing measured yet).
    """
    ALTER TABLE batches ADD COLUMN busy_s double precision NOT NULL DEFAULT 0,
        ADD COLUMN busy_records integer NOT NULL DEFAULT 0,
        ADD COLUMN busy_usable integer NOT NULL DEFAULT 0;
    """,
)
BATCH_COLUMNS = store.columns(store.BatchRecord)
FILE_COLUMNS = store.columns(store.FileRecord)


def redacted(dsn: str) -> str:
    """``dsn`` without its password, for logs."""
    try:
        parts = conninfo_to_dict(dsn)
    except Exception:
        return "(a DSN that does not parse)"
    if "password" in parts:
        parts["password"] = "***"
    return make_conninfo("", **{k: v for k, v in parts.items() if v is not None})


RECORD_SQL = """
WITH input AS (
    SELECT * FROM unnest(%s::integer[], %s::boolean[], %s::text[], %s::text[])
        AS t(idx, ok, result, quality)
), done AS (
    UPDATE lines l SET ok = i.ok, result = i.result FROM input i
    WHERE l.batch_id = %s AND l.idx = i.idx AND l.result IS NULL
    RETURNING l.idx, i.ok, i.quality
), counted AS (
    UPDATE batches SET
        completed = completed + (SELECT count(*) FROM done WHERE ok),
        failed = failed + (SELECT count(*) FROM done WHERE NOT ok),
        valid = valid + (SELECT count(*) FROM done WHERE quality = 'valid'),
        invalid = invalid + (SELECT count(*) FROM done WHERE quality = 'invalid')
    WHERE id = %s AND EXISTS (SELECT FROM done)
)
SELECT idx FROM done
"""


@dataclass
class _Record:
    """One :meth:`PostgresStore.record` call waiting for its group's transaction."""

    idx: int
    result: store.LineResult
    done: bool = False
    stored: bool = False


def _take(lines: Iterator[store.LineSpec], n: int) -> list[store.LineSpec]:
    return list(islice(lines, n))


class PostgresStore:
    """:class:`~proxy.batch.store.BatchStore` on PostgreSQL (``psycopg`` 3, a pool of
    up to ``pool_size`` connections). ``now`` gives epoch seconds for timestamps."""

    def __init__(self, dsn: str, now: Callable[[], float], pool_size: int = 10) -> None:
        self.dsn = dsn
        self._now = now
        self.pool_size = pool_size
        self._pool = self._new_pool()
        self._spool: Path | None = None
        self._queued: dict[str, list[_Record]] = {}  # records waiting, by job
        self._flushing: dict[str, anyio.Lock] = {}

    # -- plumbing -----------------------------------------------------------------

    def _new_pool(self) -> AsyncConnectionPool[AsyncConnection[TupleRow]]:
        return AsyncConnectionPool(
            self.dsn,
            min_size=1,
            max_size=self.pool_size,
            open=False,
            name="whoseturn-batch",
            kwargs={"autocommit": True},  # a statement is its own transaction, else
        )  # conn.transaction() says where one begins and ends

    async def open(self) -> None:
        """Connect and migrate. Failed (or cancelled), the pool is closed and a new
        one made, so that the next try connects at once rather than after the
        failed pool's reconnect backoff."""
        try:
            await self._pool.open(wait=True, timeout=30)
            async with self._pool.connection() as conn:
                await _migrate(conn)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self._pool.close(timeout=1)
            self._pool = self._new_pool()
            raise
        self._spool = Path(tempfile.mkdtemp(prefix="whoseturn-spool-"))
        logger.info("batch store: PostgreSQL at %s", redacted(self.dsn))

    async def close(self) -> None:
        await self._pool.close()
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
            self._spool = None

    async def ping(self) -> None:
        await self._one("SELECT 1")

    async def schema_version(self) -> int:
        async with self._pool.connection() as conn:
            return await _version(conn)

    def _stamp(self) -> int:
        return int(self._now())

    async def _one(self, sql: str, args: tuple[Any, ...] = ()) -> Any:
        async with self._pool.connection() as conn:
            cur = await conn.execute(sql, args)
            return await cur.fetchone()

    async def _all(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        async with self._pool.connection() as conn:
            cur = await conn.execute(sql, args)
            return await cur.fetchall()

    async def _count(self, sql: str, args: tuple[Any, ...] = ()) -> int:
        async with self._pool.connection() as conn:
            cur = await conn.execute(sql, args)
            return cur.rowcount

    # -- files --------------------------------------------------------------------

    def spool_path(self) -> Path:
        assert self._spool is not None, "store not open"
        return self._spool / f"upload-{uuid.uuid4().hex}"

    async def add_file(self, purpose: str, filename: str, source: Path) -> store.FileRecord:
        size = (await anyio.Path(source).stat()).st_size
        record = store.FileRecord(
            f"file-{uuid.uuid4().hex}", purpose, filename, size, self._stamp()
        )
        try:
            async with self._pool.connection() as conn, conn.transaction():
                with source.open("rb") as f:
                    n = 0
                    while chunk := await anyio.to_thread.run_sync(f.read, CHUNK_BYTES):
                        await _put_chunk(conn, record.id, n, chunk)
                        n += 1
                await conn.execute(
                    f"INSERT INTO files ({FILE_COLUMNS}) VALUES (%s, %s, %s, %s, %s)",
                    (record.id, purpose, filename, record.bytes, record.created_at),
                )
        finally:
            await anyio.Path(source).unlink(missing_ok=True)
        return record

    async def get_file(self, file_id: str) -> store.FileRecord | None:
        sql = f"SELECT {FILE_COLUMNS} FROM files WHERE id = %s AND NOT deleted"
        row = await self._one(sql, (file_id,))
        return store.FileRecord(*row) if row else None

    async def list_files(self, after: str | None, limit: int) -> list[store.FileRecord]:
        sql = f"SELECT {FILE_COLUMNS} FROM files WHERE NOT deleted"
        return [
            store.FileRecord(*row) for row in await self._all(*_page(sql, "files", after, limit))
        ]

    async def delete_file(self, file_id: str) -> bool:
        async with self._pool.connection() as conn, conn.transaction():
            sql = "UPDATE files SET deleted = true WHERE id = %s AND NOT deleted"
            gone = (await conn.execute(sql, (file_id,))).rowcount == 1
            if gone:
                await conn.execute("DELETE FROM file_chunks WHERE file_id = %s", (file_id,))
            return gone

    async def read_file(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's bytes, a chunk at a time (one short query per chunk, so a slow
        reader holds no connection)."""
        n = 0
        while row := await self._one(
            "SELECT data FROM file_chunks WHERE file_id = %s AND n = %s", (file_id, n)
        ):
            yield bytes(row[0])
            n += 1

    @asynccontextmanager
    async def local_file(self, file_id: str) -> AsyncIterator[Path]:
        """A local copy of the file (in the spool folder) for as long as the block runs;
        :class:`FileNotFoundError` where the file is gone."""
        if await self.get_file(file_id) is None:
            raise FileNotFoundError(file_id)
        path = self.spool_path()
        try:
            with path.open("wb") as f:
                async for chunk in self.read_file(file_id):
                    await anyio.to_thread.run_sync(f.write, chunk)
            yield path
        finally:
            path.unlink(missing_ok=True)

    # -- batches ------------------------------------------------------------------

    async def add_batch(self, new: store.NewBatch) -> store.BatchRecord:
        now = self._stamp()
        await self._count(
            "INSERT INTO batches (id, endpoint, input_file_id, completion_window, status, "
            "created_at, expires_at, metadata, tenant) "
            "VALUES (%s, %s, %s, %s, 'validating', %s, %s, %s, %s)",
            (new.id, new.endpoint, new.input_file_id, new.completion_window, now,
             now + new.window_s, Jsonb(dict(new.metadata)) if new.metadata else None,
             new.tenant),
        )  # fmt: skip
        return await self._found(new.id)

    async def fill_batch(self, batch_id: str, lines: Iterator[store.LineSpec]) -> store.BatchRecord:
        """Under the job's row lock: replicas that validate the job at once fill it
        once (the others find it no longer ``validating`` and leave it)."""
        async with self._pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "SELECT status, total FROM batches WHERE id = %s FOR UPDATE", (batch_id,)
            )
            row = await cur.fetchone()
            # Validating; or cancelled while validating (its lines still go in, as on SQLite).
            if row is not None and (
                row[0] == "validating" or (row[0] not in store.FINAL and not row[1])
            ):
                await conn.execute("DELETE FROM lines WHERE batch_id = %s", (batch_id,))
                total = await _copy_lines(conn, batch_id, lines)
                await conn.execute(
                    "UPDATE batches SET total = %s, status = CASE status WHEN 'validating' "
                    "THEN 'in_progress' ELSE status END, "
                    "times = times || jsonb_build_object('in_progress_at', %s::bigint) "
                    "WHERE id = %s",
                    (total, self._stamp(), batch_id),
                )
        return await self._found(batch_id)

    async def fail_batch(self, batch_id: str, errors: list[store.Json]) -> store.BatchRecord:
        await self._count(
            "UPDATE batches SET status = 'failed', errors = %s, "
            "times = times || jsonb_build_object('failed_at', %s::bigint) WHERE id = %s",
            (Jsonb(errors), self._stamp(), batch_id),
        )
        return await self._found(batch_id)

    async def expire_pending(
        self, batch_id: str, line_for: Callable[[str], store.LineResult]
    ) -> int:
        async with self._pool.connection() as conn, conn.transaction():
            await conn.execute("SELECT 1 FROM batches WHERE id = %s FOR UPDATE", (batch_id,))
            cur = await conn.execute(
                "SELECT idx, custom_id FROM lines WHERE batch_id = %s AND result IS NULL",
                (batch_id,),
            )
            rest = await cur.fetchall()
            results = [line_for(custom_id) for _, custom_id in rest]
            cur = await conn.execute(
                "UPDATE lines l SET ok = i.ok, result = i.result "
                "FROM unnest(%s::integer[], %s::boolean[], %s::text[]) AS i(idx, ok, result) "
                "WHERE l.batch_id = %s AND l.idx = i.idx AND l.result IS NULL",
                ([i for i, _ in rest], [r.ok for r in results], [r.line for r in results],
                 batch_id),
            )  # fmt: skip
            expired = cur.rowcount
            await conn.execute(
                "UPDATE batches SET failed = failed + %s WHERE id = %s", (expired, batch_id)
            )
            return expired

    async def _found(self, batch_id: str) -> store.BatchRecord:
        found = await self.get_batch(batch_id)
        assert found is not None
        return found

    async def get_batch(self, batch_id: str) -> store.BatchRecord | None:
        row = await self._one(f"SELECT {BATCH_COLUMNS} FROM batches WHERE id = %s", (batch_id,))
        return store.BatchRecord(*row) if row else None

    async def list_batches(self, after: str | None, limit: int) -> list[store.BatchRecord]:
        sql = f"SELECT {BATCH_COLUMNS} FROM batches WHERE true"
        return [
            store.BatchRecord(*row) for row in await self._all(*_page(sql, "batches", after, limit))
        ]

    async def active_batches(self) -> list[store.BatchRecord]:
        sql = f"SELECT {BATCH_COLUMNS} FROM batches WHERE status = ANY(%s) ORDER BY seq"
        return [store.BatchRecord(*row) for row in await self._all(sql, (list(store.ACTIVE),))]

    async def set_status(self, batch_id: str, status: str, only_from: tuple[str, ...]) -> bool:
        sql = (
            "UPDATE batches SET status = %s, times = times || jsonb_build_object(%s::text, %s) "
            "WHERE id = %s AND status = ANY(%s)"
        )
        args = (status, f"{status}_at", self._stamp(), batch_id, list(only_from))
        return await self._count(sql, args) == 1

    async def count_by_status(self) -> dict[str, int]:
        return dict(await self._all("SELECT status, COUNT(*) FROM batches GROUP BY status"))

    # -- lines --------------------------------------------------------------------

    async def claim(
        self, batch_id: str, owner: str, limit: int, lease_s: float
    ) -> list[store.PendingLine]:
        sql = (
            f"UPDATE lines SET claimed_by = %s, lease_until = {NOW} + %s "
            "WHERE batch_id = %s AND idx IN (SELECT idx FROM lines WHERE batch_id = %s "
            f"AND result IS NULL AND (lease_until IS NULL OR lease_until < {NOW}) "
            "ORDER BY idx LIMIT %s FOR UPDATE SKIP LOCKED) "
            "RETURNING idx, custom_id, body"
        )
        async with self._pool.connection() as conn:
            cur = await conn.execute(sql, (owner, lease_s, batch_id, batch_id, limit))
            rows = sorted(await cur.fetchall())
        return [store.PendingLine(i, c, json.loads(b)) for i, c, b in rows]

    async def renew(self, batch_id: str, owner: str, lines: Sequence[int], lease_s: float) -> int:
        sql = (
            f"UPDATE lines SET lease_until = {NOW} + %s WHERE batch_id = %s "
            "AND idx = ANY(%s) AND claimed_by = %s AND result IS NULL"
        )
        return await self._count(sql, (lease_s, batch_id, list(lines), owner))

    async def release(self, batch_id: str, owner: str) -> int:
        sql = (
            "UPDATE lines SET claimed_by = NULL, lease_until = NULL "
            "WHERE batch_id = %s AND claimed_by = %s AND result IS NULL"
        )
        return await self._count(sql, (batch_id, owner))

    async def record(self, batch_id: str, idx: int, result: store.LineResult) -> bool:
        """Group commit: the records that arrive while one is being written go in the
        next transaction together (one statement), each told whether it was stored."""
        mine = _Record(idx, result)
        self._queued.setdefault(batch_id, []).append(mine)
        async with self._flushing.setdefault(batch_id, anyio.Lock()):
            if not mine.done:
                group, self._queued[batch_id] = self._queued[batch_id], []
                try:
                    await self._record_group(batch_id, group)
                except BaseException:  # the others go in the next group
                    self._queued[batch_id][:0] = [r for r in group if r is not mine]
                    raise
        return mine.stored

    async def add_progress(self, batch_id: str, progress: store.Progress) -> None:
        """Increments: the replicas running a job at once each add their own."""
        await self._count(
            "UPDATE batches SET busy_s = busy_s + %s, busy_records = busy_records + %s, "
            "busy_usable = busy_usable + %s WHERE id = %s",
            (progress.busy_s, progress.records, progress.usable, batch_id),
        )

    async def _record_group(self, batch_id: str, group: list[_Record]) -> None:
        first: dict[int, _Record] = {}
        for r in group:
            first.setdefault(r.idx, r)  # the same line twice: the later one is not stored
        rows = list(first.values())
        args = (
            [r.idx for r in rows], [r.result.ok for r in rows],
            [r.result.line for r in rows], [r.result.quality for r in rows],
            batch_id, batch_id,
        )  # fmt: skip
        async with self._pool.connection() as conn:
            async with conn.pipeline(), conn.transaction():  # one round trip
                # Not waiting for the WAL flush (as SQLite's synchronous=NORMAL): a
                # crash of the database itself, not of a replica, may forget the last
                # records, lines and counts together; those lines run again.
                await conn.execute("SET LOCAL synchronous_commit = off")
                cur = await conn.execute(RECORD_SQL, args)
            stored = {int(i) for (i,) in await cur.fetchall()}
        for r in group:
            r.done, r.stored = True, first[r.idx] is r and r.idx in stored

    async def finalize(self, batch_id: str, status: str) -> store.BatchRecord:
        now = self._stamp()
        out_id, err_id = f"file-{batch_id}-output", f"file-{batch_id}-errors"
        async with self._pool.connection() as conn, conn.transaction():
            cur = await conn.execute(
                "SELECT status FROM batches WHERE id = %s FOR UPDATE", (batch_id,)
            )
            row = await cur.fetchone()
            if row is not None and row[0] not in store.FINAL:
                sizes = await _write_results(conn, batch_id, out_id, err_id)
                for file_id, size in zip((out_id, err_id), sizes, strict=True):
                    await conn.execute(
                        f"INSERT INTO files ({FILE_COLUMNS}) VALUES (%s, %s, %s, %s, %s) "
                        "ON CONFLICT (id) DO UPDATE SET bytes = EXCLUDED.bytes, "
                        "created_at = EXCLUDED.created_at, deleted = false",
                        (file_id, "batch_output", f"{file_id}.jsonl", size, now),
                    )
                await conn.execute(
                    "UPDATE batches SET status = %s, output_file_id = %s, error_file_id = %s, "
                    "times = times || jsonb_build_object(%s::text, %s) WHERE id = %s",
                    (status, out_id, err_id, f"{status}_at", now, batch_id),
                )
        lock = self._flushing.get(batch_id)
        if not self._queued.get(batch_id) and (lock is None or not lock.locked()):
            self._queued.pop(batch_id, None)  # the job's records are all in
            self._flushing.pop(batch_id, None)
        found = await self.get_batch(batch_id)
        assert found is not None
        return found


async def _version(conn: AsyncConnection[Any]) -> int:
    cur = await conn.execute("SELECT to_regclass('schema_version') IS NOT NULL")
    exists = await cur.fetchone()
    if not (exists and exists[0]):
        return 0
    cur = await conn.execute("SELECT version FROM schema_version")
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def _migrate(conn: AsyncConnection[Any]) -> None:
    """Apply the migrations this database lacks, in order, in one transaction."""
    async with conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock(%s)", (MIGRATION_LOCK,))
        version = await _version(conn)
        if version > len(MIGRATIONS):
            raise RuntimeError(f"batch store schema {version} is not known (newest here: "
                               f"{len(MIGRATIONS)})")  # fmt: skip
        if version == 0:
            await conn.execute("CREATE TABLE schema_version (version integer NOT NULL)")
            await conn.execute("INSERT INTO schema_version VALUES (0)")
        for number, sql in enumerate(MIGRATIONS[version:], start=version + 1):
            await conn.execute(sql)
            await conn.execute("UPDATE schema_version SET version = %s", (number,))
            logger.info("batch store: schema migrated to version %d", number)


async def _put_chunk(conn: AsyncConnection[Any], file_id: str, n: int, data: bytes) -> None:
    await conn.execute(
        "INSERT INTO file_chunks (file_id, n, data) VALUES (%s, %s, %s)", (file_id, n, data)
    )


async def _copy_lines(
    conn: AsyncConnection[Any], batch_id: str, lines: Iterator[store.LineSpec]
) -> int:
    """COPY the lines in (parsed off the event loop a page at a time); the count. A
    duplicate ``custom_id`` is the unique index's to find, as on SQLite: memory does
    not grow with the job but for the rows' positions (4 bytes a line)."""
    positions = array("l")
    cur = conn.cursor()
    sql = "COPY lines (batch_id, idx, custom_id, body) FROM STDIN"
    try:
        async with cur.copy(sql) as copy:
            while page := await anyio.to_thread.run_sync(_take, lines, INSERT_PAGE):
                for line in page:
                    positions.append(line.idx)
                    await copy.write_row((batch_id, line.idx, line.custom_id, line.body))
    except UniqueViolation as exc:
        raise _duplicate(exc, batch_id, positions) from None
    if not positions:
        raise store.LineError(0, "The input file has no requests.")
    return len(positions)


def _duplicate(exc: UniqueViolation, batch_id: str, positions: array[int]) -> store.LineError:
    """The :class:`store.LineError` for COPY's unique violation: its row number (in the
    error's context) is a position in ``positions``; its key is in the detail."""
    row = re.search(r"line (\d+)", exc.diag.context or "")
    detail = exc.diag.message_detail or ""
    prefix, suffix = f"Key (batch_id, custom_id)=({batch_id}, ", ") already exists."
    custom_id = detail[len(prefix) : -len(suffix)] if detail.startswith(prefix) else "?"
    idx = positions[int(row.group(1)) - 1] if row else 0
    return store.LineError(idx, f"duplicate custom_id `{custom_id}`")


async def _write_results(
    conn: AsyncConnection[Any], batch_id: str, out_id: str, err_id: str
) -> tuple[int, int]:
    """Stream the recorded lines, in order, into the two files' chunks (replacing any
    a crashed finalize left)."""
    await conn.execute("DELETE FROM file_chunks WHERE file_id = ANY(%s)", ([out_id, err_id],))
    files = {True: _ChunkWriter(conn, out_id), False: _ChunkWriter(conn, err_id)}
    cur = conn.cursor(name=f"results-{uuid.uuid4().hex[:8]}")
    await cur.execute(
        "SELECT ok, result FROM lines WHERE batch_id = %s AND result IS NOT NULL ORDER BY idx",
        (batch_id,),
    )
    async for ok, line in cur:
        await files[bool(ok)].write((line + "\n").encode())
    await cur.close()
    return await files[True].close(), await files[False].close()


class _ChunkWriter:
    def __init__(self, conn: AsyncConnection[Any], file_id: str) -> None:
        self.conn, self.file_id = conn, file_id
        self.buffer = bytearray()
        self.n = self.size = 0

    async def write(self, data: bytes) -> None:
        self.buffer += data
        self.size += len(data)
        if len(self.buffer) >= CHUNK_BYTES:
            await self._flush()

    async def _flush(self) -> None:
        await _put_chunk(self.conn, self.file_id, self.n, bytes(self.buffer))
        self.n += 1
        self.buffer.clear()

    async def close(self) -> int:
        if self.buffer:
            await self._flush()
        return self.size


def _page(sql: str, table: str, after: str | None, limit: int) -> tuple[str, tuple[Any, ...]]:
    """Newest first, starting after the row ``after`` names."""
    if after is None:
        return sql + " ORDER BY seq DESC LIMIT %s", (limit,)
    sql += f" AND seq < (SELECT seq FROM {table} WHERE id = %s) ORDER BY seq DESC LIMIT %s"
    return sql, (after, limit)
