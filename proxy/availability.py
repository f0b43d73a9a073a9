"""Whether something the proxy depends on answers: up or down, since when, why, and
how many outages so far. Pure: the caller gives the time.

The batch store (:mod:`proxy.batch.health`) and the shared ledger
(:mod:`proxy.replicas`) each keep one, and each decides for itself when a failure
begins an outage and what it logs.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Availability:
    up: bool = True
    since: float = 0.0  # when it last went down, or up again
    cause: str = ""  # why it is down ("" while up)
    outages: int = 0

    def down(self, now: float, cause: str) -> bool:
        """Mark it down since ``now`` for ``cause``; True if this begins an outage."""
        if not self.up:
            return False
        self.up, self.since, self.cause = False, now, cause
        self.outages += 1
        return True

    def back(self, now: float) -> float | None:
        """Mark it up; the outage's length if it was down, else None."""
        if self.up:
            return None
        self.up, self.cause = True, ""
        lasted, self.since = now - self.since, now
        return lasted
