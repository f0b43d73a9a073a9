"""One replica's side of the shared budget: publish, read, reserve.

- Every ``interval_s`` (:meth:`SharedBudget.run`), and as soon as it frees
  something (a first token, a finish: :meth:`SharedBudget.nudge`), the replica
  writes its own load on each engine to the ledger and hands the other replicas'
  sums to the scheduler (``observe_others``), which then counts them in its budget
  check and holds batch while another replica holds an engine for interactive work.
- Before a batch job dispatched to an engine is sent (:meth:`SharedBudget.reserve`)
  its tokens are reserved in the ledger. Refused, the job goes back to the head of
  its queue with the fresher view of the others (``put_back``); the ledger failing,
  the same after a pause of ``interval_s``: without the ledger no batch is sent.
- Interactive work never waits on the ledger: nothing on its path calls it.

Calls to the ledger are one at a time, so that a publication never overwrites a
reservation made meanwhile with an older view of this replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from proxy.admission import Admission
from proxy.replicas._ledger import Ledger, LedgerError
from proxy.scheduler import ReplicaLoad

logger = logging.getLogger(__name__)


class SharedBudget:
    """Keeps ``admission``'s view of the other replicas current through ``ledger``;
    ``url_of(name)`` is an engine's URL (the ledger's key), None once it is gone."""

    def __init__(
        self,
        ledger: Ledger,
        admission: Admission,
        url_of: Callable[[str], str | None],
        *,
        interval_s: float,
    ) -> None:
        self.ledger = ledger
        self.admission = admission
        self.url_of = url_of
        self.interval_s = interval_s
        self.others: dict[str, ReplicaLoad] = {}
        self.failures = 0
        self.refused = 0
        self._lock = asyncio.Lock()
        self._nudged = asyncio.Event()

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
        failed (the last view of the others stays)."""
        async with self._lock:
            own = self.admission.own_loads()
            urls = {name: url for name in own if (url := self.url_of(name)) is not None}
            try:
                others = await self.ledger.publish({urls[n]: own[n] for n in urls})
            except LedgerError as exc:
                self._failed("publish", exc)
                return False
        self.others = {name: others.get(url, ReplicaLoad()) for name, url in urls.items()}
        for name, load in self.others.items():
            self.admission.observe_others(name, load)
        return True

    async def reserve(self, job_id: str) -> bool:
        """Reserve the tokens of ``job_id``, just dispatched, on its engine. True:
        send it. False: it was queued again (wait for its next dispatch). Work that
        needs no reservation (interactive) returns True at once."""
        if self.admission.reservation(job_id) is None:
            return True
        async with self._lock:
            # asked again under the lock: the reservations granted meanwhile count
            reservation = self.admission.reservation(job_id)
            if reservation is None:
                return True  # unreachable: only a cancel takes it out, and ends the caller
            url = self.url_of(reservation.engine)
            try:
                if url is None:
                    raise LedgerError(f"engine {reservation.engine} is gone")
                verdict = await self.ledger.reserve(url, reservation)
            except LedgerError as exc:
                self._failed("reserve", exc)
                verdict = None
            if verdict is not None and verdict.granted:
                self.admission.mark_reserved(job_id)
                return True
        if verdict is None:
            await asyncio.sleep(self.interval_s)
            others = self.others.get(reservation.engine, ReplicaLoad())
            self.admission.put_back(job_id, others)
            return False
        self.refused += 1
        logger.debug("ledger refused %s on %s", job_id, reservation.engine)
        self.admission.put_back(job_id, verdict.others)
        return False

    def _failed(self, what: str, exc: LedgerError) -> None:
        self.failures += 1
        logger.warning("ledger %s failed (%d so far): %s", what, self.failures, exc)
