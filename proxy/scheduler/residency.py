"""Which model is awake on a card, and when to swap it: whose turn includes which
model is awake.

Several models may share one card (an accelerator's memory, or a machine's) where
only one fits awake at a time: waking another (vLLM's sleep mode, or an engine
process started) takes seconds, and nothing runs on the card meanwhile. Who asks
first must not decide (a router that wakes whatever model the next request names
swaps back and forth between a chat model and a batch job's, and each swap is
seconds of chat waiting). :func:`decide` is the rule, pure, over the time it is
given:

1. **Chat wakes a sleeping model ahead of batch work.** Chat waiting for a sleeping
   model holds the awake model's new work (``drain``: what is in flight finishes,
   nothing is cut) and swaps once nothing is in flight, unless the awake model's
   own chat is live and it has not been awake :attr:`ResidencyRules.min_awake_s`
   (two chat models take turns no faster than that; the one whose chat waited
   longest goes first).
2. **Batch waits for a window where the swap costs chat nothing**: no chat for the
   awake model waiting, in flight, or seen for :attr:`ResidencyRules.chat_quiet_s`
   or for as long as the two wakes of a swap there and back take, whichever is
   longer (hysteresis: a pause between two chats is not a window; and chat that
   comes back after a swap waits for both wakes, so waiting that long first bounds
   its loss to twice the least, as in ski rental), the awake model awake at least
   ``min_awake_s``, and none of its own work waiting.
3. **Or for its deadline**: batch whose completion window would close before its
   work is done (its estimated card time, the swap, and
   :attr:`ResidencyRules.deadline_slack_s`) swaps as chat would, chat or not, and
   keeps the card (chat for the other model waits) until it is ``min_awake_s``
   ahead of that point again.
4. A card with nothing awake wakes the model with chat waiting, else the one with
   the earliest batch deadline, else the one with the most work.

A decision names its reason, which ``/turn/log`` shows beside the swap. The swap
itself (sleep one model, wake the other, time both) is an engine-side action the
caller takes; while it runs the card is ``swapping`` and nothing else is decided.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

__all__ = [
    "Card",
    "Demand",
    "Move",
    "ResidencyDecision",
    "ResidencyRules",
    "Why",
    "decide",
]


@dataclass(frozen=True)
class ResidencyRules:
    """How eagerly a card swaps: ``min_awake_s``, the least a model woken stays awake
    before another model's chat (or batch) may take the card, unless a deadline
    presses; ``chat_quiet_s``, how long the awake model's chat must have been silent
    before batch for another model may take the card; ``deadline_slack_s``, the
    margin kept before a batch deadline."""

    min_awake_s: float = 60.0
    chat_quiet_s: float = 30.0
    deadline_slack_s: float = 300.0


@dataclass(frozen=True)
class Demand:
    """One model's work the card could serve: chats waiting (``chat_waiting``; the
    oldest queued at ``chat_oldest``), chats in flight, when its last chat was seen
    (queued or in flight), its batch lines waiting, the earliest completion-window
    deadline among them, and their estimated time on the card when awake."""

    chat_waiting: int = 0
    chat_oldest: float | None = None
    chat_in_flight: int = 0
    last_chat: float | None = None
    batch_waiting: int = 0
    batch_deadline: float | None = None
    batch_work_s: float = 0.0

    @property
    def waiting(self) -> int:
        return self.chat_waiting + self.batch_waiting


@dataclass
class Card:
    """What a card holds: the model awake (None: none), since when, work in flight per
    model, the model being woken (``swapping``: the card runs nothing), and how long
    waking each model takes (``wake_s``, from its activation's profile or the last
    swaps measured)."""

    name: str
    models: tuple[str, ...]
    awake: str | None = None
    awake_since: float = 0.0
    in_flight: int = 0
    swapping: str | None = None
    wake_s: dict[str, float] = field(default_factory=dict)


class Move(StrEnum):
    STAY = "stay"  # the awake model serves on
    DRAIN = "drain"  # the awake model takes no new work: a swap is due once it is idle
    SWAP = "swap"  # put the awake model to sleep and wake ``target`` now


class Why(StrEnum):
    """What a swap is for, in one word (a metric's label; the reason says more)."""

    NOTHING_AWAKE = "nothing_awake"  # the card held no model awake
    DEADLINE = "deadline"  # a batch job's completion window
    CHAT = "chat"  # chat waits for a sleeping model, the awake one's chat is quiet
    CHAT_TURN = "chat_turn"  # two models' chat take turns
    BATCH_WINDOW = "batch_window"  # batch, in a window where it costs chat nothing


@dataclass(frozen=True)
class ResidencyDecision:
    move: Move
    target: str | None = None
    reason: str = ""
    why: Why | None = None  # of a drain or a swap


def decide(
    card: Card, demand: Mapping[str, Demand], now: float, rules: ResidencyRules
) -> ResidencyDecision:
    """What ``card`` should do at ``now`` given each model's ``demand`` (see the
    module docstring). Pure: the same card, demand and time give the same answer."""
    if card.swapping is not None:
        return ResidencyDecision(Move.STAY, card.swapping, f"waking {card.swapping}")
    none = Demand()
    if card.awake is None:
        target = _first_to_wake(card, demand)
        if target is None:
            return ResidencyDecision(Move.STAY, None, "no work for any model")
        reason = f"work waiting for {target}, nothing awake"
        return ResidencyDecision(Move.SWAP, target, reason, Why.NOTHING_AWAKE)
    awake = card.awake
    mine = demand.get(awake, none)
    awake_for = now - card.awake_since
    sleeping = [m for m in card.models if m != awake and demand.get(m, none).waiting]
    if not sleeping:
        return ResidencyDecision(Move.STAY, None, f"{awake} has the only work")
    chat_live = mine.chat_waiting > 0 or mine.chat_in_flight > 0
    # 3. a batch deadline presses: the awake model keeps the card while its own does
    # (until it is ``min_awake_s`` ahead: a swap back and forth costs two wakes) ...
    held = replace(rules, deadline_slack_s=rules.deadline_slack_s + rules.min_awake_s)
    if mine.batch_waiting and _pressed(mine, 0.0, now, held):
        return ResidencyDecision(Move.STAY, None, f"{awake}'s batch deadline is near")
    # ... and a sleeping model's takes it, as chat would, chat or not
    for model in sorted(sleeping, key=lambda m: _deadline(demand[m])):
        wanted = demand[model]
        if wanted.batch_waiting and _pressed(wanted, card.wake_s.get(model, 0.0), now, rules):
            return _toward(card, model, f"{model}'s batch deadline is near", Why.DEADLINE)
    # 1. chat waiting for a sleeping model
    chatty = [m for m in sleeping if demand[m].chat_waiting]
    if chatty:
        model = min(chatty, key=lambda m: _oldest(demand[m]))
        if not chat_live:
            return _toward(card, model, f"chat waiting for {model}", Why.CHAT)
        if awake_for < rules.min_awake_s:
            return ResidencyDecision(
                Move.STAY, model, f"{awake}'s chat is live and it woke {awake_for:.0f} s ago"
            )
        if mine.chat_waiting and _oldest(mine) <= _oldest(demand[model]):
            return ResidencyDecision(Move.STAY, model, f"{awake}'s chat waited longer")
        reason = f"chat waiting for {model}, {awake} had its turn"
        return _toward(card, model, reason, Why.CHAT_TURN)
    # 2. batch for a sleeping model: only in a window where the swap costs chat nothing
    model = min(sleeping, key=lambda m: (_deadline(demand[m]), -demand[m].batch_waiting))
    if chat_live:
        return ResidencyDecision(Move.STAY, model, f"{awake}'s chat is live")
    quiet_for = now - mine.last_chat if mine.last_chat is not None else float("inf")
    # a swap for batch costs chat that comes back both wakes (there and back): the
    # quiet waited for is at least that (ski rental: chat loses at most twice what
    # the best rule in hindsight would have cost it)
    quiet = max(rules.chat_quiet_s, card.wake_s.get(model, 0.0) + card.wake_s.get(awake, 0.0))
    if quiet_for < quiet:
        return ResidencyDecision(
            Move.STAY, model, f"{awake}'s chat was seen {quiet_for:.0f} s ago (waits {quiet:.0f} s)"
        )
    if awake_for < rules.min_awake_s:
        return ResidencyDecision(Move.STAY, model, f"{awake} woke {awake_for:.0f} s ago")
    if mine.batch_waiting:
        return ResidencyDecision(Move.STAY, model, f"{awake}'s own batch is waiting")
    reason = f"batch waiting for {model}, {awake}'s chat quiet"
    return _toward(card, model, reason, Why.BATCH_WINDOW)


def _toward(card: Card, model: str, reason: str, why: Why) -> ResidencyDecision:
    """Swap to ``model`` now if nothing is in flight, else drain first."""
    if card.in_flight:
        return ResidencyDecision(Move.DRAIN, model, f"{reason}: draining {card.awake}", why)
    return ResidencyDecision(Move.SWAP, model, reason, why)


def _first_to_wake(card: Card, demand: Mapping[str, Demand]) -> str | None:
    waiting = [m for m in card.models if m in demand and demand[m].waiting]
    if not waiting:
        return None
    chatty = [m for m in waiting if demand[m].chat_waiting]
    if chatty:
        return min(chatty, key=lambda m: _oldest(demand[m]))
    return min(waiting, key=lambda m: (_deadline(demand[m]), -demand[m].batch_waiting))


def _oldest(d: Demand) -> float:
    return d.chat_oldest if d.chat_oldest is not None else float("inf")


def _deadline(d: Demand) -> float:
    return d.batch_deadline if d.batch_deadline is not None else float("inf")


def _pressed(d: Demand, wake_s: float, now: float, rules: ResidencyRules) -> bool:
    """Whether ``d``'s batch would miss its deadline unless its model wakes now."""
    if d.batch_deadline is None:
        return False
    return now + wake_s + d.batch_work_s + rules.deadline_slack_s >= d.batch_deadline
