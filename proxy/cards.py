"""Cards: several models sharing one accelerator's memory, kept by the rule of
:mod:`proxy.scheduler.residency`; the swap itself an engine-side action
(:class:`proxy.engines.Activator`).

A :class:`CardKeeper` per configured card. At start it asks each of the card's
engines whether it is awake; on a card where the models do not all fit awake
together it keeps the first awake one (config order) and puts the others to sleep.
Then every :data:`STEP_S` it reads each model's demand (the scheduler's queues and
work in flight, the batch runner's deadlines) and asks :func:`decide`:

- ``drain``: the awake engine takes no new work (``draining`` in the scheduler;
  what is in flight finishes, nothing is cut); a later ``stay`` opens it again;
- ``swap``: the awake engine is put to sleep, then the next one woken, each step
  timed; once it answers it takes its model's queued work. Its requests waited
  for it: their wait is the activation phase (``X-Whoseturn-Activation-Ms``,
  ``whoseturn_activation_wait_seconds``).

Every drain and swap, with its reason, is kept for ``/turn/log`` (:attr:`log`). A
card whose models all fit awake together is woken whole at start and never swapped;
on any other card one model is awake at a time (of three models where two would fit
together, still one: the rule chooses between the awake model and the others).
A swap that fails (an engine that will not sleep or wake) is logged and counted; the
requests waiting for the model fail with 503 and the reason, and work that comes
for it within :data:`RETRY_S` waits until then for the next try.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from proxy.admission import Admission
from proxy.clock import Clock
from proxy.config import CardConfig, EngineConfig
from proxy.engines import ActivationFailed, Activator, EngineMonitor
from proxy.metrics import CardMetrics
from proxy.scheduler.residency import (
    Card,
    Demand,
    Move,
    ResidencyDecision,
    ResidencyRules,
    decide,
)

logger = logging.getLogger(__name__)

STEP_S = 0.25
RETRY_S = 10.0
LOG_SIZE = 200

BatchDue = Callable[[str], tuple[int | None, float]]
"""``due(model)``: the earliest completion-window end (epoch seconds) of the batch
jobs running on ``model`` and the card time their remaining lines need
(:meth:`proxy.batch.runner.BatchRunner.due`)."""


@dataclass(frozen=True)
class CardEvent:
    """A drain, an undrain, a swap or a failed swap on a card, for ``/turn/log``."""

    time: float  # the clock's
    card: str
    action: str  # drain, open, swap, swap_failed
    model: str | None  # the model woken (drain: to be woken; open: reopened)
    asleep: str | None  # the model put to sleep (swap)
    reason: str
    why: str | None = None
    sleep_s: float | None = None
    wake_s: float | None = None


class CardKeeper:
    """One card's models: which is awake, and the swaps (see the module docstring)."""

    def __init__(
        self,
        config: CardConfig,
        engines: Sequence[EngineConfig],
        activators: Mapping[str, Activator],
        admission: Admission,
        monitor: EngineMonitor,
        clock: Clock,
        metrics: CardMetrics,
        batch_due: BatchDue | None = None,
    ) -> None:
        self.config = config
        self.engine_of = {next(iter(e.models)): e.name for e in engines}
        self.activators = {e.name: activators[e.name] for e in engines}
        self.admission = admission
        self.monitor = monitor
        self.clock = clock
        self.metrics = metrics
        self.batch_due = batch_due
        self.rules = ResidencyRules(
            min_awake_s=config.min_awake_s,
            chat_quiet_s=config.chat_quiet_s,
            deadline_slack_s=config.deadline_slack_s,
        )
        self.fits_all = sum(e.footprint_gib for e in engines) <= config.memory_gib
        wake = {next(iter(e.models)): _wake_s(e) for e in engines}
        self.card = Card(config.name, tuple(self.engine_of), wake_s=wake)
        self.awake: set[str] = set()  # models serving now
        self.draining = False
        self.last: ResidencyDecision | None = None
        self.log: deque[CardEvent] = deque(maxlen=LOG_SIZE)
        self.retry_at = 0.0  # after a step that failed: nothing decided until then
        self.failed_until: dict[str, float] = {}  # a model whose wake failed: not till then
        self._nudged = asyncio.Event()

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def swapping(self) -> bool:
        return self.card.swapping is not None

    def awake_by_model(self) -> dict[str, tuple[str, bool]]:
        return {m: (e, m in self.awake) for m, e in self.engine_of.items()}

    # -- start and stop --------------------------------------------------------

    async def start(self) -> None:
        """Learn which models are awake; keep what fits (the first awake one on a
        card that swaps; all of them woken on a card where all fit)."""
        found = await asyncio.gather(*(a.awake() for a in self.activators.values()))
        awake = [m for (m, e), up in zip(self.engine_of.items(), found, strict=True) if up]
        now = self.clock.now()
        if self.fits_all:
            for model in self.engine_of:
                if model in awake:
                    self.awake.add(model)
                    continue
                try:
                    await self._wake(model, "all fit on the card")
                except (ActivationFailed, OSError) as exc:  # the proxy starts anyway
                    logger.error("card %s: %s not woken: %s", self.name, model, exc)
                    self._watch_again(model)
            return
        keep = awake[0] if awake else None
        for model, engine in self.engine_of.items():
            if model == keep:
                continue
            self._rest(model, "asleep")
            if model in awake:
                logger.info("card %s: %s is awake beside %s: putting it to sleep",
                            self.name, model, keep)  # fmt: skip
                try:
                    await self.activators[engine].sleep()
                except (ActivationFailed, OSError) as exc:
                    logger.error("card %s: %s not put to sleep: %s", self.name, model, exc)
        if keep is not None:
            self.awake.add(keep)
            self.card.awake, self.card.awake_since = keep, now
        logger.info("card %s: %s awake", self.name, keep or "nothing")

    async def close(self) -> None:
        """The proxy stops: engine processes it started are stopped."""
        for activator in self.activators.values():
            try:
                await activator.close()
            except Exception:
                logger.exception("card %s: stopping engine %s failed", self.name, activator.name)

    # -- the loop --------------------------------------------------------------

    def nudge(self, model: str) -> None:
        """Work arrived for ``model`` while it rests: decide now, not at the next step."""
        if model in self.engine_of:
            self._nudged.set()

    async def run(self) -> None:
        """Decide every :data:`STEP_S` (or at once when nudged), and swap when the
        rule says so."""
        while True:
            self._nudged.clear()
            try:
                decision = self.step()
                if decision is not None and decision.move is Move.SWAP:
                    await self.swap(decision)
                    continue
            except Exception:  # a keeper that died would leave its card as it was
                logger.exception("card %s: a step failed; trying again in %.0f s",
                                 self.name, RETRY_S)  # fmt: skip
                self.retry_at = self.clock.now() + RETRY_S
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._nudged.wait(), STEP_S)

    def step(self) -> ResidencyDecision | None:
        """One decision (None: this card never swaps, or is waiting to retry);
        drains and reopens the awake engine as it says; a swap is the caller's."""
        now = self.clock.now()
        if self.fits_all or now < self.retry_at:
            return None
        awake = self.card.awake
        self.card.in_flight = self.admission.in_flight(self.engine_of[awake]) if awake else 0
        decision = decide(self.card, self.demand(now), now, self.rules)
        if decision.move is Move.DRAIN and not self.draining and awake is not None:
            self.draining = True
            self._rest(awake, "draining")
            self._note(now, "drain", decision.target, None, decision)
        elif decision.move is Move.STAY and self.draining and awake is not None:
            self.draining = False
            self._rest(awake, "")
            self._note(now, "open", awake, None, decision)
        self.last = decision
        return decision

    def demand(self, now: float) -> dict[str, Demand]:
        """Each model's demand: the scheduler's, with the batch runner's deadline
        (moved onto the clock) and card time."""
        out: dict[str, Demand] = {}
        offset = time.time() - now
        for model in self.engine_of:
            if now < self.failed_until.get(model, 0.0):
                out[model] = Demand()  # its wake failed lately: its work waits
                continue
            d = self.admission.demand(model)
            if self.batch_due is not None:
                deadline, work_s = self.batch_due(model)
                if deadline is not None:
                    d = replace(d, batch_deadline=deadline - offset, batch_work_s=work_s)
            out[model] = d
        return out

    async def swap(self, decision: ResidencyDecision) -> None:
        """Put the awake model to sleep and wake ``decision.target``, timed."""
        target = decision.target
        assert target is not None
        asleep = self.card.awake
        self.card.swapping = target
        sleep_s: float | None = None
        try:
            if asleep is not None:
                self._rest(asleep, "asleep")
                self.awake.discard(asleep)
                began = self.clock.now()
                await self.activators[self.engine_of[asleep]].sleep()
                sleep_s = self.clock.now() - began
                self.metrics.step_seconds.labels(self.name, asleep, "sleep").observe(sleep_s)
            self.card.awake = None
            self.draining = False
            wake_s = await self._wake(target, decision.reason)
        except (ActivationFailed, OSError) as exc:
            logger.error("card %s: swap to %s failed: %s", self.name, target, exc)
            self.metrics.failures.labels(self.name, target).inc()
            why = f"The model `{target}` could not be woken on its card: {exc}"
            failed = self.admission.fail_waiting(target, why)
            logger.warning("card %s: %d requests for %s failed with it", self.name, failed, target)
            now = self.clock.now()
            self._note(now, "swap_failed", target, asleep, decision, sleep_s)
            self.failed_until[target] = now + RETRY_S  # its work is not woken for meanwhile
            return
        finally:
            self.card.swapping = None
        now = self.clock.now()
        self.card.awake, self.card.awake_since = target, now
        self.card.wake_s[target] = wake_s
        why = decision.why.value if decision.why is not None else "nothing_awake"
        self.metrics.swaps.labels(self.name, target, why).inc()
        self._note(now, "swap", target, asleep, decision, sleep_s, wake_s)
        logger.info("card %s: %s awake (%s asleep) in %.1f s: %s", self.name, target,
                    asleep or "nothing", (sleep_s or 0.0) + wake_s, decision.reason)  # fmt: skip

    async def _wake(self, model: str, reason: str) -> float:
        """Wake ``model``'s engine; it takes work once it answers. Its duration."""
        engine = self.engine_of[model]
        self._rest(model, "waking")
        began = self.clock.now()
        await self.activators[engine].wake()
        wake_s = self.clock.now() - began
        self.metrics.step_seconds.labels(self.name, model, "wake").observe(wake_s)
        self.monitor.resume(engine)
        self._rest(model, "")
        self.awake.add(model)
        logger.info("card %s: %s woken in %.1f s (%s)", self.name, model, wake_s, reason)
        return wake_s

    def _watch_again(self, model: str) -> None:
        """A model not woken on a card where all fit: its engine is an engine like
        any other again (up or down as its health checks say)."""
        self.monitor.resting.discard(self.engine_of[model])
        self.admission.set_engine_resting(self.engine_of[model], "")

    def _rest(self, model: str, resting: str) -> None:
        engine = self.engine_of[model]
        if resting in ("asleep", "waking"):
            self.monitor.rest(engine)
        self.admission.set_engine_resting(engine, resting)

    def _note(
        self,
        now: float,
        action: str,
        model: str | None,
        asleep: str | None,
        decision: ResidencyDecision,
        sleep_s: float | None = None,
        wake_s: float | None = None,
    ) -> None:
        why = decision.why.value if decision.why is not None else None
        self.log.append(
            CardEvent(now, self.name, action, model, asleep, decision.reason, why, sleep_s, wake_s)
        )

    # -- reads -----------------------------------------------------------------

    def view(self) -> dict[str, object]:
        """The card for ``/turn`` and ``/status``: each model's state and engine, the
        awake one and for how long, the last decision's reason."""
        now = self.clock.now()
        models = {}
        for model, engine in self.engine_of.items():
            if model in self.awake:
                state = "draining" if self.draining and model == self.card.awake else "awake"
            elif self.card.swapping == model:
                state = "waking"
            else:
                state = "asleep"
            models[model] = {"engine": engine, "state": state}
        awake = self.card.awake
        return {
            "card": self.name,
            "memory_gib": self.config.memory_gib,
            "swaps": not self.fits_all,
            "awake": sorted(self.awake),
            "awake_for_s": now - self.card.awake_since if awake is not None else None,
            "swapping_to": self.card.swapping,
            "models": models,
            "decision": None if self.last is None else {
                "move": self.last.move.value,
                "target": self.last.target,
                "reason": self.last.reason,
            },
            "wake_s": dict(self.card.wake_s),
        }  # fmt: skip


def _wake_s(engine: EngineConfig) -> float:
    return engine.activation.wake_s if engine.activation is not None else 0.0


def build_cards(
    cards: Sequence[CardConfig],
    engines: Sequence[EngineConfig],
    activator_of: Callable[[EngineConfig], Activator],
    admission: Admission,
    monitor: EngineMonitor,
    clock: Clock,
    metrics: CardMetrics,
    batch_due: BatchDue | None = None,
) -> list[CardKeeper]:
    """A keeper per card, over the engines configured on it."""
    keepers = []
    for config in cards:
        on = [e for e in engines if e.card == config.name]
        activators = {e.name: activator_of(e) for e in on}
        keeper = CardKeeper(config, on, activators, admission, monitor, clock, metrics, batch_due)
        metrics.attach(keeper)
        keepers.append(keeper)
    return keepers
