"""Run the simulated engine in virtual time: no sleeping, exact and repeatable.

:class:`VirtualRunner` interleaves timed callbacks (request arrivals, or a proxy
scheduler's decisions) with engine steps on one :class:`VirtualClock`. A callback
due while a step runs fires when that step ends, as a request arriving mid-step in
vLLM joins the queue for the next one.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable

from proxy.sim.clock import VirtualClock
from proxy.sim.engine import SimEngine, StepResult
from proxy.sim.request import SimRequest

StepListener = Callable[[StepResult], None]


class VirtualRunner:
    def __init__(self, engine: SimEngine, clock: VirtualClock) -> None:
        if engine.clock is not clock:
            raise ValueError("the engine must run on the runner's clock")
        self.engine = engine
        self.clock = clock
        self._timers: list[tuple[float, int, Callable[[float], None]]] = []
        self._seq = itertools.count()
        self.listeners: list[StepListener] = []
        self.steps: list[StepResult] = []
        self.keep_steps = False

    def call_at(self, t: float, callback: Callable[[float], None]) -> None:
        """Run ``callback(t)`` at model time ``t`` (or at the end of the step spanning it)."""
        heapq.heappush(self._timers, (t, next(self._seq), callback))

    def submit_at(
        self, t: float, prompt_token_ids: list[int], max_tokens: int, **kwargs: object
    ) -> list[SimRequest]:
        """Schedule a request's arrival; the returned list holds it once it has arrived."""
        box: list[SimRequest] = []

        def arrive(at: float) -> None:
            box.append(
                self.engine.add_request(prompt_token_ids, max_tokens, arrival_time=at, **kwargs)  # type: ignore[arg-type]
            )

        self.call_at(t, arrive)
        return box

    def _fire_due(self) -> None:
        while self._timers and self._timers[0][0] <= self.clock.now():
            t, _, callback = heapq.heappop(self._timers)
            callback(t)

    def step(self) -> StepResult | None:
        """Run one engine step if there is work; None when idle."""
        plan = self.engine.begin_step()
        if plan is None:
            return None
        self.clock.advance(plan.duration)
        result = self.engine.finish_step(plan)
        if self.keep_steps:
            self.steps.append(result)
        for listener in self.listeners:
            listener(result)
        return result

    def run(self, until: float | None = None, max_steps: int = 10_000_000) -> int:
        """Run until no work and no timers remain (or ``until``); returns steps taken."""
        steps = 0
        while steps < max_steps:
            if until is not None and self.clock.now() >= until:
                break
            self._fire_due()
            if self.step() is not None:
                steps += 1
                continue
            if not self._timers:
                break
            self.clock.advance_to(self._timers[0][0])
        else:
            raise RuntimeError(f"no quiescence after {max_steps} steps")
        return steps
