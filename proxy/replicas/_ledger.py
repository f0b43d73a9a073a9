"""The shared ledger's contract, and the one rule a reservation is judged by."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from proxy.scheduler import ReplicaLoad, Reservation


class LedgerError(Exception):
    """The ledger could not be read or written (unreachable, too slow, refused)."""


@dataclass(frozen=True)
class Verdict:
    """A reservation's outcome, and the other replicas' load on the engine as the
    ledger held it then."""

    granted: bool
    others: ReplicaLoad


@dataclass(frozen=True)
class Others:
    """The other live replicas on one engine, as a publication read them: their
    summed load there, and how many they are (each live replica keeps a row for
    every engine it knows, idle or not)."""

    load: ReplicaLoad
    replicas: int


def granted(reservation: Reservation, others: ReplicaLoad) -> bool:
    """Whether ``reservation`` fits beside ``others``: no other replica holds the
    engine for interactive work (unless the job runs beside interactive prefill on
    its starvation credit), and the batch prompt tokens in prefill there, summed over
    replicas, stay within the budget. The one-request rule: with nothing of the
    others in prefill, this replica's own check (the scheduler's) is enough."""
    if others.hold_for_interactive and not reservation.beside_interactive:
        return False
    in_prefill = others.batch_prefill_tokens + reservation.in_prefill
    return others.batch_prefill_tokens == 0 or in_prefill <= reservation.budget


class Ledger(Protocol):
    """Per engine (by its URL, the same on every replica), each replica's load.

    Rows whose last write is older than the lease do not count (a replica that
    died). Every method raises :class:`LedgerError` on failure, and fails within its
    own time limit: a store that stops answering must not hold the caller.
    """

    async def open(self) -> None: ...

    async def close(self) -> None:
        """Remove this replica's rows and let go of the connections."""
        ...

    async def publish(self, loads: Mapping[str, ReplicaLoad]) -> dict[str, Others]:
        """Write this replica's ``loads`` (by engine URL) with a fresh heartbeat;
        return the other live replicas on each engine (their summed load, and how
        many), by engine URL."""
        ...

    async def reserve(self, engine: str, reservation: Reservation) -> Verdict:
        """In one transaction holding the engine's lock: judge ``reservation`` on
        ``engine`` (:func:`granted`) against the other live rows, and write this
        replica's batch tokens in prefill there (counting the job if granted)."""
        ...
