"""What the scheduler knows about one engine: work in flight, headroom, turn.

Work in flight is split by phase and class: prompt tokens still in prefill
(dispatched, no first token yet) and streams in decode. Headroom comes from the
engine's own ``/metrics`` (KV-cache usage, requests waiting inside the engine) as
last scraped, and from the configured concurrency caps.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.config import EngineConfig
from proxy.scheduler.budget import BudgetController
from proxy.scheduler.types import HeldReason, Job, Phase, TrafficClass, Turn


@dataclass(frozen=True)
class EngineLoad:
    """An engine's own view of its load, from its last ``/metrics`` scrape."""

    kv_usage: float = 0.0
    waiting: int = 0
    running: int = 0


class EngineState:
    def __init__(
        self, settings: EngineConfig, now: float, *, interactive_hold: bool = True
    ) -> None:
        self.settings = settings
        self.interactive_hold = interactive_hold
        self.name = settings.name
        self.up = True
        self.load = EngineLoad()
        self.inflight: dict[str, Job] = {}
        self.budget = BudgetController(settings.budget, now)
        self.turn = Turn.IDLE
        self.held_reason: HeldReason | None = None
        self.turn_seconds: dict[Turn, float] = dict.fromkeys(Turn, 0.0)
        self.held_seconds: dict[HeldReason, float] = dict.fromkeys(HeldReason, 0.0)
        self.turn_since = now
        self._accounted_at = now

    def serves(self, model: str) -> bool:
        return model in self.settings.models

    def eligible(self, job: Job) -> bool:
        """Whether ``job`` may go to this engine: it serves the model, and the job
        has not already failed here."""
        return self.serves(job.model) and self.name not in job.excluded

    # -- work in flight --------------------------------------------------------

    def prefill_tokens(self, cls: TrafficClass | None = None) -> int:
        return sum(
            j.prompt_tokens
            for j in self.inflight.values()
            if j.phase is Phase.PREFILL and (cls is None or j.cls is cls)
        )

    def decode_streams(self, cls: TrafficClass | None = None) -> int:
        return sum(
            1
            for j in self.inflight.values()
            if j.phase is Phase.DECODE and (cls is None or j.cls is cls)
        )

    def count(self, cls: TrafficClass | None = None) -> int:
        return sum(1 for j in self.inflight.values() if cls is None or j.cls is cls)

    def interactive_in_prefill(self) -> bool:
        return any(
            j.cls is TrafficClass.INTERACTIVE and j.phase is Phase.PREFILL
            for j in self.inflight.values()
        )

    # -- admission -------------------------------------------------------------

    def can_take_interactive(self) -> bool:
        return self.up and not self.at_cap()

    def at_cap(self) -> bool:
        return len(self.inflight) >= self.settings.max_inflight

    def holds_for_interactive(self) -> bool:
        """Whether interactive work in prefill here holds batch; never with the hold
        switched off (an experiment's arm)."""
        return self.interactive_hold and self.interactive_in_prefill()

    def batch_refusal(self, job: Job) -> HeldReason | None:
        """Why ``job`` (batch) may not be dispatched here now; None if it may. The
        checks run in the order the turn names them (:meth:`Scheduler._turn_of`), so
        the held reason and the turn always agree.

        The single-request rule: a job larger than the budget still runs when
        nothing else is in prefill, so no prompt is starved by its size.
        """
        s = self.settings
        if not self.up:
            return HeldReason.ENGINE_UNHEALTHY
        if self.at_cap():
            return HeldReason.CONCURRENCY_CAP
        if self.holds_for_interactive():
            return HeldReason.INTERACTIVE_WAITING
        if self.count(TrafficClass.BATCH) >= s.batch_max_inflight:
            return HeldReason.CONCURRENCY_CAP
        if self.load.kv_usage >= s.kv_high_watermark:
            return HeldReason.KV_HEADROOM
        in_prefill = self.prefill_tokens()
        if in_prefill and in_prefill + job.prompt_tokens > self.budget.tokens:
            return HeldReason.PREFILL_BUDGET
        return None

    # -- turn and its accounting ----------------------------------------------

    def account(self, now: float) -> None:
        """Charge the time since the last call to the current turn and reason."""
        elapsed = self._unaccounted(now)
        self.turn_seconds[self.turn] += elapsed
        if self.held_reason is not None:
            self.held_seconds[self.held_reason] += elapsed
        self._accounted_at = max(self._accounted_at, now)

    def _unaccounted(self, now: float) -> float:
        return max(0.0, now - self._accounted_at)

    def turn_seconds_at(self, now: float) -> dict[Turn, float]:
        """The time spent in each turn up to ``now``, the current turn running on
        since the last event (a read: nothing is charged)."""
        out = dict(self.turn_seconds)
        out[self.turn] += self._unaccounted(now)
        return out

    def held_seconds_at(self, now: float) -> dict[HeldReason, float]:
        """The time batch was held for each reason up to ``now`` (a read)."""
        out = dict(self.held_seconds)
        if self.held_reason is not None:
            out[self.held_reason] += self._unaccounted(now)
        return out

    def set_turn(self, now: float, turn: Turn, reason: HeldReason | None) -> None:
        if turn is not self.turn:
            self.turn_since = now
        self.turn = turn
        self.held_reason = reason
