"""The proxy's scheduler: pure logic over an injected clock, no I/O.

The edge (HTTP handlers, upstream client) tells the scheduler what happens —
:meth:`Scheduler.submit`, :meth:`~Scheduler.on_first_token`,
:meth:`~Scheduler.on_token_gap`, :meth:`~Scheduler.on_finished`,
:meth:`~Scheduler.on_failed`, :meth:`~Scheduler.cancel`, engine health and load —
and asks :meth:`Scheduler.dispatch` what to send where. The rules:

- **Interactive first.** An interactive job goes at once to the engine with the
  least predicted wait for a first token (or its conversation's engine, if close),
  unless every engine for its model is at its hard concurrency cap or down.
- **Batch within the budget.** A batch job is dispatched to an engine only if no
  interactive job is in prefill on it, the engine has
  concurrency and KV headroom, and the prompt tokens in prefill there (all
  classes) plus its own stay within the engine's budget ``B``; one batch job may
  always run when nothing is in prefill. Batch jobs are taken in their queue's order
  per engine: a job held on an engine holds later ones there too, so a large prompt
  is never overtaken forever by small ones.
- **Tenants share each class fairly** (:mod:`proxy.scheduler.fair`): a queue's order
  is a tier's band, then a fair tag charged in tokens by weight, then arrival (with
  ``fair_share`` off: arrival alone); while several tenants send chats, one tenant
  holds at most an engine's budget in chat prefill there.
- **The budget loop judges what batch can cause**: the time from dispatch to first
  token of chats that shared their engine with batch prefill, and the token gaps of
  such streams (:mod:`proxy.scheduler.budget`).
- **Batch is never starved**: a chat in prefill longer than the hold timeout
  stops holding batch, and batch earns credit from the chat prompts sent while it
  waits, so it keeps a minimum share of each engine's prefill (:class:`HoldRules`).
- **Other proxy replicas** in front of the same engines are an input
  (:meth:`Scheduler.observe_others`): their batch prompt tokens in prefill on an
  engine count against its budget, and their interactive work holds batch there
  (docs/replicas.md). Engines may join and drain (:meth:`Scheduler.add_engine`,
  :meth:`~Scheduler.drain_engine`): a draining engine takes no new work.
- Each engine's turn and the reason batch is held are kept up to date after every
  event, and the time spent in each is accounted.
- **A batch job in prefill may be aborted for a chat** whose TTFT it puts at risk,
  if the edge marked it abortable (the final request of a pieced prompt), at most
  ``abort_limit`` times: :meth:`Scheduler.aborts_due` reads which
  (:mod:`proxy.scheduler.aborts`), :meth:`~Scheduler.abort` requeues it at the head
  of the batch queue, pinned to its engine.

What a decision costs: the queues are indexed by model (:mod:`proxy.scheduler.queue`),
so an engine's first batch job is the earliest head of the lines of the models it
serves, not the result of a scan. An event marks the engines whose turn it may change
(the engine a job went to or left, the engines whose first batch job changed, an
engine whose health, load or models changed); only those are re-evaluated after it,
and the others keep their turn and held reason, which is exactly what a fresh
evaluation would give. Time changes two inputs without an event: a chat in prefill
stops holding batch after the hold timeout (a heap of dispatch times, popped by the
same test :meth:`EngineState.holds_for_interactive` applies), and the budget loop runs
once per interval (the earliest time one is due is kept). The batch pass takes jobs in
arrival order as before, but reads the lines per model, stops reading a model once
every engine serving it is blocked, and takes an engine's refusal of its first job
from its turn unless the engine was marked. A chat whose engines all take it goes to
the least rank, read from a tournament tree per model kept up to date by the marks
(:class:`~proxy.scheduler.routing.LeastRank`), not from a walk over the engines.

Where each of these is kept by hand (here, in :mod:`~proxy.scheduler.queue` and in
:class:`~proxy.scheduler.state.EngineState`), a comment says what it saves on a row of
the scheduler figure (``python -m loadtests.bench.overhead_sched``, printed by ``make
bench``; "chat 64 x 10,000": 64 engines, 10,000 batch jobs submitted): p50 CPU µs with
it, and with a copy that works the same answer out from the primary state each time,
the two timed in turn in one process (docs/overhead.md). Each saves a tenth or more
on some row, but the engines whose turn holds nothing (``_unheld``), kept for what
they mean: a snapshot at each event's end, not the live reason.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from proxy.clock import Clock
from proxy.config import EngineConfig
from proxy.scheduler.aborts import (
    DEFAULT_ABORT_LIMIT,
    choose_abort,
    longest_waiting,
    may_abort,
)
from proxy.scheduler.fair import FairShare, TenantShare
from proxy.scheduler.pieces import ChatSigns
from proxy.scheduler.prefix import IndexMode, KVEvent
from proxy.scheduler.queue import JobQueue
from proxy.scheduler.residency import Demand
from proxy.scheduler.routing import AffinityMap, LeastRank, by_cost, pick_engine, with_affinity
from proxy.scheduler.state import EngineLoad, EngineState, EventTime, HoldRules, ReplicaLoad
from proxy.scheduler.types import (
    Abort,
    Decision,
    Dispatch,
    HeldReason,
    Job,
    Phase,
    Reservation,
    Route,
    TrafficClass,
    Turn,
)


@dataclass(frozen=True, kw_only=True)
class SchedulerSettings:
    """The scheduler's own knobs; ``hold`` says how interactive work holds batch
    (the hold timeout and the starvation bound, :class:`HoldRules`);
    ``abort_limit``: the most times one batch job is aborted in prefill for a chat
    (``batch_abort_max``)."""

    affinity_slack_tokens: int = 2048
    route_by: str = "prefix"  # prefix, affinity or load (proxy.scheduler.routing)
    decision_log_size: int = 1000
    abort_limit: int = DEFAULT_ABORT_LIMIT
    # within each class, tenants served by a token-counting fair queue (off: arrival
    # order, as before tenants); proxy.scheduler.fair
    fair_share: bool = True
    hold: HoldRules = dataclasses.field(default_factory=HoldRules)


# a batch job waits for its prefix being computed on an engine when that is at least
# this many blocks more than any engine holds (16 of 16 tokens: 256 tokens)
PREFIX_WAIT_BLOCKS = 16


class UnknownModel(LookupError):
    """No engine serves the job's model."""


class Scheduler:
    def __init__(
        self,
        engines: Sequence[EngineConfig],
        clock: Clock,
        settings: SchedulerSettings | None = None,
    ) -> None:
        self.clock = clock
        self.settings = settings or SchedulerSettings()
        now = clock.now()
        self._events = EventTime(now)
        self.engines = {
            e.name: EngineState(e, now, self.settings.hold, self._events) for e in engines
        }
        if len(self.engines) != len(engines):
            raise ValueError("engine names must be unique")
        self.queues: dict[TrafficClass, JobQueue] = {c: JobQueue() for c in TrafficClass}
        self.fair: dict[TrafficClass, FairShare] = {c: FairShare(c) for c in TrafficClass}
        self.jobs: dict[str, Job] = {}
        self.log: deque[Decision] = deque(maxlen=self.settings.decision_log_size)
        self.affinity = AffinityMap()
        # requests sent by why their engine was chosen (Route.why; metrics)
        self.route_counts: dict[str, int] = dict.fromkeys(("prefix", "load"), 0)
        # the engines of each model and their names, built again when engines change;
        # the names read off _by_model at each use instead: chat 64 x 10,000 23 µs, not 18
        self._by_model: dict[str, list[EngineState]] = {}
        self._names_by_model: dict[str, frozenset[str]] = {}
        # per model, its engines by rank; and each engine's rank as last given to them.
        # A min over the engines instead: chat 64 x 10,000 18 µs, not 16 (4 engines:
        # the same; batch done 64 x 10,000 5 % quicker without: the tree is kept at
        # each mark)
        self._least: dict[str, LeastRank] = {}
        self._ranked: dict[str, tuple[int, int, str]] = {}
        self._index_models()
        self._init_caches()

    def _init_caches(self) -> None:
        """The state the passes keep by hand between events, each as it starts."""
        # engines whose held reason was None at the end of the event that last marked
        # them (open to their first batch job, if any). Not a mere cache: read live
        # instead (held_reason is None at each batch pass), the first burst on real
        # vLLM took longer, makespan 1.47x / 1.50x of FCFS against 1.14x / 1.23x
        # (make test-e2e, test_e2e_first_burst, 2026-12-03): keep it as it is
        self._unheld: set[str] = set(self.engines)
        # the hold last logged for each queued job: a reason is logged once, when it
        # changes, even if the job's held reason was lifted in between (a budget grew)
        self._logged_hold: dict[str, HeldReason] = {}
        # engines that can take a chat now (up, under the cap), kept by _mark; asked of
        # each engine instead: chat 64 x 10,000 22 µs, not 17; cap 64 x 1,000 11, not 7
        self._takes = {n for n, e in self.engines.items() if e.can_take_interactive()}
        # engines whose turn an event may have changed: re-evaluated at its end. Every
        # engine re-evaluated at every event instead: chat 64 x 10,000 13 times as long,
        # chat 4 x 1,000 1.8 times
        self._dirty: set[str] = set(self.engines)
        # the refusals the batch pass read this event from marked engines, and of which
        # job (their first): the turn at the event's end reads them (see _turn_of).
        # Worked out again instead: batch done 64 x 10,000 239 µs, not 143 (4 x 10,000:
        # 35, not 29; a chat: 6 % more)
        self._refused: dict[str, tuple[Job, HeldReason | None]] = {}
        # dispatch times of chats sent (engine named): when each stops holding batch.
        # Each engine's chats in prefill looked over at each event instead: chat (pump)
        # 64 x 10,000 19 µs, not 17
        self._holds: list[tuple[float, str]] = []
        # no budget loop is due before this time; every engine's loop asked at every
        # event instead: chat 64 x 10,000 37 µs, not 16; cap 64 x 1,000 29, not 8
        self._budget_due = -math.inf
        # abortable batch jobs sent, in order (some may have left prefill since); the
        # work in flight walked at each aborts_due instead: chat (pump) 64 x 10,000
        # 51 µs, not 17 (4 x 10,000: 16 % more)
        self._abortable: dict[str, None] = {}
        # per model, the reason every queued chat of it was last held for together,
        # and the chats queued since (not yet held for it): see _hold_chats. Every
        # waiting chat held again at each decision instead: cap 64 x 10,000 about
        # 1,100 µs, not 8 (it grows with the chats waiting)
        self._chats_held_for: dict[str, HeldReason] = {}
        self._chats_fresh: dict[str, dict[str, Job]] = {}

    # -- intake ----------------------------------------------------------------

    def models(self) -> list[str]:
        return sorted({m for e in self.engines.values() for m in e.settings.models})

    def engines_up_for(self, model: str) -> list[str]:
        """The names of the up engines serving ``model`` (not draining), in
        configuration order."""
        return [
            e.name for e in self.engines.values() if e.up and not e.draining and e.serves(model)
        ]

    def engines_for(self, model: str) -> list[str]:
        """The names of every engine serving ``model``, up or not, in configuration order."""
        return [e.name for e in self.engines.values() if e.serves(model)]

    def engines_without_models(self) -> list[str]:
        """The engines that serve no model yet (not discovered at start)."""
        return [e.name for e in self.engines.values() if not e.settings.models]

    def _index_models(self) -> None:
        self._by_model = {}
        for e in self.engines.values():
            for model in e.settings.models:
                self._by_model.setdefault(model, []).append(e)
        self._names_by_model = {
            m: frozenset(e.name for e in es) for m, es in self._by_model.items()
        }
        self._least = {m: LeastRank(es) for m, es in self._by_model.items()}
        self._ranked = {n: e.rank for n, e in self.engines.items()}

    def submit(self, job: Job) -> None:
        """Queue a job; raises :class:`UnknownModel` if no engine serves its model."""
        if not self._by_model.get(job.model):
            raise UnknownModel(job.model)
        if job.id in self.jobs:
            raise ValueError(f"duplicate job id {job.id!r}")
        if self._resting_only(job.model):
            job.for_wake = True
        if job.pinned is not None:  # a piece: only where its prompt's first piece went
            job.excluded |= {e.name for e in self._by_model[job.model]} - {job.pinned}
        now = self._begin()
        self.jobs[job.id] = job
        queue = self.queues[job.cls]
        # last in line: the first batch job only of engines that had none of it
        if job.cls is TrafficClass.BATCH and (
            queue.first_of_model(job.model) is None or not queue.all_eligible(job.model)
        ):
            self._mark_model(job.model)
        tag = self.fair[job.cls].tag(job, now)
        if self.settings.fair_share:
            queue.append(job, job.tier.rank, tag)
        else:
            queue.append(job)
        self._queued_chat(job)
        self._end(now)

    def _resting_only(self, model: str) -> bool:
        """Whether every engine of ``model`` is at rest on a card (none awake)."""
        engines = self._by_model.get(model, ())
        return bool(engines) and all(e.resting for e in engines)

    def cancel(self, job_id: str, output_tokens: int | None = None) -> Job | None:
        """Forget a job wherever it is (queued or in flight); None if unknown."""
        now = self._begin()
        job = self._remove(job_id, now, output_tokens)
        self._end(now)
        return job

    def _remove(self, job_id: str, now: float, output_tokens: int | None) -> Job | None:
        job = self.jobs.pop(job_id, None)
        if job is None:
            return None
        self.fair[job.cls].left(job, now, output_tokens)
        self._logged_hold.pop(job_id, None)
        self._abortable.pop(job_id, None)
        if job.phase is Phase.QUEUED:
            self._unqueue(job)
        elif job.engine is not None:
            self.engines[job.engine].release(job.id)
            self._mark(job.engine)
        job.phase = Phase.DONE
        return job

    def _unqueue(self, job: Job) -> None:
        """Take a queued job out of its queue, marking the engines it was first for."""
        queue = self.queues[job.cls]
        if job.cls is TrafficClass.BATCH and (
            queue.first_of_model(job.model) is job or not queue.all_eligible(job.model)
        ):
            self._mark_model(job.model, job)
        queue.remove(job)
        if job.cls is TrafficClass.INTERACTIVE:
            self._chats_fresh.get(job.model, {}).pop(job.id, None)

    def _requeue(self, job: Job) -> None:
        """Put ``job`` back at the head of its class's queue."""
        self.queues[job.cls].appendleft(job)
        self._queued_chat(job)

    def _queued_chat(self, job: Job) -> None:
        if job.cls is TrafficClass.INTERACTIVE:
            fresh = self._chats_fresh.get(job.model)
            if fresh is None:  # (not setdefault: it would make a dict per call)
                fresh = self._chats_fresh[job.model] = {}
            fresh[job.id] = job

    def _mark_model(self, model: str, job: Job | None = None) -> None:
        """Mark the engines serving ``model`` (those ``job`` may go to)."""
        for e in self._by_model.get(model, ()):
            if job is None or e.name not in job.excluded:
                self._mark(e.name)

    def _mark(self, name: str) -> None:
        """An event may have changed engine ``name``'s turn: re-evaluate it at the
        event's end; whether it can take a chat and its rank are read again now (every
        change to an engine's work in flight is followed by a mark)."""
        self._dirty.add(name)
        self._refused.pop(name, None)
        engine = self.engines[name]
        if engine.can_take_interactive():
            self._takes.add(name)
        else:
            self._takes.discard(name)
        if engine.rank is not self._ranked.get(name):
            self._ranked[name] = engine.rank
            for model in engine.settings.models:
                self._least[model].moved(engine)

    # -- decisions -------------------------------------------------------------

    def dispatch(self) -> list[Dispatch]:
        """Decide what to send where now; the jobs returned are marked in flight."""
        now = self._begin()
        out = self._dispatch_interactive(now)
        out += self._dispatch_batch(now)
        self._end(now)
        return out

    def _candidates(self, job: Job) -> list[EngineState]:
        engines = self._by_model.get(job.model, ())
        if not job.excluded:
            return list(engines)
        return [e for e in engines if e.name not in job.excluded]

    def _dispatch_interactive(self, now: float) -> list[Dispatch]:
        """Chats in arrival order, each to the engine with the least predicted wait
        among those of its model that take a chat now; the others are held.

        Where every queued chat may go to any engine of its model (none has failed
        somewhere), the chats of one model have the same candidates: the pass reads
        each model's line from its head, and once no engine of a model takes a
        chat, every chat left in its line is held for the same reason
        (:meth:`_hold_chats`, which touches only the chats queued since the line was
        last held for that reason). So a decision at the cap costs the chats
        dispatched and the chats newly queued, not every chat waiting. A chat that
        must skip some engine is judged on its own candidates (:meth:`_each_chat`)."""
        queue = self.queues[TrafficClass.INTERACTIVE]
        if not len(queue):
            return []
        if self.settings.fair_share and self.fair[TrafficClass.INTERACTIVE].several_active(now):
            self._chats_held_for.clear()  # held one by one: judged whole next time
            return self._fair_chats(now)
        if not queue.none_excluding():
            self._chats_held_for.clear()  # held one by one: judged whole next time
            return self._each_chat(now)
        out: list[Dispatch] = []
        live = dict.fromkeys(queue.models())
        takes = self._takes
        while live:
            job = queue.earliest_first(live)
            assert job is not None  # a model stays live while it has a chat queued
            model = job.model
            chosen = self._chat_engine(job, takes)
            if chosen is None:
                self._hold_chats(now, model, self._by_model.get(model, []))
                del live[model]
                continue
            out.append(self._send(now, job, *chosen))
            if queue.first_of_model(model) is None:
                del live[model]
        return out

    def _chat_engine(self, job: Job, takes: set[str]) -> tuple[EngineState, Route | None] | None:
        """The engine for ``job`` among those of its model that take a chat now
        (``takes``), and why, where a receipt is kept; None if none does."""
        engines = self._by_model.get(job.model, [])
        names = self._names_by_model.get(job.model, frozenset())
        every = bool(engines) and (len(takes) == len(self.engines) or names <= takes)
        if job.blocks and self.settings.route_by == "prefix":
            ready = engines if every else [e for e in engines if e.name in takes]
            if not ready:
                return None
            return by_cost(ready, job)
        preferred = self._preferred(job)
        slack = self.settings.affinity_slack_tokens
        if every:
            # every engine of the model takes a chat: the least rank is indexed
            other = self.engines[preferred] if preferred in names else None
            return with_affinity(self._least[job.model].least(), other, job, slack), None
        ready = [e for e in engines if e.name in takes]
        return (pick_engine(ready, job, preferred, slack), None) if ready else None

    def _preferred(self, job: Job) -> str | None:
        """The conversation's engine, unless the engine is chosen by load alone."""
        return None if self.settings.route_by == "load" else self.affinity.get(job.affinity)

    def _hold_chats(self, now: float, model: str, engines: list[EngineState]) -> None:
        """No engine of ``model`` takes a chat: hold every chat queued for it, for
        the reason the pass gives one (any engine of it up: the cap; none: the
        engines are unhealthy). Chats held for that reason already are skipped."""
        reason = _chat_held(engines)
        fresh = self._chats_fresh.pop(model, {})
        if self._chats_held_for.get(model) is reason:
            jobs: Iterable[Job] = fresh.values()
        else:
            jobs = list(self.queues[TrafficClass.INTERACTIVE].of_model(model))
            self._chats_held_for[model] = reason
        for job in jobs:
            self._hold(now, job, engines, reason)

    def _each_chat(self, now: float) -> list[Dispatch]:
        """The interactive pass chat by chat, each on its own candidates."""
        out: list[Dispatch] = []
        for job in list(self.queues[TrafficClass.INTERACTIVE]):
            names = self._names_by_model.get(job.model, frozenset())
            takes = self._takes
            ready: list[EngineState]
            if not job.excluded and names <= takes:
                ready = self._by_model.get(job.model, [])
            else:
                ready = [e for e in self._candidates(job) if e.name in takes]
            if not ready:
                candidates = self._candidates(job)
                self._hold(now, job, candidates, _chat_held(candidates))
                continue
            if job.blocks and self.settings.route_by == "prefix":
                out.append(self._send(now, job, *by_cost(ready, job)))
                continue
            preferred = self._preferred(job)
            engine = pick_engine(ready, job, preferred, self.settings.affinity_slack_tokens)
            out.append(self._send(now, job, engine))
        return out

    def _fair_chats(self, now: float) -> list[Dispatch]:
        """The interactive pass while several tenants send chats: chat by chat in
        fair order, each to an engine where its tenant holds less than the engine's
        budget in chat prefill (:mod:`proxy.scheduler.fair`); a chat with none is
        held (``tenant_share``), and so are its tenant's later chats of the model."""
        out: list[Dispatch] = []
        full: set[tuple[str, str]] = set()  # (tenant, model) at its share everywhere
        slack = self.settings.affinity_slack_tokens
        for job in list(self.queues[TrafficClass.INTERACTIVE]):
            candidates = self._candidates(job)
            if (job.tenant, job.model) in full and not job.excluded:
                self._hold(now, job, candidates, HeldReason.TENANT_SHARE)
                continue
            ready = [e for e in candidates if e.name in self._takes]
            if not ready:
                self._hold(now, job, candidates, _chat_held(candidates))
                continue
            room = [e for e in ready if _tenant_room(e, job)]
            if not room:
                if not job.excluded:
                    full.add((job.tenant, job.model))
                self._hold(now, job, ready, HeldReason.TENANT_SHARE)
                continue
            if job.blocks and self.settings.route_by == "prefix":
                out.append(self._send(now, job, *by_cost(room, job)))
                continue
            engine = pick_engine(room, job, self._preferred(job), slack)
            out.append(self._send(now, job, engine))
        return out

    def _dispatch_batch(self, now: float) -> list[Dispatch]:
        """Batch jobs in arrival order: each goes to the open engine with the least in
        prefill, or is held on its first engine's reason, its engines then blocked for
        the rest of the pass (a job held on an engine holds later ones there too).

        Each model's line is read from its head; the jobs left in it (held, or with
        no engine left for them) are counted in ``kept``, and a model is dropped once
        every engine serving it is blocked. An engine unmarked since the last event's
        end refuses its first job for the reason its turn names (the job a pass asks
        an engine about is always its first), so only marked engines are asked."""
        out: list[Dispatch] = []
        blocked: set[str] = set()
        queue = self.queues[TrafficClass.BATCH]
        kept = dict.fromkeys(queue.models(), 0)
        while kept:
            picked = _earliest_kept(queue, kept)
            if picked is None:
                break
            job, model = picked
            if job.blocks and self._prefix_coming(job):
                kept[model] += 1  # waits for its prefix, holding no engine
                continue
            excluded = job.excluded
            first = self._first_unblocked(model, blocked, excluded)
            if first is None:
                kept[model] += 1
                if not excluded:
                    del kept[model]  # every engine serving the model is blocked
                continue
            best, reason, route = self._ask_batch(job, model, first, blocked)
            if best is not None:
                out.append(self._send(now, job, best, route))
                continue
            assert reason is not None
            self._hold(now, job, (first,), reason)
            kept[model] += 1
            if not excluded:
                del kept[model]
            if kept:  # (the last model read: no job is left for the engines it blocks)
                names = self._names_by_model[model]
                blocked |= names - excluded if excluded else names
        return out

    def _prefix_coming(self, job: Job) -> bool:
        """Whether more of batch job ``job``'s prompt is being computed on an engine
        now than any engine holds (by at least ``PREFIX_WAIT_BLOCKS``): sent now, it
        would compute that part again beside the prompt computing it; a moment
        later it finds it cached (routing by prefix only; chat never waits)."""
        if self.settings.route_by != "prefix":
            return False
        ready, coming = self._most_held(job.model, job.blocks)
        return coming - ready >= PREFIX_WAIT_BLOCKS

    def _most_held(self, model: str, blocks: tuple[int, ...]) -> tuple[int, int]:
        """The most of ``blocks`` an up engine serving ``model`` holds, and the most
        it holds or is computing now. (``blocks`` are hashed at the model's block
        size: an engine of another size matches none of them, so counts in blocks
        compare across engines.)"""
        ready = coming = 0
        for e in self._by_model.get(model, ()):
            if e.up and not e.draining and e.prefix.holds_first(blocks):
                coming = max(coming, e.prefix.match(blocks, pending=True))
                ready = max(ready, e.prefix.match(blocks))
        return ready, coming

    def _first_unblocked(
        self, model: str, blocked: set[str], excluded: set[str]
    ) -> EngineState | None:
        """The first engine serving ``model`` neither blocked nor excluded."""
        engines = self._by_model.get(model, ())
        if blocked or excluded:
            return next(
                (e for e in engines if e.name not in blocked and e.name not in excluded), None
            )
        return engines[0] if engines else None

    def _ask_batch(
        self, job: Job, model: str, first: EngineState, blocked: set[str]
    ) -> tuple[EngineState | None, HeldReason | None, Route | None]:
        """Of the engines of ``model`` asked about ``job``, the open one of least rank
        (None: none is open), or by prefix the open one where it costs least
        (:func:`~proxy.scheduler.routing.by_cost`, with its receipt); and why
        ``first`` refuses it (its turn's reason if not asked). A marked engine's
        refusal is kept for the turn at the event's end.

        The candidates are the model's engines neither blocked nor excluded; of
        those, only marked ones and ones whose turn holds nothing may be open."""
        dirty = self._dirty
        names = self._names_by_model[model]
        asked = (dirty & names) | (self._unheld & names)
        asked -= blocked
        asked -= job.excluded
        reason = first.held_reason
        best: EngineState | None = None
        by_prefix = bool(job.blocks) and self.settings.route_by == "prefix"
        open_: list[EngineState] = []
        for n in asked:
            e, r = self.engines[n], None
            if n in dirty:
                r = e.batch_refusal(job)
                self._refused[n] = (job, r)
            if e is first:
                reason = r
            if r is None:
                if by_prefix:
                    open_.append(e)
                if best is None or e.rank < best.rank:
                    best = e
        if len(open_) > 1:
            chosen, route = by_cost(open_, job, compute_first=True)
            return chosen, reason, route
        return best, reason, None

    def _send(
        self, now: float, job: Job, engine: EngineState, route: Route | None = None
    ) -> Dispatch:
        self._unqueue(job)
        job.cached_tokens = engine.cached_tokens(job)  # before admit: what it is charged
        job.phase = Phase.PREFILL
        job.engine = engine.name
        job.dispatched_at = now
        job.held = None
        self._logged_hold.pop(job.id, None)
        job.reserved = False  # a reservation is for one engine and one dispatch
        self.fair[job.cls].dispatched(job, now)
        _mark_beside_batch(engine, job)
        engine.record_dispatch(job, self._head_batch_job(engine) is not None)
        engine.admit(job)
        self._mark(engine.name)
        if job.cls is TrafficClass.INTERACTIVE:
            heapq.heappush(self._holds, (now, engine.name))
        elif may_abort(job, self.settings.abort_limit):
            self._abortable[job.id] = None
        self.affinity.remember(job.affinity, engine.name)
        if route is not None:
            self.route_counts[route.why] += 1
        self._log(now, engine.name, job, True, None, route=route)
        return Dispatch(job, engine.name, job.attempts, now)

    def _hold(
        self, now: float, job: Job, engines: Iterable[EngineState], reason: HeldReason
    ) -> None:
        job.held = reason
        if self._logged_hold.get(job.id) is reason:
            return
        self.fair[job.cls].held(job, now)
        self._logged_hold[job.id] = reason
        first = next(iter(engines), None)
        if first is not None:
            self._log(now, first.name, job, False, reason)

    def _log(
        self,
        now: float,
        engine: str,
        job: Job,
        admitted: bool,
        r: HeldReason | None,
        abort: Abort | None = None,
        route: Route | None = None,
    ) -> None:
        budget = self.engines[engine].budget.tokens
        decision = Decision(
            now, engine, job.id, job.cls, admitted, r, budget, job.piece, abort, route, job.tenant
        )
        self.log.append(decision)

    # -- aborting batch prefill for a chat (proxy.scheduler.aborts) --------------

    def aborts_due(self) -> list[Abort]:
        """The batch jobs to abort now, at most one per engine, in configuration
        order (a read: nothing changes until :meth:`abort`)."""
        if not self._abortable:
            return []
        limit = self.settings.abort_limit
        names = {
            j.engine for i in self._abortable if (j := self.jobs.get(i)) and may_abort(j, limit)
        }
        if not names:
            return []
        now = self.clock.now()
        asked = [e for n, e in self.engines.items() if n in names]
        longest = longest_waiting(self.queues[TrafficClass.INTERACTIVE], asked)
        out: list[Abort] = []
        for engine in asked:
            waiting = engine.chats_in_prefill()
            if (queued := longest.get(engine.name)) is not None:
                waiting.append(queued)  # the only queued chat the rule can pick there
            abort = choose_abort(engine, waiting, now, limit)
            if abort is not None:
                out.append(abort)
        return out

    def abort(self, abort: Abort) -> bool:
        """Apply ``abort`` (from :meth:`aborts_due`, the edge having cancelled the
        job's upstream request): the job goes back to the head of the batch queue,
        pinned to its engine (what it computed is cached there), and the decision is
        logged; whether it was (False: no longer in prefill there)."""
        job = self.jobs.get(abort.job_id)
        if job is None or job.engine != abort.engine or job.phase is not Phase.PREFILL:
            return False
        now = self._begin()
        engine = self.engines[abort.engine]
        engine.release(job.id)
        self._mark(engine.name)
        self._abortable.pop(job.id, None)
        job.aborts += 1
        if job.pinned is None:  # a whole request: its computed blocks are cached there
            job.pinned = engine.name
            job.excluded |= self._names_by_model.get(job.model, frozenset()) - {engine.name}
        job.phase, job.engine, job.dispatched_at = Phase.QUEUED, None, None
        self._requeue(job)
        self._mark_model(job.model, job)
        self._log(now, engine.name, job, False, None, abort)
        self._end(now)
        return True

    def abortable(self, job_id: str) -> bool:
        """Whether ``job_id`` may yet be aborted in prefill for a chat
        (:func:`~proxy.scheduler.aborts.may_abort`). A read."""
        job = self.jobs.get(job_id)
        return job is not None and may_abort(job, self.settings.abort_limit)

    def on_answering(self, job_id: str) -> None:
        """The engine began to answer ``job_id`` (a byte may reach its client): it is
        never aborted from now on."""
        job = self.jobs.get(job_id)
        if job is not None:
            job.abortable = False
            self._abortable.pop(job_id, None)

    # -- feedback --------------------------------------------------------------

    def on_first_token(self, job_id: str) -> None:
        job = self.jobs.get(job_id)
        if job is None or job.phase is not Phase.PREFILL or job.engine is None:
            return
        now = self._begin()
        self.engines[job.engine].start_decode(job)
        self._mark(job.engine)
        self._abortable.pop(job.id, None)
        job.first_token_at = now
        if job.beside_batch and job.dispatched_at is not None:
            # engine-side: the proxy's own queue and the cap are not batch's doing
            self.engines[job.engine].budget.observe_ttft(now, now - job.dispatched_at)
        self._end(now)

    def on_token_gap(self, job_id: str, gap_s: float) -> None:
        """An interactive stream's gap between two tokens; only streams that shared
        their engine with batch prefill feed the budget loop (batch gaps never)."""
        job = self.jobs.get(job_id)
        if job is None or job.engine is None or job.cls is not TrafficClass.INTERACTIVE:
            return
        engine, now = self.engines[job.engine], self.clock.now()
        engine.stream_gaps.add(now, gap_s)
        if job.beside_batch:
            engine.budget.observe_gap(now, gap_s)

    def on_finished(self, job_id: str, output_tokens: int | None = None) -> Job | None:
        """The job ended: it leaves; ``output_tokens`` (the engine's count, where it
        said) settle its tenant's fair-share charge (:mod:`proxy.scheduler.fair`)."""
        return self.cancel(job_id, output_tokens)

    def on_failed(self, job_id: str, *, retry: bool) -> bool:
        """The engine failed the job. With ``retry`` (no byte reached the client yet),
        it goes back to the head of its queue, never again to the same engine, if
        another engine serves its model; returns whether it was requeued."""
        job = self.jobs.get(job_id)
        if job is None or job.engine is None:
            return False  # not in flight: unknown, or already requeued by a first report
        now = self._begin()
        self.engines[job.engine].release(job.id)
        self._mark(job.engine)
        self._abortable.pop(job.id, None)
        if job.pinned is not None:  # a pieced prompt's cache is lost with its engine
            job.pinned, job.excluded, job.abortable = None, set(), False
        job.excluded.add(job.engine)
        others = [e for e in self._candidates(job) if e.up]
        requeued = retry and bool(others)
        if requeued:
            job.phase, job.engine, job.dispatched_at = Phase.QUEUED, None, None
            job.attempts += 1
            self._requeue(job)
            if job.cls is TrafficClass.BATCH:
                self._mark_model(job.model, job)
        else:
            del self.jobs[job.id]
            job.phase = Phase.DONE
            self.fair[job.cls].left(job, now, None)
        self._end(now)
        return requeued

    # -- tenants (proxy.scheduler.fair) ---------------------------------------------

    def tenant_shares(self) -> list[TenantShare]:
        """Every tenant active in the window, per class: what it was served against
        what it is owed, and its jobs queued and in flight (a read)."""
        now = self.clock.now()
        out: list[TenantShare] = []
        for cls in TrafficClass:
            queued, in_flight = self._tenant_counts(cls)
            out += self.fair[cls].shares(now, queued, in_flight)
        return out

    def fairness(self, cls: TrafficClass) -> float | None:
        """Jain's index over the window of the tenants of ``cls`` that waited
        (:meth:`proxy.scheduler.fair.FairShare.fairness`); None with fewer than two."""
        return self.fair[cls].fairness(self.clock.now(), self._tenant_counts(cls)[0])

    def _tenant_counts(self, cls: TrafficClass) -> tuple[dict[str, int], dict[str, int]]:
        queued: dict[str, int] = {}
        in_flight: dict[str, int] = {}
        for job in self.jobs.values():
            if job.cls is cls:
                counts = queued if job.phase is Phase.QUEUED else in_flight
                counts[job.tenant] = counts.get(job.tenant, 0) + 1
        return queued, in_flight

    def chat_signs(self, name: str) -> ChatSigns:
        """What is known of chat on engine ``name``, for the piecing choice (a read)."""
        engine = self.engines[name]
        queued = self.queues[TrafficClass.INTERACTIVE].count_for(name, engine.settings.models)
        return ChatSigns(
            streams=engine.decode_streams(TrafficClass.INTERACTIVE),
            in_prefill=len(engine.chats_in_prefill()),
            queued=queued,
            last_at=engine.last_chat_at,
            missed_at=engine.budget.missed_at,
        )

    def set_piece_depth(self, name: str, depth: int) -> None:
        """Pieces engine ``name`` may hold in prefill at once (one while its own
        chunking is being judged: :mod:`proxy.scheduler.pieces`)."""
        if name in self.engines and self.engines[name].piece_depth != depth:
            with self._changing(name) as engine:
                engine.piece_depth = depth

    # -- prefix caches (proxy.scheduler.prefix) ---------------------------------

    def set_cache(self, name: str, block_size: int | None, blocks: int | None) -> None:
        """Engine ``name``'s KV cache: its block size and its size in blocks (None:
        unsaid, kept as they are). A new block size empties its index."""
        engine = self.engines.get(name)
        if engine is None:
            return
        index = engine.prefix
        if block_size and block_size != index.block_size:
            index.block_size = block_size
            index.clear()
        if blocks:
            index.resize(blocks)

    def follow_events(self, name: str) -> None:
        """Engine ``name``'s index is kept from its KV-cache events from now on."""
        engine = self.engines.get(name)
        if engine is not None and engine.prefix.mode is not IndexMode.EVENTS:
            engine.prefix.mode = IndexMode.EVENTS
            engine.prefix.clear()

    def least_uncached(self, model: str, tokens: int, blocks: tuple[int, ...]) -> int:
        """The fewest of a prompt's ``tokens`` (of ``blocks``) an up engine serving
        ``model`` would compute, counting blocks being computed there (a read)."""
        size = self.block_size_for(model)
        if not blocks or size is None:
            return tokens
        _, coming = self._most_held(model, blocks)
        return tokens - min(coming * size, tokens - 1)

    def block_size_for(self, model: str) -> int | None:
        """The block size prompts of ``model`` are hashed at (its first engine's);
        None if no engine serves it."""
        engines = self._by_model.get(model)
        return engines[0].prefix.block_size if engines else None

    def kv_events(self, name: str, events: list[KVEvent]) -> None:
        """Engine ``name`` published KV-cache events: its index follows them, and
        its batch refusals are asked again (what a job costs there changed)."""
        engine = self.engines.get(name)
        if engine is None or not events:
            return
        now = self._begin()
        engine.prefix.apply(events)
        self._mark(name)
        self._end(now)

    def on_cached(self, job_id: str, reported: int) -> tuple[str, int] | None:
        """Job ``job_id``'s engine answered that ``reported`` of its prompt tokens were
        found in its prefix cache: an index kept from routing learns from it. The
        engine and the cached tokens expected there; None if unknown."""
        job = self.jobs.get(job_id)
        if job is None or job.engine is None or job.engine not in self.engines:
            return None
        index = self.engines[job.engine].prefix
        if job.blocks and index.mode is IndexMode.ROUTED:
            size = index.block_size
            index.answered(job.blocks, job.cached_tokens // size, reported // size)
        return job.engine, job.cached_tokens

    def set_engine_models(self, name: str, models: Iterable[str]) -> None:
        """Replace the models an engine serves (found by discovery)."""
        now = self._begin()
        engine = self.engines[name]
        engine.settings = dataclasses.replace(engine.settings, models=tuple(models))
        self._index_models()
        for name in self.engines:
            self._mark(name)
        self._end(now)

    def set_engine_resting(self, name: str, resting: str) -> None:
        """Engine ``name`` on a card is awake (``""``), ``draining`` for a swap,
        ``asleep`` or ``waking`` (:mod:`proxy.scheduler.residency`): at rest it takes
        no new work and its model's queued work waits for it."""
        with self._changing(name) as engine:
            engine.resting = resting
            engine.draining = bool(resting)

    def resting_for(self, model: str) -> list[str]:
        """The engines of ``model`` at rest on a card, to be woken for its work (a read)."""
        return [e.name for e in self._by_model.get(model, ()) if e.resting]

    def demand(self, model: str) -> Demand:
        """``model``'s work as the card's rule reads it (:func:`residency.decide`): its
        chats queued (the oldest's arrival) and in flight, its last chat seen, its
        batch jobs queued (the batch deadline and card time are the batch runner's to
        add). A read."""
        chats = self.queues[TrafficClass.INTERACTIVE]
        waiting = chats.count_of_model(model)
        oldest = min((j.arrival for j in chats.of_model(model)), default=None)
        engines = self._by_model.get(model, ())
        in_flight = sum(e.count(TrafficClass.INTERACTIVE) for e in engines)
        seen = [e.last_chat_at for e in engines if e.last_chat_at is not None]
        newest = max((j.arrival for j in chats.of_model(model)), default=None)
        if newest is not None:
            seen.append(newest)
        return Demand(
            chat_waiting=waiting,
            chat_oldest=oldest,
            chat_in_flight=in_flight,
            last_chat=max(seen, default=None),
            batch_waiting=self.queues[TrafficClass.BATCH].count_of_model(model),
        )

    def queued_of(self, model: str) -> list[str]:
        """The ids of ``model``'s queued jobs, both classes (a read)."""
        return [j.id for q in self.queues.values() for j in q.of_model(model)]

    def in_flight(self, name: str) -> int:
        """Jobs in flight on engine ``name`` (a read)."""
        return len(self.engines[name].inflight)

    def set_engine_up(self, name: str, up: bool) -> None:
        with self._changing(name) as engine:
            engine.up = up

    def observe_load(self, name: str, load: EngineLoad) -> None:
        with self._changing(name) as engine:
            engine.load = load

    def observe_others(self, name: str, others: ReplicaLoad) -> None:
        """What the other proxy replicas do on engine ``name`` (docs/replicas.md)."""
        with self._changing(name) as engine:
            engine.others = others

    @contextmanager
    def _changing(self, name: str) -> Iterator[EngineState]:
        """An event that changes engine ``name``'s own state: the engine, to change;
        then it is marked and the event ends."""
        now = self._begin()
        yield self.engines[name]
        self._mark(name)
        self._end(now)

    # -- several replicas, one budget (docs/replicas.md) -------------------------

    def own_loads(self) -> dict[str, ReplicaLoad]:
        """This replica's load on each engine, to publish in the shared ledger: its
        reserved batch prompt tokens in prefill there (every batch job sent was
        reserved first), and whether its interactive work is in prefill there
        (within the hold timeout) or queued for it (a read)."""
        queued = self.queues[TrafficClass.INTERACTIVE]
        return {
            e.name: ReplicaLoad(
                _reserved_tokens(e),
                e.interactive_holding() or any(e.eligible(j) for j in queued),
            )
            for e in self.engines.values()
        }

    def reservation(self, job_id: str) -> Reservation | None:
        """What to reserve for batch job ``job_id``, just dispatched; None for any
        other job (interactive work never waits on the ledger) (a read)."""
        job = self.jobs.get(job_id)
        if job is None or job.cls is not TrafficClass.BATCH or job.engine is None:
            return None
        if job.phase is not Phase.PREFILL:
            return None
        e = self.engines[job.engine]
        # dispatched while interactive work held the engine: on starvation credit
        holding = e.interactive_holding() or e.others.hold_for_interactive
        beside = holding and e.rules.interactive_hold
        tokens = job.uncached_tokens
        in_prefill = _reserved_tokens(e) + tokens
        return Reservation(job.id, e.name, tokens, in_prefill, e.budget.tokens, beside)

    def mark_reserved(self, job_id: str) -> None:
        """The ledger granted ``job_id``'s reservation: its tokens count in what this
        replica publishes and in its next reservations."""
        job = self.jobs.get(job_id)
        if job is not None:
            job.reserved = True

    def put_back(self, job_id: str, others: ReplicaLoad) -> bool:
        """The ledger refused the reservation of a dispatched batch job: it goes back
        to the head of its queue (any engine may take it again, none is excluded),
        and the engine's view of the other replicas becomes ``others``; whether it
        was put back (False: no longer in prefill)."""
        job = self.jobs.get(job_id)
        if job is None or job.phase is not Phase.PREFILL or job.engine is None:
            return False
        now = self._begin()
        engine = self.engines[job.engine]
        engine.release(job.id)
        self._abortable.pop(job.id, None)
        engine.batch_credit += job.prompt_tokens if job.cls is TrafficClass.BATCH else 0
        engine.others = others
        self._mark(engine.name)
        job.phase, job.engine, job.dispatched_at = Phase.QUEUED, None, None
        self._requeue(job)
        self._mark_model(job.model, job)
        self._end(now)
        return True

    # -- engines that join and leave (DNS discovery) ---------------------------

    def add_engine(self, config: EngineConfig) -> None:
        """An engine joins; one that was draining takes new work again."""
        now = self._begin()
        engine = self.engines.get(config.name)
        if engine is None:
            self.engines[config.name] = EngineState(config, now, self.settings.hold, self._events)
            self._index_models()
            self._unheld.add(config.name)
        else:
            engine.draining = False
        self._mark(config.name)
        self._end(now)

    def drain_engine(self, name: str) -> None:
        """An engine leaves: it gets no new work; work in flight there finishes, and
        queued work goes to the other engines of its model."""
        with self._changing(name) as engine:
            engine.draining = True

    def remove_engine(self, name: str) -> bool:
        """Forget a draining engine once nothing runs on it; whether it is gone."""
        engine = self.engines.get(name)
        if engine is None:
            return True
        if not engine.draining or engine.inflight:
            return False
        now = self._begin()
        del self.engines[name]
        self._index_models()
        self._dirty.discard(name)
        self._unheld.discard(name)
        self._takes.discard(name)
        self._end(now)
        return True

    def tick(self) -> None:
        """Advance accounting and the budget loops to now (call it periodically).
        Every engine is brought up to date and re-evaluated."""
        now = self._begin()
        for engine in self.engines.values():
            engine.account(now)
        for name in self.engines:
            self._mark(name)
        self._end(now)

    # -- turns -----------------------------------------------------------------

    def _begin(self) -> float:
        now = self.clock.now()
        self._events.advance(now)
        # chats that stopped holding batch since: the same test as holds_for_interactive
        holds, timeout = self._holds, self.settings.hold.hold_timeout_s
        while holds and not self._events.now - holds[0][0] < timeout:
            name = heapq.heappop(holds)[1]
            if name in self.engines:  # not an engine that left since
                self._mark(name)
        return now

    def _end(self, now: float) -> None:
        dirty = self._dirty
        grown: set[str] = set()
        if now >= self._budget_due - 1e-6:
            # some budget loop may be due: each runs on the turn as it stands
            due = math.inf
            for engine in self.engines.values():
                budget = engine.budget
                if budget.due(now):
                    fresh = engine.name in dirty
                    reason = self._turn_of(engine)[1] if fresh else engine.held_reason
                    before = budget.tokens
                    budget.update(now, batch_waiting=reason is HeldReason.PREFILL_BUDGET)
                    if budget.tokens != before:
                        dirty.add(engine.name)
                        self._refused.pop(engine.name, None)
                    if budget.tokens > before:
                        grown.add(engine.name)
                due = min(due, budget.next_due())
            self._budget_due = due
        # on the budget as it now stands: one that just grew may admit the held
        # job at the next dispatch, and the turn says so already
        for name in dirty:
            engine = self.engines[name]
            engine.set_turn(now, *self._turn_of(engine))
            if engine.held_reason is None:
                self._unheld.add(name)
                if name in grown:
                    self._clear_stale_hold(engine)
            else:
                self._unheld.discard(name)
        dirty.clear()
        self._refused.clear()

    def _clear_stale_hold(self, engine: EngineState) -> None:
        """A budget that grew at the end of an event frees the job it held: the job no
        longer carries that reason, so it and its first engine's turn agree."""
        head = self._head_batch_job(engine)
        if head is None or head.held is not HeldReason.PREFILL_BUDGET:
            return
        first = next((e for e in self._candidates(head) if e.eligible(head)), None)
        if first is engine:
            head.held = None

    def _head_batch_job(self, engine: EngineState) -> Job | None:
        return self.queues[TrafficClass.BATCH].first_for(engine.name, engine.settings.models)

    def _turn_of(self, engine: EngineState) -> tuple[Turn, HeldReason | None]:
        """The engine's turn, and why its first batch job is held: exactly what
        :meth:`EngineState.batch_refusal` says of that job (an interactive job still
        queued is one every engine of its model refused: they are saturated).

        The batch pass asked marked engines about their first job; the answer stands
        while that job is still queued (the pass never queues a job ahead of it, and an
        engine that gets work, or whose budget moves, is marked again, which drops it),
        so the refusal is not worked out twice in one event."""
        refused = self._refused.get(engine.name)
        if refused is not None and refused[0].phase is Phase.QUEUED:
            reason = refused[1]
            return _TURN_OF_REASON[reason](engine), reason
        head = self._head_batch_job(engine)
        if head is not None:
            reason = engine.batch_refusal(head)
            return _TURN_OF_REASON[reason](engine), reason
        if not engine.up or engine.at_cap():
            return Turn.SATURATED, None
        if engine.holds_for_interactive():
            return Turn.INTERACTIVE, None
        return (Turn.BATCH if engine.count(TrafficClass.BATCH) else Turn.IDLE), None


def _earliest_kept(queue: JobQueue, kept: dict[str, int]) -> tuple[Job, str] | None:
    """The earliest job of all models' lines past the jobs ``kept`` in each, and its
    model; a model with no job left past them is dropped from ``kept``."""
    job: Job | None = None
    model = ""
    for m in list(kept):
        nxt = queue.nth_of_model(m, kept[m])
        if nxt is None:
            del kept[m]
        elif job is None or queue.seq(nxt) < queue.seq(job):
            job, model = nxt, m
    return None if job is None else (job, model)


def _tenant_room(engine: EngineState, job: Job) -> bool:
    """Whether chat ``job`` fits its tenant's share of ``engine``'s prefill: its
    tenant's chat prompt tokens in prefill there, with it, within the engine's
    budget; or none of them there (one chat always goes)."""
    held = 0
    for other in engine.inflight.values():
        if (
            other.tenant == job.tenant
            and other.cls is TrafficClass.INTERACTIVE
            and other.phase is Phase.PREFILL
        ):
            held += other.uncached_tokens
    return held == 0 or held + job.prompt_tokens <= engine.budget.tokens


def _chat_held(engines: Iterable[EngineState]) -> HeldReason:
    """Why a chat none of ``engines`` takes waits: they are at their cap (one is up)
    or unhealthy (none is)."""
    up = any(e.up for e in engines)
    return HeldReason.CONCURRENCY_CAP if up else HeldReason.ENGINE_UNHEALTHY


def _reserved_tokens(engine: EngineState) -> int:
    """The batch prompt tokens in prefill on ``engine`` whose reservation was granted."""
    return sum(
        j.uncached_tokens
        for j in engine.inflight.values()
        if j.cls is TrafficClass.BATCH and j.phase is Phase.PREFILL and j.reserved
    )


def _mark_beside_batch(engine: EngineState, job: Job) -> None:
    """Interactive work that shares ``engine`` with batch prefill is what the budget
    loop judges: a chat sent while batch is in prefill there, and every chat in flight
    there when a batch job is sent."""
    if job.cls is TrafficClass.INTERACTIVE:
        job.beside_batch = engine.prefill_tokens(TrafficClass.BATCH) > 0
        return
    for other in engine.inflight.values():
        if other.cls is TrafficClass.INTERACTIVE:
            other.beside_batch = True


def _cap_turn(engine: EngineState) -> Turn:
    """Batch at a cap: the engine's own cap saturates it; batch's own cap does not."""
    return Turn.SATURATED if engine.at_cap() else Turn.BATCH


_TURN_OF_REASON: dict[HeldReason | None, Callable[[EngineState], Turn]] = {
    None: lambda _: Turn.BATCH,
    HeldReason.ENGINE_UNHEALTHY: lambda _: Turn.SATURATED,
    HeldReason.CONCURRENCY_CAP: _cap_turn,
    HeldReason.INTERACTIVE_WAITING: lambda _: Turn.INTERACTIVE,
    HeldReason.KV_HEADROOM: lambda _: Turn.SATURATED,
    HeldReason.PREFILL_BUDGET: lambda _: Turn.BATCH,
}
