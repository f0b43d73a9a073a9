"""The runner: every active batch job, driven to its end through the scheduler.

For each job it claims the lines that have no result yet, a page at a time, in
order, under a lease it renews while it runs them (:meth:`BatchStore.claim`:
several replicas on one PostgreSQL store share a job so), and keeps at most
``window`` of them in the scheduler at once (memory and the scheduler's cost per
decision do not grow with the job); which of those run now is the scheduler's
decision. Each page is fed in the order of its lines' leading text (a stable
sort: lines that share a document or a system prompt go in together, so the
scheduler sends them to the engine that holds it, one after another).

When no line is left to claim it waits for the lines others hold until
every line has a result; then one runner finalizes the job. Each line goes
through the same door as a ``/batch/v1/...`` request (admission → engine → relay, via
:meth:`proxy.api.forward.Forwarder.complete`); an engine error (5xx, 429) is
retried with backoff up to ``max_attempts``, then recorded in the error file.

A job starts ``validating``: its first step reads the input file line by line into
the store (a bad line fails the job with OpenAI's ``errors``), then it runs
``in_progress``. A job that runs out of its window ends ``expired``: the lines
with no result get an error line with code ``batch_expired``.

A line's result is recorded once (see :mod:`proxy.batch.store`); a line whose
answer came but was not recorded before a crash runs again after the restart:
that is the one place an engine call may repeat, and so is a line whose lease ran
out while it ran (its runner stalled past ``lease_s``): another runner claims it.
Cancel and expiry stop the feeding, cancel the lines in flight (the scheduler forgets them, upstream
streams are closed) and finalize with what was recorded.

The job's pace (:class:`~proxy.batch.estimate.Throughput`: its lines recorded per
second of busy time, while some are in flight here) is added to the store every
``progress_s`` and when its run here ends, so that its estimate after a restart
starts from the stored rate rather than from nothing.

A job is its tenant's (the key's that created it, kept in the store): each line goes
as that tenant's, in the job's flow (its id), so that the scheduler shares the batch
class between tenants by weight and a tenant's part between its jobs. The tenant's
batch limits hold its work here, never fail it (:mod:`proxy.batch.gate`): a job past
``batch_jobs`` waits ``in_progress`` before it feeds a line, a line past
``batch_lines`` waits before it is fed, a try past the requests, tokens or streams
the tenant may use waits until the meter allows it. Nothing here is shared between
jobs but those limits: each job has its own window and is polled, claimed and fed
by its own task, so a short job that comes after a long one of another tenant goes
straight into the scheduler beside it.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import anyio

from proxy.batch.estimate import Estimate, Throughput
from proxy.batch.gate import Limited, Slot, TenantGate
from proxy.batch.health import MAX_BACKOFF_S, StoreDown
from proxy.batch.lines import MAX_LINE_BYTES, answered, failed, line_request, read_lines
from proxy.batch.shapes import line_errors
from proxy.batch.store import (
    STATUSES,
    BatchRecord,
    BatchStore,
    LineError,
    LineResult,
    PendingLine,
)
from proxy.clock import WallClock
from proxy.config import Tenant
from proxy.metrics import BatchMetrics
from proxy.openai.answers import Answer
from proxy.openai.line_ids import job_id
from proxy.openai.request import ChatRequest
from proxy.scheduler.limits import TenantMeter

logger = logging.getLogger(__name__)
T = TypeVar("T")
Complete = Callable[[ChatRequest, str], Awaitable[Answer]]


@dataclass(frozen=True, kw_only=True)
class RunnerLimits:
    window: int = 64
    max_attempts: int = 3
    backoff_s: float = 0.5
    poll_s: float = 0.2
    max_lines: int = 50_000
    lease_s: float = 30.0
    max_line_bytes: int = MAX_LINE_BYTES  # a line's limit: ``max_body_bytes``
    progress_s: float = 5.0  # how often a running job's measured pace is saved


EXPIRED = "This request could not be executed before the completion window expired."


class _Run:
    """One job being driven here: its cancel scope and how it is to end."""

    def __init__(self, scope: anyio.CancelScope) -> None:
        self.scope = scope
        self.outcome = "completed"

    def stop(self, outcome: str) -> None:
        if self.outcome == "completed":
            self.outcome = outcome
        self.scope.cancel()


UNMEASURED_LINE_S = 0.25
"""A line's time on its card before a rate is measured (conservative: a deadline is
seen early rather than late)."""


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        complete: Complete,
        metrics: BatchMetrics,
        limits: RunnerLimits,
        now: Callable[[], float],
        models_known: Callable[[], bool] = lambda: True,
        owner: str = "",
        *,
        tenant_of: Callable[[str], Tenant] = lambda name: Tenant(name=name),
        meter: TenantMeter | None = None,
        limited: Limited | None = None,
    ) -> None:
        """``tenant_of(name)``: the tenant a job's stored tenant name stands for (the
        configured one: its weight, tier, limits); ``meter``: the tenants' use of
        their limits, shared with the HTTP edge (a meter of its own where none is
        given); ``limited(tenant, limit)``: a job or line held for a limit."""
        self.store = store
        self.tenant_of = tenant_of
        self.gate = TenantGate(meter or TenantMeter(WallClock()), limited)
        self.owner = owner or f"runner-{uuid.uuid4().hex[:12]}"
        self.models_known = models_known
        self.complete = complete
        self.metrics = metrics
        self.limits = limits
        self._now = now
        self._runs: dict[str, _Run | None] = {}
        self._held: dict[str, set[int]] = {}  # lines claimed here, not yet recorded
        self.throughput = Throughput()
        self.active: list[BatchRecord] = []  # as of the last poll
        self._trouble: str | None = None  # the store error being retried, if any

    def estimate(self, batch: BatchRecord) -> Estimate | None:
        """The estimate for an active job (None for a job that has ended): from what
        this runner measured, else from the pace stored with the job (after a
        restart), else from its model's."""
        if batch.status not in ("validating", "in_progress"):
            return None
        remaining = batch.total - batch.completed - batch.failed
        return self.throughput.estimate(
            batch.id, remaining, batch.expires_at, self._now(), batch.progress
        )

    def due(self, model: str) -> tuple[int | None, float]:
        """What ``model``'s jobs running here need of its card: the earliest end of
        their completion windows (epoch seconds; None: none runs) and the busy time
        their remaining lines take at the rate measured (:data:`UNMEASURED_LINE_S`
        a line before one is), for the rule that swaps models on a card (a read)."""
        deadline: int | None = None
        work_s = 0.0
        now = self._now()
        for batch in self.active:
            if self.throughput.model_of(batch.id) != model:
                continue
            deadline = batch.expires_at if deadline is None else min(deadline, batch.expires_at)
            remaining = max(0, batch.total - batch.completed - batch.failed)
            rate = self.throughput.rate(batch.id, now, batch.progress)
            per_s = rate.per_s if rate is not None and rate.per_s > 0 else 1 / UNMEASURED_LINE_S
            work_s += remaining / per_s
        return deadline, work_s

    async def _save_progress(self, batch_id: str) -> None:
        """Add the job's pace measured here since the last save to the store's, so
        that the estimate survives a restart. Shielded: a cancel does not lose a
        save under way; a save that fails is tried again with the next."""
        progress = self.throughput.unsaved(batch_id, self._now())
        if progress is None:
            return
        with anyio.CancelScope(shield=True):
            try:
                await self.store.add_progress(batch_id, progress)
            except Exception as exc:
                self.throughput.keep(batch_id, progress)
                logger.info("batch %s: progress not saved (%s); saved with the next", batch_id, exc)

    async def run(self) -> None:
        """Forever: start every active job not yet driven; keep the jobs gauge. A
        store that fails is waited out (:meth:`_persist`): the runner never ends
        but by cancellation."""
        async with anyio.create_task_group() as group:
            while True:
                self.active = await self._persist(self.store.active_batches)
                for batch in self.active:
                    if batch.id not in self._runs:
                        self._runs[batch.id] = None
                        group.start_soon(self._job, batch.id)
                counts = await self._persist(self.store.count_by_status)
                self.metrics.set_jobs({s: counts.get(s, 0) for s in STATUSES})
                await anyio.sleep(self.limits.poll_s)

    async def _persist(self, call: Callable[[], Awaitable[T]]) -> T:
        """``call()`` (a store call) until it answers. An outage (:class:`StoreDown`:
        the store logged it) is waited out as the store advises; any other error is
        logged when it first appears and retried with a backoff from ``poll_s`` up
        to a few seconds."""
        tries = 0
        while True:
            try:
                result = await call()
            except StoreDown as exc:
                wait = exc.retry_after_s
            except Exception as exc:
                cause = f"{type(exc).__name__}: {exc}"
                if cause != self._trouble:
                    self._trouble = cause
                    logger.exception("batch store call failed; retrying with backoff")
                wait = min(self.limits.poll_s * 2.0**tries, MAX_BACKOFF_S)
            else:
                if self._trouble is not None:
                    logger.warning("batch store answers again after: %s", self._trouble)
                    self._trouble = None
                return result
            tries += 1
            await anyio.sleep(wait)

    def cancel(self, batch_id: str) -> None:
        """Stop a job driven here now (the store already says ``cancelling``)."""
        run = self._runs.get(batch_id)
        if run is not None:
            run.stop("cancelled")

    async def _job(self, batch_id: str) -> None:
        try:
            final = await self._drive(batch_id)
            if final is None:
                return
            if final == "expired":
                await self.store.expire_pending(batch_id, _expired_line)
            done = await self.store.finalize(batch_id, final)
            logger.info(
                "batch %s %s: %d ok, %d failed of %d",
                batch_id, done.status, done.completed, done.failed, done.total,
            )  # fmt: skip
        except StoreDown as exc:  # the store logged the outage; the next poll starts again
            logger.info("batch %s waits for the store: %s", batch_id, exc.cause)
            await anyio.sleep(exc.retry_after_s)
        except Exception:
            logger.exception("batch %s: the runner failed; it will try again", batch_id)
            await anyio.sleep(1.0)
        finally:
            self._runs.pop(batch_id, None)
            self.throughput.end(batch_id, self._now())

    async def _validate(self, batch: BatchRecord) -> bool:
        """The job's input file read into the store; False if it failed the job."""
        try:
            async with self.store.local_file(batch.input_file_id) as path:
                with path.open("rb") as f:
                    lines = read_lines(
                        f, batch.endpoint, self.limits.max_lines,
                        max_line_bytes=self.limits.max_line_bytes,
                    )  # fmt: skip
                    await self.store.fill_batch(batch.id, lines)
        except LineError as exc:
            await self.store.fail_batch(batch.id, line_errors(exc))
            return False
        except OSError:
            why = LineError(0, f"The input file `{batch.input_file_id}` is gone.")
            await self.store.fail_batch(batch.id, line_errors(why))
            return False
        return True

    async def _drive(self, batch_id: str) -> str | None:
        """Run the job's remaining lines; the status to finalize with (None: the job
        failed validation, nothing to finalize)."""
        batch = await self.store.get_batch(batch_id)
        assert batch is not None
        if batch.status == "validating":
            if not await self._validate(batch):
                return None
            return await self._drive(batch_id)
        if batch.status != "in_progress":
            return {"finalizing": "completed", "cancelling": "cancelled"}[batch.status]
        tenant = self.tenant_of(batch.tenant)
        try:
            with anyio.CancelScope() as scope:
                run = self._runs[batch_id] = _Run(scope)
                async with anyio.create_task_group() as group:
                    group.start_soon(self._watch, batch, run)
                    group.start_soon(self._renew, batch_id)
                    async with self.gate.job(tenant, batch_id):  # batch_jobs: wait here
                        await self._feed(batch, tenant)
                    group.cancel_scope.cancel()
        finally:
            self._held.pop(batch_id, None)
            with anyio.CancelScope(shield=True):
                await self._release(batch_id)
            await self._save_progress(batch_id)
        if run.outcome != "completed":
            return run.outcome
        if await self.store.set_status(batch_id, "finalizing", ("in_progress",)):
            return "completed"
        return await self._drive(batch_id)  # cancelled in the meantime

    async def _release(self, batch_id: str) -> None:
        """Hand back the leases this runner holds on the job, if the store answers
        (else they run out by themselves)."""
        try:
            await self.store.release(batch_id, self.owner)
        except Exception as exc:
            logger.info("batch %s: leases not handed back (%s); they run out", batch_id, exc)

    async def _watch(self, batch: BatchRecord, run: _Run) -> None:
        """Expiry, a cancel asked through another door than :meth:`cancel`, and the
        job's pace saved every ``progress_s``."""
        saved_at = self._now()
        while True:
            await anyio.sleep(self.limits.poll_s)
            now = self._now()
            if now >= batch.expires_at:
                run.stop("expired")
                return
            if now - saved_at >= self.limits.progress_s:
                saved_at = now
                await self._save_progress(batch.id)
            current = await self._persist(lambda: self.store.get_batch(batch.id))
            if current is None or current.status == "cancelling":
                run.stop("cancelled")
                return

    async def _renew(self, batch_id: str) -> None:
        """Keep this runner's leases on the job's lines it holds live."""
        while True:
            await anyio.sleep(self.limits.lease_s / 3)
            held = sorted(self._held.get(batch_id, ()))
            try:
                await self.store.renew(batch_id, self.owner, held, self.limits.lease_s)
            except Exception as exc:  # the next round tries again
                logger.info("batch %s: leases not renewed: %s", batch_id, exc)

    def waiting(self, batch: BatchRecord) -> bool:
        """Whether the job waits for one of its tenant's ``batch_jobs`` (a read)."""
        return self.gate.waiting_job(batch.tenant, batch.id)

    async def _feed(self, batch: BatchRecord, tenant: Tenant) -> None:
        """The job's lines into the scheduler, ``window`` at most at once and each
        under its tenant's ``batch_lines``, until every line has a result."""
        room = anyio.Semaphore(self.limits.window)
        async with anyio.create_task_group() as group:
            begun = False
            while True:
                page = await self._next_page(batch.id)
                held = self._held.setdefault(batch.id, set())
                for line in sorted(page, key=prefix_key):
                    if line.idx in held:  # its lease ran out while it ran here
                        continue
                    await room.acquire()
                    try:
                        slot = await self.gate.line(tenant, batch.id)
                    except BaseException:
                        room.release()
                        raise
                    held.add(line.idx)
                    if not begun:  # busy from its first line in flight
                        model = str(line.body.get("model", ""))
                        self.throughput.begin(batch.id, model, self._now())
                        begun = True
                    self.throughput.sent(batch.id, self._now())
                    group.start_soon(self._line, batch, line, room, slot)
                if not page:
                    if await self._all_recorded(batch.id):
                        break
                    await anyio.sleep(self.limits.poll_s)  # lines running here or elsewhere

    async def _all_recorded(self, batch_id: str) -> bool:
        current = await self._persist(lambda: self.store.get_batch(batch_id))
        return current is None or current.completed + current.failed >= current.total

    async def _next_page(self, batch_id: str) -> list[PendingLine]:
        """The next lines to feed, once every engine's models are known (a line
        for a model no engine serves is an error, not a wait)."""
        while True:
            if self.models_known():
                break
            await anyio.sleep(self.limits.poll_s)
        limits = self.limits
        return await self._persist(
            lambda: self.store.claim(batch_id, self.owner, limits.window, limits.lease_s)
        )

    async def _line(
        self, batch: BatchRecord, line: PendingLine, room: anyio.Semaphore, slot: Slot
    ) -> None:
        try:
            result = await self._attempts(batch, line, slot)
            if await self._persist(lambda: self._record(batch.id, line.idx, result)):
                self.metrics.count(result)
                usable = result.ok and result.quality != "invalid"
                model = str(line.body.get("model", ""))
                self.throughput.add(self._now(), batch.id, model, usable)
        finally:
            self.throughput.back(batch.id, self._now())
            self.gate.line_done(slot)
            self._held.get(batch.id, set()).discard(line.idx)
            room.release()

    async def _record(self, batch_id: str, idx: int, result: LineResult) -> bool:
        """One try at recording an answer, shielded: a cancel (of the job, of the
        runner) does not lose an answer being written. Between tries (an outage) a
        cancel abandons it, and the line runs again."""
        with anyio.CancelScope(shield=True):
            stored = await self.store.record(batch_id, idx, result)
        return stored

    async def _attempts(self, batch: BatchRecord, line: PendingLine, slot: Slot) -> LineResult:
        req = line_request(line.body, batch.endpoint, tenant=slot.tenant, flow=batch.id)
        answer = Answer(0, b"{}", {})
        for attempt in range(1, self.limits.max_attempts + 1):
            await self.gate.request(slot)  # the tenant's requests, tokens, streams
            answer = await self.complete(req, job_id(batch.id, line.custom_id, attempt))
            status = answer.status
            if status < 500 and status != 429:
                break
            logger.warning(
                "batch %s line %d: HTTP %d (try %d)", batch.id, line.idx, status, attempt
            )
            if attempt < self.limits.max_attempts:
                await anyio.sleep(self.limits.backoff_s * 2 ** (attempt - 1))
        return answered(line.custom_id, answer, line.body)


PREFIX_KEY_CHARS = 2048


def prefix_key(line: PendingLine) -> str:
    """What orders a page: the line's prompt (or messages, as JSON) up to
    ``PREFIX_KEY_CHARS`` characters."""
    body = line.body
    content = body.get("messages", body.get("prompt", ""))
    text = content if isinstance(content, str) else json.dumps(content, sort_keys=True)
    return text[:PREFIX_KEY_CHARS]


def _expired_line(custom_id: str) -> LineResult:
    return failed(custom_id, "batch_expired", EXPIRED)
