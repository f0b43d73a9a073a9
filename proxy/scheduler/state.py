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


@dataclass(frozen=True)
class ReplicaLoad:
    """What proxy replicas do on one engine, as the shared ledger holds it
    (docs/replicas.md): their batch prompt tokens in prefill there, and whether
    interactive work of theirs is queued for it or in prefill there. A replica
    publishes its own; the scheduler is given the sum of the others' (one replica
    alone keeps the zero value)."""

    batch_prefill_tokens: int = 0
    hold_for_interactive: bool = False


@dataclass(frozen=True, kw_only=True)
class HoldRules:
    """How interactive work holds batch on an engine.

    - ``interactive_hold``: batch is held while interactive work is in prefill
      (False only for experiments that show what the rule is worth);
    - ``hold_timeout_s``: a chat in prefill longer than this stops holding batch (its
      first token may never come);
    - ``batch_min_share``: the starvation bound. Each interactive prompt sent to
      the engine while batch waits for it earns batch ``share / (1 - share)`` of its
      tokens in credit; once the credit covers the first batch prompt, that prompt
      runs beside interactive prefill (the budget then counts batch tokens only),
      and spends its tokens. So under sustained chat batch still gets about
      ``batch_min_share`` of the engine's prefill tokens.
    """

    interactive_hold: bool = True
    hold_timeout_s: float = 10.0
    batch_min_share: float = 0.05


class EngineState:
    def __init__(self, settings: EngineConfig, now: float, rules: HoldRules | None = None) -> None:
        self.settings = settings
        self.rules = rules or HoldRules()
        self.batch_credit = 0.0  # prompt tokens batch may run beside chat (HoldRules)
        self.name = settings.name
        self.up = True
        self.draining = False  # left discovery: no new work; what runs here finishes
        self.load = EngineLoad()
        self.others = ReplicaLoad()
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
        """Whether ``job`` may go to this engine: it serves the model, it is not
        draining, and the job has not already failed here."""
        return self.serves(job.model) and not self.draining and self.name not in job.excluded

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

    def record_dispatch(self, job: Job, batch_waiting: bool) -> None:
        """Keep the starvation bound's account: each interactive prompt sent while
        batch waits for this engine earns batch ``share / (1 - share)`` of its tokens
        in credit; a batch prompt sent spends its own."""
        share = self.rules.batch_min_share
        if job.cls is TrafficClass.BATCH:
            self.batch_credit = max(0.0, self.batch_credit - job.prompt_tokens)
        elif batch_waiting and share > 0:
            self.batch_credit += job.prompt_tokens * share / (1 - share)

    def batch_starved(self, job: Job) -> bool:
        """Whether batch has earned ``job``'s prompt in credit: it may run beside
        interactive prefill."""
        return self.rules.batch_min_share > 0 and self.batch_credit >= job.prompt_tokens

    def interactive_holding(self) -> bool:
        """Whether this replica's own chat, dispatched within the hold timeout, is in
        prefill here."""
        r, now = self.rules, self._accounted_at
        return any(
            j.cls is TrafficClass.INTERACTIVE
            and j.phase is Phase.PREFILL
            and now - (j.dispatched_at if j.dispatched_at is not None else now) < r.hold_timeout_s
            for j in self.inflight.values()
        )

    def holds_for_interactive(self, head: Job | None = None) -> bool:
        """Whether interactive work holds batch here (its first job ``head``): a chat
        dispatched within the hold timeout is in prefill, or another replica says it
        holds (:class:`ReplicaLoad`), and batch has not earned ``head`` in credit."""
        holding = self.interactive_holding() or self.others.hold_for_interactive
        starved = head is not None and self.batch_starved(head)
        return self.rules.interactive_hold and holding and not starved

    def batch_refusal(self, job: Job) -> HeldReason | None:
        """Why ``job`` (batch) may not be dispatched here now; None if it may. The
        checks run in the order the turn names them (:meth:`Scheduler._turn_of`), so
        the held reason and the turn always agree.

        The single-request rule: a job larger than the budget still runs when
        nothing else is in prefill, so no prompt is starved by its size. A starved
        batch (:class:`HoldRules`) runs one prompt at a time beside interactive
        prefill. Other replicas' batch prompt tokens in prefill here
        (:class:`ReplicaLoad`) count against the budget as this replica's own do.
        """
        s = self.settings
        if not self.up or self.draining:
            return HeldReason.ENGINE_UNHEALTHY
        if self.at_cap():
            return HeldReason.CONCURRENCY_CAP
        if self.holds_for_interactive(job):
            return HeldReason.INTERACTIVE_WAITING
        if self.count(TrafficClass.BATCH) >= s.batch_max_inflight:
            return HeldReason.CONCURRENCY_CAP
        if self.load.kv_usage >= s.kv_high_watermark:
            return HeldReason.KV_HEADROOM
        counted = TrafficClass.BATCH if self.batch_starved(job) else None
        in_prefill = self.prefill_tokens(counted) + self.others.batch_prefill_tokens
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
