"""The upstream abort of a batch request in prefill, for a chat: the window in which
it may be done.

The scheduler says which batch job to abort (:mod:`proxy.scheduler.aborts`, the
rule); the request path can do it only while nothing of that attempt can have
reached the client. An abortable job's attempt therefore opens an
:class:`AbortWindow` when it is dispatched and closes it when the engine's first
chunk arrives, before that chunk is relayed
(:meth:`proxy.api.forward.Forwarder._attempt`). :meth:`AbortWindows.abort` cancels
the window's scope, which ends the upstream request (its response is closed: vLLM
aborts it), if the window is still open; the admission then requeues the job, and
the same request waits for its next dispatch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import anyio


@dataclass
class AbortWindow:
    """One attempt of an abortable job, from dispatch to the engine's first chunk:
    ``scope`` wraps its upstream request; ``aborted`` once :meth:`abort` cut it;
    ``closed`` once the engine began to answer (or the attempt ended)."""

    engine: str
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    aborted: bool = False
    closed: bool = False

    def abort(self) -> bool:
        """Cut the attempt if its window is open; whether it was."""
        if self.closed or self.aborted:
            return False
        self.aborted = True
        self.scope.cancel()
        return True


class AbortWindows:
    """The open windows, by job id (one attempt each at a time)."""

    def __init__(self) -> None:
        self._open: dict[str, AbortWindow] = {}

    def open(self, job_id: str, engine: str) -> AbortWindow:
        window = AbortWindow(engine)
        self._open[job_id] = window
        return window

    def close(self, job_id: str, window: AbortWindow) -> None:
        """The attempt's window closes: the engine began to answer, or it ended."""
        window.closed = True
        if self._open.get(job_id) is window:
            del self._open[job_id]

    def abort(self, job_id: str, engine: str) -> bool:
        """Cut job ``job_id``'s attempt on ``engine`` if its window is open; whether
        it was (False: not dispatched there yet as the request path sees it, or
        answering already)."""
        window = self._open.get(job_id)
        return window is not None and window.engine == engine and window.abort()

    def __len__(self) -> int:
        return len(self._open)
