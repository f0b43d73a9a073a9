"""Aborting a batch request in prefill to keep a chat's TTFT: the rule. Pure: no
I/O; the time is passed in.

A batch request that vLLM is prefilling runs to the end of its prefill before a
chat that arrived after it (FCFS, without ``--long-prefill-token-threshold``).
The final request of a pieced prompt (:mod:`proxy.scheduler.pieces`) finds its
earlier pieces in the engine's prefix cache; aborted, it loses little, and sent
again on the same engine it finds them there again, with whatever whole blocks
of its own prefill were computed before the abort. So such a job is *abortable*
(``Job.abortable``, set by the edge; under ``batch_abort: auto`` also a long prompt
sent whole only because ``auto`` piecing waits for chat's first miss on an engine
that caches prefixes), and :func:`choose_abort` says when to abort it:

- only a batch job in prefill (no first token yet) marked abortable, aborted
  fewer than ``limit`` times (``batch_abort_max``): after that it is never
  aborted again, so no job is aborted forever;
- only while a chat waits for its engine: in prefill there, sent no earlier than
  the batch job (so it is behind it in the engine's queue), or queued in the
  proxy for that engine;
- only when that chat's TTFT is at risk: the time it has waited since it arrived
  at the proxy, plus the batch job's expected prefill still to run, passes the
  engine's TTFT aim (``aim x ttft_target_s``, what the budget loop aims under).
  The prefill still to run is the job's expected prefill time (``Job.prefill_s``:
  its new tokens at the engine's measured cost per token, from its pieces) less
  the time since it was sent, at least 0; unknown, it is 0, and the chat is at
  risk once it has waited past the aim itself.

While the batch job's prefill runs, the chat's wait grows as fast as the
prefill left shrinks, so the sum is steady: the rule fires when the chat
arrives if the estimate already says the aim will be missed, or later once the
job has run past its estimate and the chat past the aim. Of several abortable
jobs on an engine, the one with the most prefill left goes first (then the one
sent last, then by id): one at a time, the rule asked again after each.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from proxy.scheduler.state import EngineState
from proxy.scheduler.types import Abort, Job, Phase, TrafficClass

DEFAULT_ABORT_LIMIT = 3


def may_abort(job: Job, limit: int) -> bool:
    """Whether ``job`` may still be aborted: an abortable batch job in prefill on
    an engine, aborted fewer than ``limit`` times."""
    return (
        job.abortable
        and job.cls is TrafficClass.BATCH
        and job.phase is Phase.PREFILL
        and job.engine is not None
        and job.dispatched_at is not None
        and job.aborts < limit
    )


def remaining_prefill(job: Job, now: float) -> float:
    """The expected prefill time ``job`` still has at ``now`` (0 when unknown)."""
    if job.prefill_s is None or job.dispatched_at is None:
        return 0.0
    return max(0.0, job.prefill_s - (now - job.dispatched_at))


def choose_abort(
    engine: EngineState, waiting: Iterable[Job], now: float, limit: int
) -> Abort | None:
    """The batch job to abort on ``engine`` now, if any, for the chats ``waiting``
    for it (in prefill there, or queued in the proxy for it); see the module
    docstring. Reads only."""
    budget = engine.settings.budget
    aim = budget.aim * budget.ttft_target_s
    chats = [c for c in waiting if c.cls is TrafficClass.INTERACTIVE]
    best: tuple[tuple[float, float, str], Abort] | None = None
    for job in engine.inflight.values():
        if not may_abort(job, limit):
            continue
        sent = job.dispatched_at
        assert sent is not None
        behind = [c for c in chats if c.dispatched_at is None or c.dispatched_at >= sent]
        if not behind:
            continue
        chat = min(behind, key=lambda c: (c.arrival, c.id))  # the one waiting longest
        waited, left = now - chat.arrival, remaining_prefill(job, now)
        if waited + left <= aim:
            continue
        abort = Abort(job.id, engine.name, chat.id, waited, left, aim, job.aborts + 1, limit)
        key = (left, sent, job.id)
        if best is None or key > best[0]:
            best = (key, abort)
    return None if best is None else best[1]


def longest_waiting(queued: Iterable[Job], engines: Sequence[EngineState]) -> dict[str, Job]:
    """For each of ``engines`` (by name), the chat of ``queued`` (queued in the proxy)
    it may take that has waited longest: least arrival, then id. It is the only queued
    chat :func:`choose_abort` can pick there (a queued chat was never sent, so it is
    behind every job in prefill), so one walk over the queue serves every engine
    instead of one walk per engine. Engines with no such chat are left out."""
    first: dict[str, Job] = {}  # per model, among chats any engine of it may take
    bound: list[Job] = []  # chats some engine of their model may not take
    for chat in queued:
        if chat.excluded or chat.pinned is not None:
            bound.append(chat)
            continue
        best = first.get(chat.model)
        if best is None or (chat.arrival, chat.id) < (best.arrival, best.id):
            first[chat.model] = chat
    out: dict[str, Job] = {}
    for engine in engines:
        if engine.draining:
            continue  # it takes no new work (EngineState.eligible)
        mine = [first[m] for m in engine.settings.models if m in first]
        mine += [c for c in bound if engine.eligible(c)]
        if mine:
            out[engine.name] = min(mine, key=lambda c: (c.arrival, c.id))
    return out
