"""Whose turn it is, as data and as one plain sentence per engine.

:func:`turn_report` reads the scheduler's state (no changes) into plain data that
``GET /turn``, the status page and ``whoseturn turn`` share; :func:`sentence` says
it in words, e.g. "engine-a: interactive's turn now; interactive 70% of the last
10 s — 2 chat requests waiting for their first token (p95 TTFT 310 ms, target
300 ms); batch held while interactive work waits: 12 queued, 2,048 of 4,096
budget tokens in prefill".

The turn changes at every event, many times a second under mixed load; the
report says it beside the share of each turn over the last :data:`RECENT_S`
seconds (``recent``), which does not flip. Times in the report are the
scheduler's clock as ages (seconds before now, negative); the HTTP edge turns
them into wall-clock ISO 8601.
"""

from __future__ import annotations

from typing import Any

from proxy.scheduler.budget import BudgetChange, BudgetController, percentile
from proxy.scheduler.core import Scheduler
from proxy.scheduler.history import shares
from proxy.scheduler.state import EngineState
from proxy.scheduler.types import HeldReason, Phase, TrafficClass, Turn

Json = dict[str, Any]
RECENT_S = 10  # the window the headline's share of turns is judged over
SIGNAL_WORDS = {"ttft": "time to first token", "gap": "token gap"}

REASON_WORDS = {
    HeldReason.INTERACTIVE_WAITING: "while interactive work waits",
    HeldReason.PREFILL_BUDGET: "by the prefill budget",
    HeldReason.KV_HEADROOM: "for KV-cache headroom",
    HeldReason.CONCURRENCY_CAP: "at the concurrency cap",
    HeldReason.ENGINE_UNHEALTHY: "because the engine is unhealthy",
    HeldReason.TENANT_SHARE: "while its tenant holds its share of prefill",
}


def _queued(scheduler: Scheduler, engine: EngineState, cls: TrafficClass) -> int:
    """The ``cls`` jobs queued that ``engine`` may take (those it is eligible for),
    counted per model line rather than by a walk of the queue."""
    if engine.draining:
        return 0
    return scheduler.queues[cls].count_for(engine.name, engine.settings.models)


def _signal(window: list[float], judged: float | None, target: float, aim: float) -> Json:
    """A signal of the budget loop: the window's p95, the percentile the loop judged
    (samples since its last cut; None while too few), and the target it aims under."""
    return {
        "p95_s": percentile(window, 0.95) if window else None,
        "judged_s": judged,
        "target_s": target,
        "aim_s": aim * target,
        "samples": len(window),
    }


def recent(engine: EngineState, now: float, window_s: int = RECENT_S) -> Json:
    """The share of each turn over the last ``window_s`` whole seconds (and the one
    under way), and the turn that held most of it."""
    seconds = engine.turn_history_at(now, window_s + 1)
    split = shares(seconds)
    covered = sum(sum(spent.values()) for _, spent in seconds)
    return {
        "window_s": window_s,
        "covered_s": covered,
        "turn": max(split, key=lambda t: split[t]).value,
        "shares": {t.value: share for t, share in split.items()},
    }


def _cut_why(b: BudgetController, c: BudgetChange, now: float) -> Json:
    """What a cut judged: the signal over its aim, its value, aim and target."""
    s = b.settings
    ttft = c.cause == "ttft"
    return {
        "signal": c.cause,
        "value_s": c.ttft_s if ttft else c.gap_s,
        "aim_s": c.ttft_aim_s if ttft else c.gap_aim_s,
        "target_s": s.ttft_target_s if ttft else s.gap_target_s,
        "samples": c.ttft_samples if ttft else c.gap_samples,
        "before": c.before,
        "after": c.after,
        "age_s": c.time - now,
    }


def budget_state(b: BudgetController, now: float) -> Json:
    """Where the budget stands and why: ``floor`` (at its minimum), ``ceiling``,
    ``falling`` or ``rising`` (moved that way within the loop's window), or
    ``steady``; ``why`` is the last cut's judgement while at the floor or falling."""
    s = b.settings
    last = b.changes[-1] if b.changes else None
    recent_move = last is not None and now - last.time <= s.window_s
    if b.tokens <= s.min_tokens:
        state = "floor"
    elif b.tokens >= s.max_tokens:
        state = "ceiling"
    elif recent_move and last is not None and last.after < last.before:
        state = "falling"
    elif recent_move:
        state = "rising"
    else:
        state = "steady"
    cut = next((c for c in reversed(b.changes) if c.after < c.before), None)
    why = _cut_why(b, cut, now) if cut is not None and state in ("floor", "falling") else None
    return {"state": state, "why": why}


def engine_report(scheduler: Scheduler, engine: EngineState, now: float) -> Json:
    b = engine.budget
    s = b.settings
    p_ttft, p_gap = b.signal(now)
    waiting_first = _queued(scheduler, engine, TrafficClass.INTERACTIVE) + sum(
        1
        for j in engine.inflight.values()
        if j.cls is TrafficClass.INTERACTIVE and j.phase is Phase.PREFILL
    )
    return {
        "engine": engine.name,
        "turn": engine.turn.value,
        "held_reason": engine.held_reason.value if engine.held_reason else None,
        "turn_for_s": max(0.0, now - engine.turn_since),
        "recent": recent(engine, now),
        "up": engine.up,
        "models": sorted(engine.settings.models),
        # on a card: awake, draining (for a swap), asleep or waking; None: on no card
        "residency": (engine.resting or "awake") if engine.settings.card else None,
        "budget": {
            "tokens": b.tokens,
            "min_tokens": s.min_tokens,
            "max_tokens": s.max_tokens,
            "history": [[t - now, tokens] for t, tokens in b.history],
            **budget_state(b, now),
        },
        "prefill_tokens": {c.value: engine.prefill_tokens(c) for c in TrafficClass},
        "decode_streams": {c.value: engine.decode_streams(c) for c in TrafficClass},
        "queued": {c.value: _queued(scheduler, engine, c) for c in TrafficClass},
        "interactive_waiting_first_token": waiting_first,
        "interactive_ttft": _signal(b.ttft.values(now), p_ttft, s.ttft_target_s, s.aim),
        "interactive_gap": _signal(b.gaps.values(now), p_gap, s.gap_target_s, s.aim),
        "engine_load": {
            "kv_usage": engine.load.kv_usage,
            "waiting": engine.load.waiting,
            "running": engine.load.running,
        },
        "turn_seconds": {t.value: s for t, s in engine.turn_seconds_at(now).items()},
        "held_seconds": {r.value: s for r, s in engine.held_seconds_at(now).items()},
        "prefix_index": {
            "mode": engine.prefix.mode.value,
            "route_by": scheduler.settings.route_by,
            "blocks": len(engine.prefix),
            "block_size": engine.prefix.block_size,
            "capacity_blocks": engine.prefix.capacity,
            "ages_at_blocks": engine.prefix.limit,
        },
    }


def turn_report(scheduler: Scheduler) -> list[Json]:
    """One entry per engine, in configuration order."""
    now = scheduler.clock.now()
    return [engine_report(scheduler, e, now) for e in scheduler.engines.values()]


def _ms(seconds: float | None) -> str:
    return "n/a" if seconds is None else f"{seconds * 1000:,.0f} ms"


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def _batch_clause(r: Json) -> str:
    queued = r["queued"]["batch"]
    prefill = r["prefill_tokens"]["interactive"] + r["prefill_tokens"]["batch"]
    limit = r["budget"]["tokens"]
    budget = f"{prefill:,} of {limit:,} budget tokens in prefill"
    if prefill > limit:  # not a broken budget: say which rule let it pass
        budget = f"{prefill:,} tokens in prefill, over the {limit:,} budget: "
        within = r["prefill_tokens"]["batch"] <= limit and r["prefill_tokens"]["interactive"]
        budget += "chat is never held by it" if within else "one prompt is always allowed"
    reason = r["held_reason"]
    if reason is None:
        if queued or r["prefill_tokens"]["batch"] or r["decode_streams"]["batch"]:
            return f"batch admitted: {queued:,} queued, {budget}"
        return "no batch waiting"
    words = REASON_WORDS[HeldReason(reason)]
    if reason == HeldReason.KV_HEADROOM:
        words += f" (KV cache {r['engine_load']['kv_usage']:.0%} used)"
    return f"batch held {words}: {queued:,} queued, {budget}"


def _recent_clause(r: Json) -> str:
    """``batch's turn now; batch 83% of the last 10 s``."""
    rec = r["recent"]
    split = rec["shares"]
    top = rec["turn"]
    if split[top] <= 0:
        return f"{_whose(r['turn'])} now"
    return f"{_whose(r['turn'])} now; {top} {split[top]:.0%} of the last {rec['window_s']} s"


def _whose(turn: str) -> str:
    return f"{turn}'s turn" if turn in (Turn.INTERACTIVE, Turn.BATCH) else turn


def _budget_clause(r: Json) -> str:
    """Why the budget is at its floor or falling, with the signal that cut it; and
    a token gap or TTFT over its target tied to what the budget did about it."""
    b = r["budget"]
    state, why = b["state"], b["why"]
    out = ""
    if state in ("floor", "falling"):
        where = "at its floor" if state == "floor" else "falling"
        out = f"budget {b['tokens']:,} tokens, {where}"
        if why is not None:
            out += (
                f": cut for the {SIGNAL_WORDS[why['signal']]} (p95 {_ms(why['value_s'])} "
                f"over its aim {_ms(why['aim_s'])}, target {_ms(why['target_s'])}, "
                f"{why['samples']:,} samples, {abs(why['age_s']):.0f} s ago)"
            )
        elif state == "floor":
            out += " (its configured minimum)"
    for key, signal in (("interactive_ttft", "ttft"), ("interactive_gap", "gap")):
        sig = r[key]
        if sig["p95_s"] is None or sig["p95_s"] <= sig["target_s"]:
            continue
        cut_for_it = why is not None and why["signal"] == signal
        link = (
            "the budget was cut for it"
            if cut_for_it
            else "not judged against batch yet"
            if sig["judged_s"] is None
            else "the budget loop judges only chats beside batch prefill"
        )
        words = f"{SIGNAL_WORDS[signal]} p95 {_ms(sig['p95_s'])} over its target "
        words += f"{_ms(sig['target_s'])}: {link}"
        out = f"{out}; {words}" if out else words
    return out


def sentence(r: Json) -> str:
    """The engine's turn in one plain sentence: the turn now and over the last
    seconds, what it is doing, why batch waits, and why the budget is where it is."""
    name, turn = r["engine"], r["turn"]
    ttft = r["interactive_ttft"]
    resting = r.get("residency")
    if resting == "draining":  # on a card, for a swap
        return f"{name}: draining for a swap on its card — what runs finishes, nothing new starts."
    if resting in ("asleep", "waking"):
        return f"{name}: {resting} on its card — its model's work waits for the wake."
    if turn == Turn.INTERACTIVE:
        n = r["interactive_waiting_first_token"]
        head = (
            f"{_plural(n, 'chat request')} waiting for "
            f"{'its' if n == 1 else 'their'} first token (p95 TTFT {_ms(ttft['p95_s'])}, "
            f"target {_ms(ttft['target_s'])})"
        )
    elif turn == Turn.BATCH:
        tokens = r["prefill_tokens"]["batch"]
        streams = r["decode_streams"]["batch"]
        head = (
            f"{tokens:,} batch prompt tokens in prefill, "
            f"{_plural(streams, 'batch stream')} decoding"
        )
    elif turn == Turn.SATURATED:
        head = "no headroom for anyone" if r["up"] else "engine down"
    else:
        head = "nothing is waiting for it"
    budget = _budget_clause(r)
    tail = f"; {budget}" if budget else ""
    return f"{name}: {_recent_clause(r)} — {head}; {_batch_clause(r)}{tail}"
