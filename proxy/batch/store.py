"""The batch store's contract: files, batches and their lines, durable.

A backend keeps three things: uploaded files (their rows; their bytes on disk),
batch jobs (status, timestamps, counts) and each job's lines (the request body,
and once run, the one output or error line recorded for it). The guarantees the
runner builds *exactly once* on:

- :meth:`BatchStore.record` stores a line's result and the job's counts in one
  transaction, only if the line had no result yet; it says whether it did.
- :meth:`BatchStore.fill_batch` stores a ``validating`` job's lines and moves it
  to ``in_progress`` in one transaction, or stores nothing (:class:`LineError`).
- :meth:`BatchStore.finalize` writes the output and error files from the recorded
  lines and sets the final status in one transaction; run again after a crash, it
  writes the same files under the same ids; on a job already final it changes
  nothing and returns the job.

The job queue: the runner takes lines to run with :meth:`BatchStore.claim`, which
leases each line to one ``owner`` (a runner) for ``lease_s`` seconds; no other
owner gets a line while its lease is live. The owner renews the leases of the
lines it is running (:meth:`BatchStore.renew`) and hands back those it did not run
(:meth:`BatchStore.release`); a line whose lease ran out (its owner died) is
claimed again. On PostgreSQL several replicas share the queue (and
:meth:`BatchStore.fill_batch` fills a job once however many replicas try); on
SQLite the one process holds every lease (in memory: a restart forgets them).

A job also keeps the runners' measure of its pace (:class:`Progress`: its busy
seconds and the lines recorded in them), added to with
:meth:`BatchStore.add_progress`, so that its estimate survives a restart.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Protocol

Json = dict[str, Any]

ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")
STATUSES = (
    "validating", "failed", "in_progress", "finalizing",
    "completed", "expired", "cancelling", "cancelled",
)  # fmt: skip
FINAL = ("failed", "completed", "expired", "cancelled")


class LineError(ValueError):
    """An input line the job cannot take; ``line`` counts from 1."""

    def __init__(self, line: int, why: str) -> None:
        super().__init__(f"Line {line}: {why}" if line else why)
        self.line = line
        self.why = why


@dataclass(frozen=True)
class FileRecord:
    id: str
    purpose: str
    filename: str
    bytes: int
    created_at: int


@dataclass(frozen=True)
class LineSpec:
    """One valid input line: its position, ``custom_id`` and request body (JSON text)."""

    idx: int
    custom_id: str
    body: str


@dataclass(frozen=True)
class PendingLine:
    idx: int
    custom_id: str
    body: Json


@dataclass(frozen=True)
class LineResult:
    """A line's outcome: ``ok`` lines go to the output file, the others to the error
    file; ``line`` is the whole JSONL line; ``quality`` is ``valid``/``invalid`` for
    an ``ok`` line (see :func:`proxy.batch.lines.quality`), else empty; the tokens
    are the answer's ``usage``."""

    ok: bool
    line: str
    quality: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0


@dataclass(frozen=True)
class Progress:
    """A job's measured pace: ``busy_s``, the seconds during which a runner had some of
    its lines in flight, and the lines recorded in them (``records``; ``usable``: of
    those, the ones in the output file that, where they asked for structured output,
    follow it). Stored as increments, so that restarts and replicas add up."""

    busy_s: float = 0.0
    records: int = 0
    usable: int = 0


@dataclass(frozen=True)
class BatchRecord:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    created_at: int
    expires_at: int
    metadata: Mapping[str, str] | None
    total: int
    completed: int
    failed: int
    valid: int = 0
    invalid: int = 0
    output_file_id: str | None = None
    error_file_id: str | None = None
    times: Mapping[str, int | None] = field(default_factory=dict)
    errors: list[Json] | None = None
    tenant: str = ""  # the tenant of the key that created it ("" anonymous)
    busy_s: float = 0.0  # its stored Progress: the runners' busy seconds,
    busy_records: int = 0  # the lines they recorded in them,
    busy_usable: int = 0  # and of those, the usable ones

    @property
    def progress(self) -> Progress:
        """The pace stored with the job (zero before anything was measured)."""
        return Progress(self.busy_s, self.busy_records, self.busy_usable)


@dataclass(frozen=True)
class NewBatch:
    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    window_s: int
    metadata: Mapping[str, str] | None
    tenant: str = ""


def columns(record: type[Any]) -> str:
    """A record's fields in order: the columns a SQL backend reads it from."""
    return ", ".join(f.name for f in fields(record))


class BatchStore(Protocol):
    """Every method is safe to call from the event loop (backends run their I/O
    off it). Ids are made by the caller or by the backend as documented."""

    async def open(self) -> None: ...
    async def close(self) -> None: ...

    async def ping(self) -> None:
        """The cheapest round trip that shows the store answers (raises if not)."""
        ...

    def spool_path(self) -> Path:
        """A new local path to write an upload to before :meth:`add_file`."""
        ...

    async def add_file(self, purpose: str, filename: str, source: Path) -> FileRecord:
        """Move ``source`` (a :meth:`spool_path`) into the store under a new id."""
        ...

    async def get_file(self, file_id: str) -> FileRecord | None: ...
    async def list_files(self, after: str | None, limit: int) -> list[FileRecord]: ...
    async def delete_file(self, file_id: str) -> bool: ...
    def read_file(self, file_id: str) -> AsyncIterator[bytes]:
        """The stored file's bytes, in chunks."""
        ...

    def local_file(self, file_id: str) -> AbstractAsyncContextManager[Path]:
        """A local path holding the file's bytes while the block runs (an
        :class:`OSError` where the file is gone)."""
        ...

    async def add_batch(self, new: NewBatch) -> BatchRecord:
        """Store the job alone, ``validating``: its lines come with :meth:`fill_batch`."""
        ...

    async def fill_batch(self, batch_id: str, lines: Iterator[LineSpec]) -> BatchRecord:
        """Store a ``validating`` job's lines and its total, and move it to
        ``in_progress``; raises :class:`LineError` (nothing stored, still ``validating``)."""
        ...

    async def fail_batch(self, batch_id: str, errors: list[Json]) -> BatchRecord:
        """Move the job to ``failed`` with OpenAI's ``errors.data`` items."""
        ...

    async def expire_pending(self, batch_id: str, line_for: Callable[[str], LineResult]) -> int:
        """Record ``line_for(custom_id)`` for every line without a result (counted as
        failed), in one transaction; how many."""
        ...

    async def get_batch(self, batch_id: str) -> BatchRecord | None: ...
    async def list_batches(self, after: str | None, limit: int) -> list[BatchRecord]: ...
    async def active_batches(self) -> list[BatchRecord]: ...
    async def set_status(self, batch_id: str, status: str, only_from: tuple[str, ...]) -> bool:
        """Move the job to ``status`` (stamping ``<status>_at``) if it is in ``only_from``."""
        ...

    async def claim(
        self, batch_id: str, owner: str, limit: int, lease_s: float
    ) -> list[PendingLine]:
        """Lease up to ``limit`` lines without a result and without a live lease to
        ``owner`` for ``lease_s`` seconds; lowest positions first, in order."""
        ...

    async def renew(self, batch_id: str, owner: str, lines: Sequence[int], lease_s: float) -> int:
        """Extend ``owner``'s leases on ``lines`` (positions) that have no result yet;
        how many it still held."""
        ...

    async def release(self, batch_id: str, owner: str) -> int:
        """Drop ``owner``'s leases on the job's unrecorded lines; how many."""
        ...

    async def record(self, batch_id: str, idx: int, result: LineResult) -> bool: ...
    async def add_progress(self, batch_id: str, progress: Progress) -> None:
        """Add a runner's measure since its last call (busy seconds, lines recorded,
        usable lines) to the job's :class:`Progress`."""
        ...

    async def finalize(self, batch_id: str, status: str) -> BatchRecord: ...
    async def count_by_status(self) -> dict[str, int]: ...
