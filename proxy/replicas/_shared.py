"""One replica's side of the shared budget: publish, read, reserve; and a local
budget while the ledger is down.

- Every ``interval_s`` (:meth:`SharedBudget.run`), and as soon as it frees
  something (a first token, a finish: :meth:`SharedBudget.nudge`), the replica
  writes its own load on each engine to the ledger and hands the other replicas'
  sums to the scheduler (``observe_others``), which then counts them in its budget
  check and holds batch while another replica holds an engine for interactive work.
- Before a batch job dispatched to an engine is sent (:meth:`SharedBudget.reserve`)
  its tokens are reserved in the ledger. Refused, the job goes back to the head of
  its queue with the fresher view of the others (``put_back``); the ledger failing
  (not yet down), the same after a pause of ``interval_s``.
- **The ledger down.** It is down once its calls have failed for ``timeout_s`` in a
  row (a paused database: one call that ran out its time) or :data:`FAILS_TO_DOWN`
  times in a row (a database that refuses connections). Then the replica sends
  batch on a local budget (:func:`local_share`): on each engine its own reserved
  batch tokens in prefill stay within ``B // k``, ``k`` the replicas live there at
  the last publication, this one counted; for ``lease_s`` after that publication
  the others' last load there still counts (their tokens and their hold), as the
  ledger itself would count it. Reservations do not touch the ledger then; the
  publish loop keeps trying, and the first publication that goes through ends the
  outage: the replica's load (what it reserved locally included) is in the ledger
  again, and so are its next reservations. For one lease after it is back, each
  replica live before the outage but not yet back in the ledger still counts as
  holding its local share there (it is likely on it still, and its rows aged out).
  One warning when an outage begins, with its cause; one line when it ends, with
  its length.
- Interactive work never waits on the ledger: nothing on its path calls it.

Calls to the ledger are one at a time, so that a publication never overwrites a
reservation made meanwhile with an older view of this replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import KW_ONLY, dataclass, field, replace
from typing import Any

from proxy.admission import Admission
from proxy.availability import Availability
from proxy.replicas._ledger import Ledger, LedgerError, Verdict
from proxy.scheduler import ReplicaLoad, Reservation

logger = logging.getLogger(__name__)

FAILS_TO_DOWN = 3  # failed calls in a row that put the ledger down, however fast
UNKNOWN_REPLICAS = 2  # k on an engine never seen in the ledger: one other, at least


@dataclass(frozen=True)
class LocalShare:
    """What this replica may put in prefill on one engine while the ledger is down:
    its own reserved batch tokens up to ``share`` of the ``budget``; nothing but
    work on starvation credit while ``hold`` (another replica's chat, as last seen);
    and, while the others are not known to have batch in prefill there
    (``others_idle``), one prompt larger than the share alone (the scheduler's
    single-request rule, per replica)."""

    budget: int
    share: int
    hold: bool
    others_idle: bool

    def grants(self, reservation: Reservation) -> bool:
        if self.hold and not reservation.beside_interactive:
            return False
        alone = reservation.in_prefill == reservation.tokens
        return reservation.in_prefill <= self.share or (alone and self.others_idle)

    def held(self) -> ReplicaLoad:
        """The others as the scheduler should count them: the rest of the budget."""
        return ReplicaLoad(self.budget - self.share, self.hold)

    def view(self, own_tokens: int) -> ReplicaLoad:
        """:meth:`held`, except while this replica has nothing in prefill there and
        the others are idle: then nothing, so that a prompt larger than the share
        can be dispatched (:meth:`grants` cuts anything beyond it)."""
        if own_tokens == 0 and self.others_idle:
            return ReplicaLoad(0, self.hold)
        return self.held()


def local_share(budget: int, replicas: int, last: ReplicaLoad | None) -> LocalShare:
    """The local budget on an engine with budget ``budget`` where ``replicas`` were
    live at the last publication (this one counted); ``last``: the others' load
    there then, while it still counts (None past the lease)."""
    share = budget // max(1, replicas)
    if last is None:
        return LocalShare(budget, share, hold=False, others_idle=True)
    share = max(0, min(share, budget - last.batch_prefill_tokens))
    idle = last.batch_prefill_tokens == 0
    return LocalShare(budget, share, hold=last.hold_for_interactive, others_idle=idle)


@dataclass(eq=False)
class SharedBudget:
    """Keeps ``admission``'s view of the other replicas current through ``ledger``;
    ``url_of(name)`` is an engine's URL (the ledger's key), None once it is gone.
    ``timeout_s`` and ``lease_s`` are the ledger's (``ledger_timeout_s``,
    ``ledger_lease_s``); ``clock`` a monotonic clock in seconds."""

    ledger: Ledger
    admission: Admission
    url_of: Callable[[str], str | None]
    _: KW_ONLY
    interval_s: float
    timeout_s: float = 1.0
    lease_s: float = 3.0
    clock: Callable[[], float] = time.monotonic
    others: dict[str, ReplicaLoad] = field(default_factory=dict, init=False)
    # by engine: the replicas live there at the last publication
    replicas: dict[str, int] = field(default_factory=dict, init=False)
    availability: Availability = field(default_factory=Availability, init=False)
    failures: int = field(default=0, init=False)
    refused: int = field(default=0, init=False)
    local_grants: int = field(default=0, init=False)  # batch sent on the local budget
    _streak: int = field(default=0, init=False)  # failed calls in a row
    _streak_since: float = field(default=0.0, init=False)  # when the first of them began
    _published_at: float | None = field(default=None, init=False)
    # self.replicas when the last outage began
    _before: dict[str, int] = field(default_factory=dict, init=False)
    # by engine: tokens held for replicas not back
    _absent: dict[str, int] = field(default_factory=dict, init=False)
    _local_at_down: int = field(default=0, init=False)
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False)
    _nudged: asyncio.Event = field(default_factory=asyncio.Event, init=False)

    @property
    def up(self) -> bool:
        """Whether the ledger answers (False: batch runs on the local budget)."""
        return self.availability.up

    def nudge(self) -> None:
        """Publish soon: this replica just freed something (a first token, a finish),
        and the others should not wait a whole interval to see it."""
        self._nudged.set()

    async def run(self) -> None:
        """:meth:`sync_once` every ``interval_s``, or sooner when nudged, until
        cancelled."""
        while True:
            self._nudged.clear()
            await self.sync_once()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._nudged.wait(), self.interval_s)

    async def sync_once(self) -> bool:
        """Publish this replica's load and take in the others'; False if the ledger
        failed (the last view of the others stays; while the ledger is down, the
        local budget is handed to the scheduler instead)."""
        async with self._lock:
            own = self.admission.own_loads()
            urls = {name: url for name in own if (url := self.url_of(name)) is not None}
            started = self.clock()
            try:
                seen = await self.ledger.publish({urls[n]: own[n] for n in urls})
            except LedgerError as exc:
                self._failed("publish", exc, started)
                seen = None
            else:
                self._answered(rejoin=True)
        if seen is None:
            if not self.up:
                self._observe_local()
            return False
        self._published_at = self.clock()
        found = {name: seen.get(url) for name, url in urls.items()}
        self.others = {n: o.load if o else ReplicaLoad() for n, o in found.items()}
        self.replicas = {n: 1 + (o.replicas if o else 0) for n, o in found.items()}
        self._count_absent()
        for name, load in self.others.items():
            self.admission.observe_others(name, self._counted(name, load))
        return True

    async def reserve(self, job_id: str) -> bool:
        """Reserve the tokens of ``job_id``, just dispatched, on its engine (in the
        ledger; on the local budget while it is down). True: send it. False: it was
        queued again (wait for its next dispatch). Work that needs no reservation
        (interactive) returns True at once."""
        if self.admission.reservation(job_id) is None:
            return True
        if not self.up:
            return self._reserve_locally(job_id)
        async with self._lock:
            if not self.up:  # it went down while this waited for the lock
                return self._reserve_locally(job_id)
            # asked again under the lock: the reservations granted meanwhile count
            reservation = self.admission.reservation(job_id)
            if reservation is None:
                return True  # unreachable: only a cancel takes it out, and ends the caller
            verdict = await self._ask_ledger(job_id, reservation)
            if verdict is not None and verdict.granted:
                self.admission.mark_reserved(job_id)
                return True
        if verdict is None:
            if not self.up:  # this very failure put it down
                return self._reserve_locally(job_id)
            await asyncio.sleep(self.interval_s)
            others = self.others.get(reservation.engine, ReplicaLoad())
            self.admission.put_back(job_id, self._counted(reservation.engine, others))
            return False
        self.refused += 1
        logger.debug("ledger refused %s on %s", job_id, reservation.engine)
        self.admission.put_back(job_id, self._counted(reservation.engine, verdict.others))
        return False

    async def _ask_ledger(self, job_id: str, reservation: Reservation) -> Verdict | None:
        """The ledger's verdict on ``reservation`` (less the tokens held for replicas
        not back); None if its engine is gone or the ledger failed."""
        url = self.url_of(reservation.engine)
        if url is None:
            logger.debug("engine %s is gone: %s is queued again", reservation.engine, job_id)
            return None
        started = self.clock()
        if absent := self._absent.get(reservation.engine, 0):
            reservation = replace(reservation, budget=reservation.budget - absent)
        try:
            verdict = await self.ledger.reserve(url, reservation)
        except LedgerError as exc:
            self._failed("reserve", exc, started)
            return None
        self._answered(rejoin=False)
        return verdict

    def local_share(self, engine: str) -> LocalShare:
        """``engine``'s local budget, as it stands now (used while the ledger is down)."""
        k = self.replicas.get(engine) or max(self.replicas.values(), default=UNKNOWN_REPLICAS)
        at = self._published_at
        fresh = at is not None and self.clock() - at < self.lease_s
        last = self.others.get(engine, ReplicaLoad()) if fresh else None
        return local_share(self.admission.budget_tokens(engine), k, last)

    @property
    def outages(self) -> int:
        """How many times the ledger went down (``whoseturn_ledger_outages_total``)."""
        return self.availability.outages

    def report(self) -> dict[str, Any]:
        """The ledger's state as this replica sees it, for ``/turn`` (a read)."""
        engines: dict[str, dict[str, int]] = {}
        for name in self.admission.own_loads():
            entry = {"replicas": self.replicas.get(name, 0)}
            if not self.up:
                entry["local_share_tokens"] = self.local_share(name).share
            engines[name] = entry
        ledger = self.availability
        return {
            "up": ledger.up,
            "down_for_s": None if ledger.up else round(self.clock() - ledger.since, 3),
            "cause": None if ledger.up else ledger.cause,
            "outages": ledger.outages,
            "local_batch_sent": self.local_grants,
            "engines": engines,
        }

    def _count_absent(self) -> None:
        """For one lease after an outage, the replicas live before it and not back in
        the ledger yet: on each engine, the tokens of their local shares (and they
        still count in ``replicas``, for an outage that would follow)."""
        ledger = self.availability
        if not ledger.outages or self.clock() - ledger.since >= self.lease_s:
            self._absent = {}
            return
        self._absent = {}
        for name, before in self._before.items():
            missing = before - self.replicas.get(name, before)
            if missing > 0:
                self.replicas[name] = before
                share = self.admission.budget_tokens(name) // before
                self._absent[name] = missing * share

    def _counted(self, engine: str, others: ReplicaLoad) -> ReplicaLoad:
        """``others`` from the ledger, with the replicas not back yet (:meth:`_count_absent`)."""
        absent = self._absent.get(engine, 0)
        if not absent:
            return others
        return ReplicaLoad(others.batch_prefill_tokens + absent, others.hold_for_interactive)

    def _reserve_locally(self, job_id: str) -> bool:
        reservation = self.admission.reservation(job_id)
        if reservation is None:
            return True
        share = self.local_share(reservation.engine)
        if share.grants(reservation):
            self.admission.mark_reserved(job_id)
            self.local_grants += 1
            return True
        logger.debug("local budget refused %s on %s", job_id, reservation.engine)
        self.admission.put_back(job_id, share.held())
        return False

    def _observe_local(self) -> None:
        """Hand the scheduler each engine's local budget as the others' load."""
        for name, own in self.admission.own_loads().items():
            self.admission.observe_others(
                name, self.local_share(name).view(own.batch_prefill_tokens)
            )

    def _failed(self, what: str, exc: LedgerError, started: float) -> None:
        self.failures += 1
        cause = f"{what}: {exc}"
        if self._streak == 0:
            self._streak_since = started
        self._streak += 1
        if not self.up:
            self.availability.cause = cause  # the latest failure
            logger.debug("ledger %s failed again: %s", what, exc)
            return
        lasted = self.clock() - self._streak_since
        if self._streak < FAILS_TO_DOWN and lasted < self.timeout_s:
            if self._streak == 1:
                logger.info("ledger %s failed: %s", what, exc)
            return
        self.availability.down(self._streak_since, cause)
        self._local_at_down = self.local_grants
        self._before = dict(self.replicas)  # those not back from an earlier one included
        logger.warning(
            "shared ledger down (%s; failed calls in a row: %d, over %.1f s): batch goes on "
            "within a local share of each engine's budget until the ledger answers again",
            cause, self._streak, lasted,
        )  # fmt: skip
        self._observe_local()

    def _answered(self, *, rejoin: bool) -> None:
        self._streak = 0
        lasted = self.availability.back(self.clock()) if rejoin else None
        if lasted is None:
            return
        logger.info(
            "shared ledger back after %.1f s down: batch is reserved through it again "
            "(%d batch requests were sent on the local budget meanwhile)",
            lasted, self.local_grants - self._local_at_down,
        )  # fmt: skip
        self.nudge()  # what was reserved during this publication, published at once
