"""The scheduler in the event loop: requests wait here for their turn.

:class:`Admission` wraps the pure :class:`~proxy.scheduler.Scheduler` for asyncio.
A request handler calls :meth:`Admission.wait_for_engine`, which queues the job
and returns the engine chosen for it once the scheduler dispatches it; if the
handler is cancelled meanwhile (the client hung up), the job leaves the queue.
Every event that may free room (a first token, a finish, a failure, an engine's
health or load) runs the scheduler again at once, so no request waits for a timer.
"""

from __future__ import annotations

import asyncio
import logging

from proxy.scheduler import EngineLoad, Job, Scheduler

logger = logging.getLogger(__name__)


class Admission:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self._waiters: dict[str, asyncio.Future[str]] = {}

    async def wait_for_engine(self, job: Job) -> str:
        """Queue ``job`` and return the engine it is dispatched to. After
        :meth:`failed` requeued it, wait for its next engine (which may be chosen
        already)."""
        future = self._waiters.get(job.id)
        if future is None:
            future = self._hold_place(job.id)
        try:
            if job.attempts == 0:
                self.scheduler.submit(job)
            self.pump()
            return await future
        except BaseException:
            # Cancelled (the client left) or failed: the job leaves the scheduler,
            # even if it was dispatched in the same instant.
            self.scheduler.cancel(job.id)
            self.pump()
            raise
        finally:
            self._waiters.pop(job.id, None)

    def _hold_place(self, job_id: str) -> asyncio.Future[str]:
        future: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        self._waiters[job_id] = future
        return future

    def pump(self) -> None:
        """Run the scheduler and release the jobs it dispatches."""
        for dispatch in self.scheduler.dispatch():
            future = self._waiters.get(dispatch.job.id)
            if future is None or future.done():
                # Nobody waits any more (the client left between two events).
                self.scheduler.cancel(dispatch.job.id)
                continue
            future.set_result(dispatch.engine)

    # -- feedback from the request path ------------------------------------------

    def first_token(self, job_id: str) -> None:
        self.scheduler.on_first_token(job_id)
        self.pump()

    def token_gap(self, job_id: str, gap_s: float) -> None:
        self.scheduler.on_token_gap(job_id, gap_s)

    def finished(self, job_id: str, prompt_tokens: int | None = None) -> None:
        if prompt_tokens is not None:
            self.scheduler.correct_prompt_tokens(job_id, prompt_tokens)
        self.scheduler.on_finished(job_id)
        self.pump()

    def abandon(self, job_id: str) -> None:
        """The client left: forget the job wherever it is."""
        self.scheduler.cancel(job_id)
        self.pump()

    def failed(self, job_id: str, *, retry: bool) -> bool:
        """The engine failed the job; True if it is queued again for another engine."""
        requeued = self.scheduler.on_failed(job_id, retry=retry)
        if requeued:
            # Its handler waits again only after this returns; a dispatch before
            # then must find a waiter, or the job would be dropped as abandoned.
            self._hold_place(job_id)
        self.pump()
        return requeued

    # -- feedback from the engine monitor ----------------------------------------

    def set_engine_up(self, name: str, up: bool) -> None:
        self.scheduler.set_engine_up(name, up)
        self.pump()

    def observe_load(self, name: str, load: EngineLoad) -> None:
        self.scheduler.observe_load(name, load)
        self.pump()

    def tick(self) -> None:
        self.scheduler.tick()
        self.pump()
