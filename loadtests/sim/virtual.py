"""Run simulated engines in virtual time: no sleeping, exact and repeatable.

:class:`VirtualRunner` interleaves timed callbacks (request arrivals, a proxy
scheduler's decisions) with the steps of one or more engines on one
:class:`VirtualClock`. Each engine steps on its own; a callback due while an
engine's step runs is seen by that engine at its next step, as a request arriving
mid-step in vLLM joins the queue for the next one. At one instant, steps that end
are applied first, then due callbacks fire, then idle engines plan their next step.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Sequence

from loadtests.sim.request import SimRequest
from loadtests.sim.step_loop import SimEngine, StepPlan, StepResult
from proxy.clock import VirtualClock

StepListener = Callable[[SimEngine, StepResult], None]


class VirtualRunner:
    def __init__(self, engines: SimEngine | Sequence[SimEngine], clock: VirtualClock) -> None:
        self.engines = [engines] if isinstance(engines, SimEngine) else list(engines)
        if not self.engines or any(e.clock is not clock for e in self.engines):
            raise ValueError("every engine must run on the runner's clock")
        self.clock = clock
        self._timers: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self._plans: dict[int, StepPlan] = {}
        self.listeners: list[StepListener] = []

    @property
    def engine(self) -> SimEngine:
        return self.engines[0]

    def call_at(self, t: float, callback: Callable[[float], None]) -> None:
        """Run ``callback(t)`` at model time ``t`` (never before the current time)."""
        heapq.heappush(self._timers, (t, next(self._seq), callback))

    def submit_at(
        self,
        t: float,
        prompt_token_ids: list[int],
        max_tokens: int,
        *,
        engine: int = 0,
        priority: int = 0,
        request_id: str | None = None,
    ) -> list[SimRequest]:
        """Schedule a request's arrival; the returned list holds it once it has arrived."""
        box: list[SimRequest] = []

        def arrive(at: float) -> None:
            request = self.engines[engine].add_request(
                prompt_token_ids,
                max_tokens,
                arrival_time=at,
                priority=priority,
                request_id=request_id,
            )
            box.append(request)

        self.call_at(t, arrive)
        return box

    def _finish_due(self) -> None:
        now = self.clock.now()
        for i, plan in sorted(self._plans.items()):
            if plan.end <= now:
                del self._plans[i]
                engine = self.engines[i]
                result = engine.finish_step(plan)
                for listener in self.listeners:
                    listener(engine, result)

    def _fire_due(self) -> None:
        while self._timers and self._timers[0][0] <= self.clock.now():
            t, _, callback = heapq.heappop(self._timers)
            callback(t)

    def _begin_idle(self) -> None:
        for i, engine in enumerate(self.engines):
            if i not in self._plans:
                plan = engine.begin_step()
                if plan is not None:
                    self._plans[i] = plan

    def run(self, until: float | None = None, max_steps: int = 10_000_000) -> int:
        """Run until no work and no timers remain (or ``until``); returns steps begun."""
        steps = 0
        while True:
            self._finish_due()
            self._fire_due()
            before = len(self._plans)
            self._begin_idle()
            steps += len(self._plans) - before
            if steps > max_steps:
                raise RuntimeError(f"no quiescence after {max_steps} steps")
            ends = [p.end for p in self._plans.values()]
            if self._timers:
                ends.append(self._timers[0][0])
            if not ends:
                return steps
            t = min(ends)
            if until is not None and t > until:
                self.clock.advance_to(until)
                return steps
            self.clock.advance_to(t)
