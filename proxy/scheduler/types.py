"""The vocabulary of the proxy's scheduler: classes, turns, reasons, jobs, decisions."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import NamedTuple

__all__ = [  # what proxy.scheduler exports of it
    "BATCH_PRIORITY",
    "INTERACTIVE_PRIORITY",
    "Abort",
    "Decision",
    "Dispatch",
    "HeldReason",
    "Job",
    "Phase",
    "Reservation",
    "Route",
    "Tier",
    "TrafficClass",
    "Turn",
    "engine_priority",
]

INTERACTIVE_PRIORITY = -10
BATCH_PRIORITY = 0


class TrafficClass(enum.StrEnum):
    INTERACTIVE = "interactive"
    BATCH = "batch"

    @property
    def engine_priority(self) -> int:
        """The request ``priority`` for an engine under vLLM's priority policy (lower
        runs first): interactive -10, batch 0."""
        return INTERACTIVE_PRIORITY if self is TrafficClass.INTERACTIVE else BATCH_PRIORITY


class Tier(enum.StrEnum):
    """A tenant's tier: a strict band within its class, in the proxy's queue and, under
    vLLM's priority policy, in the engine's (``critical`` before ``standard`` before
    ``sheddable``; fair share between the tenants of one band)."""

    CRITICAL = "critical"
    STANDARD = "standard"
    SHEDDABLE = "sheddable"

    @property
    def rank(self) -> int:
        """0 for critical, 1 standard, 2 sheddable: the band's place in the queue."""
        return _TIER_RANKS[self]

    @property
    def offset(self) -> int:
        """Added to the class's engine priority: -1, 0, +1 (every interactive band
        stays before every batch band: -11..-9 against -1..1)."""
        return self.rank - 1


_TIER_RANKS = {Tier.CRITICAL: 0, Tier.STANDARD: 1, Tier.SHEDDABLE: 2}


def engine_priority(cls: TrafficClass, tier: Tier = Tier.STANDARD) -> int:
    """The request ``priority`` for an engine under vLLM's priority policy (lower
    runs first): the class's, moved by the tier."""
    return cls.engine_priority + tier.offset


class Turn(enum.StrEnum):
    """Whose turn an engine is on.

    - ``interactive``: interactive work is in prefill on the engine; batch is held.
    - ``batch``: no interactive pressure; batch is admitted within the budget.
    - ``saturated``: the engine has no headroom for anyone (or is down).
    - ``idle``: nothing is waiting for the engine.
    """

    INTERACTIVE = "interactive"
    BATCH = "batch"
    SATURATED = "saturated"
    IDLE = "idle"


class HeldReason(enum.StrEnum):
    """Why batch work queued for an engine is not admitted to it."""

    INTERACTIVE_WAITING = "interactive_waiting"
    PREFILL_BUDGET = "prefill_budget"
    KV_HEADROOM = "kv_headroom"
    CONCURRENCY_CAP = "concurrency_cap"
    ENGINE_UNHEALTHY = "engine_unhealthy"
    # a chat: its tenant holds its share of the engine's prefill already while
    # another tenant's chat is queued (proxy.scheduler.fair)
    TENANT_SHARE = "tenant_share"


# the reasons an engine holds batch for (its turn's reason; a chat's tenant share is
# the chat's, never an engine's)
ENGINE_HELD_REASONS = tuple(r for r in HeldReason if r is not HeldReason.TENANT_SHARE)


class Phase(enum.StrEnum):
    QUEUED = "queued"
    PREFILL = "prefill"
    DECODE = "decode"
    DONE = "done"


@dataclass(eq=False, kw_only=True)
class Job:
    """One request as the scheduler sees it.

    ``prompt_tokens`` is exact for batch work (counted by the engine's tokenizer)
    and may be an estimate for interactive work (a chat leaves prefill at its first
    token, so its count is never corrected afterwards: nothing would read it).
    ``affinity`` names a conversation (same user, or same leading messages) whose
    prefix an engine may hold in its cache.
    """

    id: str
    cls: TrafficClass
    model: str
    prompt_tokens: int
    arrival: float
    affinity: str | None = None
    phase: Phase = Phase.QUEUED
    engine: str | None = None
    dispatched_at: float | None = None
    first_token_at: float | None = None
    excluded: set[str] = field(default_factory=set)
    attempts: int = 0
    held: HeldReason | None = None
    beside_batch: bool = False  # interactive: shared its engine with batch prefill
    pinned: str | None = None  # a pieced prompt's later pieces go where the first went
    piece: int = 0  # the piece of a pieced prompt now queued or in flight (0: not pieced)
    reserved: bool = False  # batch: its tokens are reserved in the shared ledger
    abortable: bool = False  # batch: may be aborted in prefill and requeued (aborts.py)
    prefill_s: float | None = None  # batch: its expected engine prefill time, where known
    aborts: int = 0  # times it was aborted in prefill and requeued
    # the block hashes of the prompt sent (proxy.scheduler.prefix.chain; empty: not
    # tokenized), and how many of its first tokens are not its own to compute (a piece's
    # or a pieced prompt's: the earlier pieces', cached by then); ``prompt_tokens`` are
    # the rest
    blocks: tuple[int, ...] = ()
    prefix_tokens: int = 0
    cached_tokens: int = 0  # in flight: of its prompt tokens, those its engine was expected to hold
    # who sent it and what they are owed (proxy.scheduler.fair): the tenant's name
    # ("" anonymous), the line it shares its tenant's part with (a batch job's id;
    # "" for chat), its tenant's weight and tier, and the output tokens expected of it
    # (charged at the tag; the real count corrects its tenant at the finish)
    tenant: str = ""
    flow: str = ""
    weight: float = 1.0
    tier: Tier = Tier.STANDARD
    expected_output: int = 0
    # arrived while no engine of its model was awake (on a card, asleep or being
    # swapped in): its wait in the queue is a wait for activation
    for_wake: bool = False
    # its place in its class's queue, set as it is queued: (tier rank, fair tag, seq)
    order: tuple[int, float, int] = (1, 0.0, 0)

    @property
    def engine_priority(self) -> int:
        """The ``priority`` it carries into an engine under vLLM's priority policy."""
        return engine_priority(self.cls, self.tier)

    @property
    def uncached_tokens(self) -> int:
        """The prompt tokens its engine must compute: what it is charged in prefill."""
        return self.prompt_tokens - self.cached_tokens


class Dispatch(NamedTuple):
    """Send ``job`` to ``engine`` now: its ``attempt`` (0 first, then one per
    requeue after a failure), dispatched ``at`` (clock time). A named tuple, as
    :class:`Decision` is: every dispatch makes one."""

    job: Job
    engine: str
    attempt: int = 0
    at: float = 0.0


@dataclass(frozen=True)
class Abort:
    """Abort batch job ``job_id`` in prefill on ``engine`` and requeue it: chat
    ``chat_id`` has waited ``waited_s`` and the job's prefill has about
    ``remaining_s`` left, together past the TTFT aim ``aim_s``; it is the job's
    abort number ``number`` of at most ``limit`` (:mod:`proxy.scheduler.aborts`)."""

    job_id: str
    engine: str
    chat_id: str
    waited_s: float
    remaining_s: float
    aim_s: float
    number: int
    limit: int


class Route(NamedTuple):
    """Why an engine was chosen for a job (its receipt in ``/turn/log``): ``why`` is
    ``prefix`` (it holds more of the prompt than the least loaded engine, and that
    outweighs its load), ``load`` (the least expected wait without it), ``affinity``
    (the conversation's engine, within the slack), ``pinned`` (a piece's engine);
    ``cached`` the prompt tokens each candidate was expected to hold (those holding
    any, and the winner), ``cost`` the winner's expected prompt tokens to prefill
    before the job's first token (its prefill in flight plus the job's uncached)."""

    why: str
    cached: tuple[tuple[str, int], ...]
    cost: int


class Decision(NamedTuple):
    """One scheduling decision, as kept in the decision log: a job admitted, held
    (``reason``), or aborted in prefill and requeued (``abort``). A named tuple:
    every decision makes one, and a tuple is made in a quarter of a frozen
    dataclass's time."""

    time: float
    engine: str
    job_id: str
    cls: TrafficClass
    admitted: bool
    reason: HeldReason | None
    budget: int
    piece: int = 0  # the piece of a pieced prompt (0: a whole request)
    abort: Abort | None = None
    route: Route | None = None  # admitted: why this engine
    tenant: str = ""  # the job's tenant ("" anonymous)

    @property
    def action(self) -> str:
        """``admit``, ``hold`` or ``abort``."""
        if self.abort is not None:
            return "abort"
        return "admit" if self.admitted else "hold"


@dataclass(frozen=True)
class Reservation:
    """What a replica must reserve in the shared ledger before it sends batch job
    ``job_id`` to ``engine`` (docs/replicas.md): the job's ``tokens``; this
    replica's reserved batch prompt tokens in prefill there, counting the job
    (``in_prefill``); the ``budget`` it was admitted under; and whether it was
    admitted beside interactive prefill on its starvation credit (``beside_interactive``:
    other replicas' interactive work does not refuse it then)."""

    job_id: str
    engine: str
    tokens: int
    in_prefill: int
    budget: int
    beside_interactive: bool
