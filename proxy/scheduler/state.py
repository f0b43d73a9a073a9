"""What the scheduler knows about one engine: work in flight, headroom, turn.

Work in flight is split by phase and class: prompt tokens still in prefill
(dispatched, no first token yet) and streams in decode. Headroom comes from the
engine's KV-cache usage in its own ``/metrics`` as last scraped (batch is held past
the watermark) and from the configured concurrency caps; the requests waiting
inside the engine are scraped too, and only reported (``/turn``, the status page).

The sums a decision reads (prompt tokens in prefill, streams per class, chats in
prefill) are counters kept as work is admitted, starts decoding and leaves
(:meth:`EngineState.admit`, :meth:`~EngineState.start_decode`,
:meth:`~EngineState.release`), so reading them costs the same with 1 or 1,000
jobs in flight. Turn time is charged lazily: an engine is brought up to date when
its turn changes or when it is read, against the time of the scheduler's last event
(:class:`EventTime`, shared by the scheduler's engines), so an event costs nothing
for the engines it does not touch.
"""

from __future__ import annotations

from dataclasses import dataclass

from proxy.config import EngineConfig
from proxy.scheduler.budget import BudgetController, SlidingWindow
from proxy.scheduler.history import Second, TurnHistory
from proxy.scheduler.pieces import PIECE_DEPTH, pieces_in_prefill
from proxy.scheduler.prefix import PrefixIndex
from proxy.scheduler.types import ENGINE_HELD_REASONS, HeldReason, Job, Phase, TrafficClass, Turn

STREAM_GAPS_SPAN_S = 30.0
# an engine's prefix index before its cache config is known: vLLM's default block,
# and a cache of that many blocks (about 1M tokens: a large GPU's, never the limit)
DEFAULT_BLOCK_SIZE = 16
DEFAULT_CACHE_BLOCKS = 65536


@dataclass(frozen=True)
class EngineLoad:
    """An engine's own view of its load, from its last ``/metrics`` scrape."""

    kv_usage: float = 0.0
    waiting: int = 0
    running: int = 0


class EventTime:
    """The time of the last event the scheduler handled, shared by its engines: what
    their turn time is charged up to, and the "now" of the hold timeout."""

    __slots__ = ("now",)

    def __init__(self, now: float) -> None:
        self.now = now

    def advance(self, now: float) -> None:
        self.now = max(self.now, now)


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
    def __init__(
        self,
        settings: EngineConfig,
        now: float,
        rules: HoldRules | None = None,
        events: EventTime | None = None,
    ) -> None:
        self.settings = settings
        self.rules = rules or HoldRules()
        self.batch_credit = 0.0  # prompt tokens batch may run beside chat (HoldRules)
        self.name = settings.name
        self.up = True
        self.draining = False  # left discovery: no new work; what runs here finishes
        # on a card (proxy.scheduler.residency): "" awake or on no card; else "draining"
        # (for a swap), "asleep" or "waking": no new work (``draining`` is set), and its
        # model's queued work waits for it instead of failing
        self.resting = ""
        self.load = EngineLoad()
        self.others = ReplicaLoad()
        self.inflight: dict[str, Job] = {}
        self.budget = BudgetController(settings.budget, now)
        self.turn = Turn.IDLE
        self.held_reason: HeldReason | None = None
        self._turn_seconds: dict[Turn, float] = dict.fromkeys(Turn, 0.0)
        self._held_seconds: dict[HeldReason, float] = dict.fromkeys(ENGINE_HELD_REASONS, 0.0)
        self.turn_since = now
        self.turn_history = TurnHistory()
        self._accounted_at = now
        self._events = events if events is not None else EventTime(now)
        # counters over ``inflight``, kept by admit / start_decode / release (and
        # ``rank`` below); sums over ``inflight`` at each read instead: chat 64 x 10,000
        # 36 µs, not 17; batch done 64 x 10,000 1,380, not 151 (the scheduler figure:
        # proxy.scheduler.core's docstring)
        self._prefill = dict.fromkeys(TrafficClass, 0)  # prompt tokens in prefill
        self._decode = dict.fromkeys(TrafficClass, 0)  # streams in decode
        self._count = dict.fromkeys(TrafficClass, 0)  # jobs in flight
        self._chats_in_prefill: dict[str, Job] = {}
        self.last_chat_at: float | None = None  # when a chat was last dispatched here
        # every interactive stream's gaps here, as they end (the piece sender reads the
        # widest while a piece ran, to tell whether the engine cut it)
        self.stream_gaps = SlidingWindow(STREAM_GAPS_SPAN_S)
        self.piece_depth = PIECE_DEPTH  # pieces in prefill at once (scheduler.pieces)
        self.rank: tuple[int, int, str] = (0, 0, self.name)
        """(prompt tokens in prefill, jobs in flight, name): least is where a chat waits
        least for its first token (:func:`proxy.scheduler.routing.pick_engine`)."""
        self.prefix = PrefixIndex(DEFAULT_BLOCK_SIZE, DEFAULT_CACHE_BLOCKS)
        """What the engine's prefix cache holds (:mod:`proxy.scheduler.prefix`)."""

    def cached_tokens(self, job: Job, pending: bool = False) -> int:
        """The prompt tokens of ``job`` this engine is expected to hold in its prefix
        cache; with ``pending``, or to have computed by the job's turn (a read: the
        index is not touched). The last token is always computed, as an engine must
        produce logits."""
        if not job.blocks:
            return 0
        hit = self.prefix.match(job.blocks, pending) * self.prefix.block_size
        return max(0, min(hit - job.prefix_tokens, job.prompt_tokens - 1))

    def serves(self, model: str) -> bool:
        return model in self.settings.models

    def eligible(self, job: Job) -> bool:
        """Whether ``job`` may go to this engine: it serves the model, it is not
        draining, the job has not already failed here, and it is not pinned to
        another engine (the later pieces of a pieced prompt)."""
        pinned = job.pinned is None or job.pinned == self.name
        return (
            pinned
            and self.serves(job.model)
            and not self.draining
            and self.name not in job.excluded
        )

    # -- work in flight --------------------------------------------------------

    def admit(self, job: Job) -> None:
        """``job`` (in prefill) is now in flight here."""
        self.inflight[job.id] = job
        self._count[job.cls] += 1
        self.prefix.sent(job.blocks)
        if job.cls is TrafficClass.INTERACTIVE:
            self.last_chat_at = self._events.now
        self._add_phase(job, 1)

    def start_decode(self, job: Job) -> None:
        """``job``, in flight here, had its first token."""
        if job.phase is Phase.PREFILL:
            self._add_phase(job, -1)
            job.phase = Phase.DECODE
            self._add_phase(job, 1)
            self.prefix.prefilled(job.blocks)

    def release(self, job_id: str) -> Job | None:
        """Take a job out of flight here (before its phase changes); None if absent."""
        job = self.inflight.pop(job_id, None)
        if job is not None:
            self._count[job.cls] -= 1
            self._add_phase(job, -1)
            if job.phase is Phase.PREFILL:
                self.prefix.dropped(job.blocks)
        return job

    def _add_phase(self, job: Job, sign: int) -> None:
        if job.phase is Phase.PREFILL:
            self._prefill[job.cls] += sign * job.uncached_tokens
            if job.cls is TrafficClass.INTERACTIVE:
                if sign > 0:
                    self._chats_in_prefill[job.id] = job
                else:
                    self._chats_in_prefill.pop(job.id, None)
        elif job.phase is Phase.DECODE:
            self._decode[job.cls] += sign
        self.rank = (self.prefill_tokens(), len(self.inflight), self.name)

    def prefill_tokens(self, cls: TrafficClass | None = None) -> int:
        p = self._prefill
        if cls is None:
            return p[TrafficClass.INTERACTIVE] + p[TrafficClass.BATCH]
        return p[cls]

    def decode_streams(self, cls: TrafficClass | None = None) -> int:
        d = self._decode
        if cls is None:
            return d[TrafficClass.INTERACTIVE] + d[TrafficClass.BATCH]
        return d[cls]

    def count(self, cls: TrafficClass | None = None) -> int:
        return len(self.inflight) if cls is None else self._count[cls]

    def chats_in_prefill(self) -> list[Job]:
        """The interactive jobs in prefill here, in the order they were sent."""
        return list(self._chats_in_prefill.values())

    # -- admission -------------------------------------------------------------

    def can_take_interactive(self) -> bool:
        return self.up and not self.draining and not self.at_cap()

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
        timeout, now = self.rules.hold_timeout_s, self._events.now
        # newest first: the chat sent last is the likeliest to hold (a loop, not any()
        # over a generator: this runs in every refusal)
        for j in reversed(self._chats_in_prefill.values()):
            if now - (j.dispatched_at if j.dispatched_at is not None else now) < timeout:
                return True
        return False

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

        A job is charged the prompt tokens this engine must compute: those its
        prefix cache is expected to hold are not (:meth:`cached_tokens`).

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
        if job.piece and pieces_in_prefill(self.inflight.values()) >= self.piece_depth:
            return HeldReason.PREFILL_BUDGET  # two pieces at a time (scheduler.pieces)
        counted = TrafficClass.BATCH if self.batch_starved(job) else None
        in_prefill = self.prefill_tokens(counted) + self.others.batch_prefill_tokens
        uncached = job.prompt_tokens - self.cached_tokens(job)
        if in_prefill and in_prefill + uncached > self.budget.tokens:
            return HeldReason.PREFILL_BUDGET
        return None

    # -- turn and its accounting ----------------------------------------------

    @property
    def turn_seconds(self) -> dict[Turn, float]:
        """The time spent in each turn up to the last event (a copy)."""
        return self.turn_seconds_at(self._events.now)

    @property
    def held_seconds(self) -> dict[HeldReason, float]:
        """The time batch was held for each reason up to the last event (a copy)."""
        return self.held_seconds_at(self._events.now)

    def account(self, now: float) -> None:
        """Charge the time since the last call to the current turn and reason."""
        self._events.advance(now)
        elapsed = self._unaccounted(now)
        self.turn_history.charge(self._accounted_at, now, self.turn)
        if elapsed:
            self._turn_seconds[self.turn] += elapsed
            if self.held_reason is not None:
                self._held_seconds[self.held_reason] += elapsed
        self._accounted_at = max(self._accounted_at, now)

    def _unaccounted(self, now: float) -> float:
        return max(0.0, now - self._accounted_at)

    def turn_seconds_at(self, now: float) -> dict[Turn, float]:
        """The time spent in each turn up to ``now``, the current turn running on
        since the last event (a read: nothing is charged)."""
        out = dict(self._turn_seconds)
        out[self.turn] += self._unaccounted(now)
        return out

    def turn_history_at(self, now: float, last: int | None = None) -> list[Second]:
        """The ``last`` whole seconds of turns up to ``now`` (a read; see
        :class:`~proxy.scheduler.history.TurnHistory`)."""
        return self.turn_history.seconds(self._accounted_at, now, self.turn, last)

    def held_seconds_at(self, now: float) -> dict[HeldReason, float]:
        """The time batch was held for each reason up to ``now`` (a read)."""
        out = dict(self._held_seconds)
        if self.held_reason is not None:
            out[self.held_reason] += self._unaccounted(now)
        return out

    def set_turn(self, now: float, turn: Turn, reason: HeldReason | None) -> None:
        if turn is self.turn and reason is self.held_reason:
            return
        self.account(now)
        if turn is not self.turn:
            self.turn_since = now
        self.turn = turn
        self.held_reason = reason
