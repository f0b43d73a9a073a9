"""The one door between the request path and the scheduler.

The edge queues a job with :meth:`Admission.admit` and waits for its turn; it
reports what happens to the job (first token, gaps, finish, failure, hang-up) by
the job's id. Every event that can free room runs the scheduler (:meth:`pump`),
and each job the scheduler dispatches is released to the request that waits for
it as an :class:`Admitted` value. After each run the scheduler is asked which
batch jobs in prefill to abort for a chat (:mod:`proxy.scheduler.aborts`): each
one the edge can still abort (``on_abort``: nothing of it reached its client) is
requeued, and its request waits again with :meth:`readmit`. The engine monitor
and the periodic tick come in here too. Reads (:meth:`report`, :meth:`decisions`,
:meth:`models`, ...) never run the scheduler and never change its state.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from proxy.config import EngineConfig
from proxy.scheduler import (
    Abort,
    Decision,
    Dispatch,
    EngineLoad,
    Job,
    ReplicaLoad,
    Reservation,
    Scheduler,
    TrafficClass,
)
from proxy.scheduler.budget import BudgetChange
from proxy.scheduler.fair import TenantShare
from proxy.scheduler.history import Second
from proxy.scheduler.pieces import ChatSigns, pieces_in_prefill
from proxy.scheduler.prefix import KVEvent
from proxy.scheduler.residency import Demand
from proxy.scheduler.turns import turn_report

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Admitted:
    """A job's turn on an engine: what the request path needs to send it there."""

    job_id: str
    engine: str
    attempt: int
    dispatched_at: float
    queued_s: float  # how long the job waited in the proxy before this dispatch
    # of which, waiting for its model to be woken on a card (it arrived while none of
    # its engines was awake); 0.0 for the rest
    activation_s: float = 0.0

    @classmethod
    def of(cls, dispatch: Dispatch) -> Admitted:
        job = dispatch.job
        queued = dispatch.at - job.arrival
        return cls(
            job.id, dispatch.engine, dispatch.attempt, dispatch.at, queued,
            queued if job.for_wake else 0.0,
        )  # fmt: skip


class Closed(Exception):
    """The proxy is draining: no job waits for a turn any more."""


class NotWoken(Exception):
    """The job's model could not be woken on its card (the message says why)."""


class Admission:
    def __init__(self, scheduler: Scheduler) -> None:
        self._scheduler = scheduler
        self._waiters: dict[str, asyncio.Future[Admitted]] = {}
        self.closed = False
        self.on_release: Callable[[], None] | None = None  # work left prefill or ended
        # the edge cancels an aborted job's upstream request; False if it cannot now
        self.on_abort: Callable[[Abort], bool] | None = None
        # a job queued for a model whose engines are all at rest on a card (its keeper
        # decides at once rather than at its next step)
        self.on_wake_wanted: Callable[[str], None] | None = None

    def _released(self) -> None:
        if self.on_release is not None:
            self.on_release()

    async def admit(self, job: Job) -> Admitted:
        """Queue ``job`` and return its dispatch; raises :class:`UnknownModel` if no
        engine serves its model, :class:`Closed` once :meth:`close` was called."""
        if self.closed:
            raise Closed
        future = self._hold_place(job.id)
        return await self._wait(job.id, future, job)

    async def readmit(self, job_id: str) -> Admitted:
        """After :meth:`failed` requeued the job, its next dispatch (which may have
        been chosen already)."""
        future = self._waiters.get(job_id)
        if future is None:
            if self.closed:
                self.abandon(job_id)
                raise Closed
            future = self._hold_place(job_id)
        return await self._wait(job_id, future, None)

    async def _wait(
        self, job_id: str, future: asyncio.Future[Admitted], new: Job | None
    ) -> Admitted:
        try:
            if new is not None:
                self._scheduler.submit(new)
                if new.for_wake and self.on_wake_wanted is not None:
                    self.on_wake_wanted(new.model)
            self.pump()
            return await future
        except BaseException:
            # Cancelled (the client left) or failed: the job leaves the scheduler,
            # even if it was dispatched in the same instant.
            self.abandon(job_id)
            raise
        finally:
            self._waiters.pop(job_id, None)

    def fail_waiting(self, model: str, why: str) -> int:
        """Every job of ``model`` still waiting for its turn fails with
        :class:`NotWoken` (``why``): its model's wake failed, and a retry is the
        client's to choose. Returns how many."""
        failed = 0
        for job_id in self._scheduler.queued_of(model):
            future = self._waiters.pop(job_id, None)
            self._scheduler.cancel(job_id)
            if future is not None and not future.done():
                future.set_exception(NotWoken(why))
                failed += 1
        self.pump()
        return failed

    def close(self) -> int:
        """Drain: every job still waiting for its turn, and every later one, fails
        with :class:`Closed`; jobs already dispatched run on. Returns how many
        were waiting."""
        self.closed = True
        waiting = [f for f in self._waiters.values() if not f.done()]
        for future in waiting:
            future.set_exception(Closed())
        return len(waiting)

    def _hold_place(self, job_id: str) -> asyncio.Future[Admitted]:
        future: asyncio.Future[Admitted] = asyncio.get_running_loop().create_future()
        self._waiters[job_id] = future
        return future

    def pump(self) -> None:
        """Run the scheduler and release the jobs it dispatches; then abort the
        batch jobs due, and run it again while any was (each job is aborted a
        bounded number of times, so this ends)."""
        while True:
            for dispatch in self._scheduler.dispatch():
                future = self._waiters.get(dispatch.job.id)
                if future is None or future.done():
                    # Nobody waits any more (the client left between two events).
                    self._scheduler.cancel(dispatch.job.id)
                    continue
                future.set_result(Admitted.of(dispatch))
            if not self._abort_due():
                return

    def _abort_due(self) -> bool:
        """Abort the batch jobs the scheduler names where the edge still can; whether
        any was (an abort the edge cannot make now is asked again at a later event)."""
        aborted = False
        for abort in self._scheduler.aborts_due():
            if self.on_abort is None or not self.on_abort(abort):
                continue
            if self._scheduler.abort(abort):
                self._hold_place(abort.job_id)  # its request waits again (readmit)
                aborted = True
        if aborted:
            self._released()  # batch prompt tokens left prefill
        return aborted

    # -- feedback from the request path ------------------------------------------

    def first_token(self, job_id: str) -> None:
        self._scheduler.on_first_token(job_id)
        self.pump()
        self._released()

    def token_gap(self, job_id: str, gap_s: float) -> None:
        self._scheduler.on_token_gap(job_id, gap_s)

    def finished(self, job_id: str, output_tokens: int | None = None) -> None:
        """The job ended; ``output_tokens``, where the engine said how many it
        generated, settle its tenant's fair-share charge."""
        self._scheduler.on_finished(job_id, output_tokens)
        self.pump()
        self._released()

    def abandon(self, job_id: str) -> None:
        """The client left: forget the job wherever it is (a place held for it too)."""
        self._waiters.pop(job_id, None)
        self._scheduler.cancel(job_id)
        self.pump()
        self._released()

    def answering(self, job_id: str) -> None:
        """The engine began to answer ``job_id``: it is not aborted any more."""
        self._scheduler.on_answering(job_id)

    def failed(self, job_id: str, *, retry: bool) -> bool:
        """The engine failed the job; True if it is queued again for another engine."""
        requeued = self._scheduler.on_failed(job_id, retry=retry)
        if requeued:
            # Its handler waits again only after this returns; a dispatch before
            # then must find a waiter, or the job would be dropped as abandoned.
            self._hold_place(job_id)
        self.pump()
        return requeued

    # -- feedback from the engine monitor, discovery and the clock ---------------

    def set_engine_up(self, name: str, up: bool) -> None:
        self._scheduler.set_engine_up(name, up)
        self.pump()

    def set_engine_resting(self, name: str, resting: str) -> None:
        """Engine ``name`` on a card is awake (``""``) or at rest (see the scheduler's)."""
        self._scheduler.set_engine_resting(name, resting)
        self.pump()

    def observe_load(self, name: str, load: EngineLoad) -> None:
        self._scheduler.observe_load(name, load)
        self.pump()

    def set_engine_models(self, name: str, models: Iterable[str]) -> None:
        self._scheduler.set_engine_models(name, models)
        self.pump()

    def observe_others(self, name: str, others: ReplicaLoad) -> None:
        self._scheduler.observe_others(name, others)
        self.pump()

    def put_back(self, job_id: str, others: ReplicaLoad) -> bool:
        """The ledger refused the job's reservation: it is queued again (the caller
        waits with :meth:`readmit`); False if it is no longer in prefill."""
        put = self._scheduler.put_back(job_id, others)
        if put:
            self._hold_place(job_id)  # as in :meth:`failed`
        self.pump()
        return put

    def add_engine(self, config: EngineConfig) -> None:
        self._scheduler.add_engine(config)
        self.pump()

    def drain_engine(self, name: str) -> None:
        self._scheduler.drain_engine(name)
        self.pump()

    def remove_engine(self, name: str) -> bool:
        """Forget a drained engine once nothing runs on it; whether it is gone."""
        return self._scheduler.remove_engine(name)

    def set_piece_depth(self, engine: str, depth: int) -> None:
        """Pieces ``engine`` may hold in prefill at once (:mod:`proxy.scheduler.pieces`)."""
        self._scheduler.set_piece_depth(engine, depth)
        self.pump()

    def set_cache(self, engine: str, block_size: int | None, blocks: int | None) -> None:
        """``engine``'s KV cache: block size and size in blocks (its prefix index)."""
        self._scheduler.set_cache(engine, block_size, blocks)

    def follow_events(self, engine: str) -> None:
        """``engine``'s prefix index is kept from its KV-cache events from now on."""
        self._scheduler.follow_events(engine)

    def kv_events(self, engine: str, events: list[KVEvent]) -> None:
        """``engine``'s KV-cache events: its prefix index follows them; batch held
        there may cost less now."""
        self._scheduler.kv_events(engine, events)
        self.pump()

    def cached(self, job_id: str, reported: int) -> tuple[str, int] | None:
        """The engine answered that ``reported`` of ``job_id``'s prompt tokens were
        cached: the engine and what was expected there (None: unknown job)."""
        return self._scheduler.on_cached(job_id, reported)

    def tick(self) -> None:
        """Advance turn accounting and the budget loops, then dispatch what may go."""
        self._scheduler.tick()
        self.pump()

    # -- reads: never run the scheduler ------------------------------------------

    def now(self) -> float:
        return self._scheduler.clock.now()

    def abortable(self, job_id: str) -> bool:
        """Whether ``job_id`` may yet be aborted in prefill for a chat."""
        return self._scheduler.abortable(job_id)

    def knows(self, job_id: str) -> bool:
        """Whether a job of that id is queued, in flight or waiting for its turn."""
        return job_id in self._waiters or job_id in self._scheduler.jobs

    def models(self) -> list[str]:
        """Every model some engine serves, sorted."""
        return self._scheduler.models()

    def engines_up_for(self, model: str) -> list[str]:
        """The up engines serving ``model``, in configuration order."""
        return self._scheduler.engines_up_for(model)

    def engines_for(self, model: str) -> list[str]:
        """Every engine serving ``model``, up or not, in configuration order."""
        return self._scheduler.engines_for(model)

    def resting_for(self, model: str) -> list[str]:
        """The engines of ``model`` at rest on a card (its work waits for a wake)."""
        return self._scheduler.resting_for(model)

    def demand(self, model: str) -> Demand:
        """``model``'s work as a card's rule reads it (the batch side not included)."""
        return self._scheduler.demand(model)

    def in_flight(self, name: str) -> int:
        """Jobs in flight on engine ``name``."""
        return self._scheduler.in_flight(name)

    def engines_without_models(self) -> list[str]:
        return self._scheduler.engines_without_models()

    def least_uncached(self, model: str, tokens: int, blocks: tuple[int, ...]) -> int:
        """The fewest of a prompt's ``tokens`` (of ``blocks``) an up engine serving
        ``model`` would compute: the rest it holds or is computing now."""
        return self._scheduler.least_uncached(model, tokens, blocks)

    def block_size_for(self, model: str) -> int | None:
        """The block size ``model``'s prompts are hashed at for the prefix index."""
        return self._scheduler.block_size_for(model)

    def wants_blocks(self, model: str, cls: TrafficClass) -> bool:
        """Whether a request's prompt is worth tokenizing for the prefix index: by
        prefix, a batch request always (it is tokenized to be counted anyway, and
        it is charged what its engine must compute); a chat where more than one
        engine serves its model (a round trip before its turn, spent only where
        there is an engine to choose)."""
        scheduler = self._scheduler
        if scheduler.settings.route_by != "prefix":
            return False
        return cls is TrafficClass.BATCH or len(scheduler.engines_for(model)) > 1

    def interactive_streams(self, engine: str) -> int:
        """Interactive streams decoding on ``engine`` now."""
        return self._scheduler.engines[engine].decode_streams(TrafficClass.INTERACTIVE)

    def prefill_tokens(self, engine: str) -> int:
        """Prompt tokens in prefill on ``engine`` now, of every class."""
        return self._scheduler.engines[engine].prefill_tokens()

    def decode_streams(self, engine: str) -> int:
        """Streams decoding on ``engine`` now, of every class."""
        return self._scheduler.engines[engine].decode_streams()

    def pieces_in_prefill(self, engine: str) -> int:
        """Pieces of long batch prompts in prefill on ``engine`` now."""
        return pieces_in_prefill(self._scheduler.engines[engine].inflight.values())

    def widest_gap(self, engine: str, start: float, end: float) -> float | None:
        """The widest gap of an interactive stream on ``engine`` that ended after
        ``start`` and by ``end`` (None: none ended then)."""
        return max(self._scheduler.engines[engine].stream_gaps.between(start, end), default=None)

    def own_loads(self) -> dict[str, ReplicaLoad]:
        """This replica's load on each engine, for the shared ledger."""
        return self._scheduler.own_loads()

    def budget_tokens(self, engine: str) -> int:
        """``engine``'s batch prefill budget ``B`` now (0 for an engine it does not know)."""
        e = self._scheduler.engines.get(engine)
        return e.budget.tokens if e is not None else 0

    def reservation(self, job_id: str) -> Reservation | None:
        """What to reserve in the shared ledger before sending ``job_id`` (batch)."""
        return self._scheduler.reservation(job_id)

    def mark_reserved(self, job_id: str) -> None:
        self._scheduler.mark_reserved(job_id)

    def report(self) -> list[dict[str, Any]]:
        """Whose turn it is on each engine, and why (see :mod:`proxy.scheduler.turns`)."""
        return turn_report(self._scheduler)

    def turn_history(self, seconds: int) -> list[tuple[str, list[Second]]]:
        """Each engine's last ``seconds`` whole seconds of turns, in configuration order."""
        now = self.now()
        engines = self._scheduler.engines.items()
        return [(name, e.turn_history_at(now, seconds)) for name, e in engines]

    def chat_signs(self, engine: str) -> ChatSigns:
        """What is known of chat on engine ``engine`` (nothing, if there is no such
        engine), for the piecing choice. A read."""
        if engine not in self._scheduler.engines:
            return ChatSigns()
        return self._scheduler.chat_signs(engine)

    def budget_changes(self, limit: int) -> list[tuple[str, BudgetChange]]:
        """The ``limit`` most recent budget moves of all engines, oldest first, each
        with its engine's name."""
        moves = [(name, c) for name, e in self._scheduler.engines.items() for c in e.budget.changes]
        moves.sort(key=lambda m: m[1].time)
        return moves[-limit:] if limit > 0 else []

    def tenant_shares(self) -> list[TenantShare]:
        """Each active tenant's share of its class against what it is owed (a read)."""
        return self._scheduler.tenant_shares()

    def fairness(self, cls: TrafficClass) -> float | None:
        """Jain's index over the window for ``cls`` (None: fewer than two tenants waited)."""
        return self._scheduler.fairness(cls)

    def decisions(self, limit: int) -> list[Decision]:
        """The ``limit`` most recent scheduling decisions, oldest first."""
        return list(self._scheduler.log)[-limit:] if limit > 0 else []
