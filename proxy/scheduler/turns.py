"""Whose turn it is, as data and as one plain sentence per engine.

:func:`turn_report` reads the scheduler's state (no changes) into plain data that
``GET /turn``, the status page and ``whoseturn turn`` share; :func:`sentence` says
it in words, e.g. "engine-a: interactive's turn — 2 chat requests waiting for their
first token (p95 TTFT 310 ms, target 300 ms); batch held while interactive work
waits: 12 queued, 2,048 of 4,096 budget tokens in prefill".
"""

from __future__ import annotations

from typing import Any

from proxy.scheduler.budget import percentile
from proxy.scheduler.core import Scheduler
from proxy.scheduler.state import EngineState
from proxy.scheduler.types import HeldReason, Phase, TrafficClass, Turn

Json = dict[str, Any]

REASON_WORDS = {
    HeldReason.INTERACTIVE_WAITING: "while interactive work waits",
    HeldReason.PREFILL_BUDGET: "by the prefill budget",
    HeldReason.KV_HEADROOM: "for KV-cache headroom",
    HeldReason.CONCURRENCY_CAP: "at the concurrency cap",
    HeldReason.ENGINE_UNHEALTHY: "because the engine is unhealthy",
}


def _queued(scheduler: Scheduler, engine: EngineState, cls: TrafficClass) -> int:
    return sum(1 for j in scheduler.queues[cls] if engine.eligible(j))


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
        "up": engine.up,
        "models": sorted(engine.settings.models),
        "budget": {
            "tokens": b.tokens,
            "min_tokens": s.min_tokens,
            "max_tokens": s.max_tokens,
            "history": [[t - now, tokens] for t, tokens in b.history],
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
    if prefill > limit:  # the single-request rule, not a broken budget
        budget = f"{prefill:,} tokens in prefill, over the {limit:,} budget: "
        budget += "one prompt is always allowed"
    reason = r["held_reason"]
    if reason is None:
        if queued or r["prefill_tokens"]["batch"] or r["decode_streams"]["batch"]:
            return f"batch admitted: {queued:,} queued, {budget}"
        return "no batch waiting"
    words = REASON_WORDS[HeldReason(reason)]
    if reason == HeldReason.KV_HEADROOM:
        words += f" (KV cache {r['engine_load']['kv_usage']:.0%} used)"
    return f"batch held {words}: {queued:,} queued, {budget}"


def sentence(r: Json) -> str:
    """The engine's turn in one plain sentence."""
    name, turn = r["engine"], r["turn"]
    ttft = r["interactive_ttft"]
    if turn == Turn.INTERACTIVE:
        n = r["interactive_waiting_first_token"]
        head = (
            f"interactive's turn — {_plural(n, 'chat request')} waiting for "
            f"{'its' if n == 1 else 'their'} first token (p95 TTFT {_ms(ttft['p95_s'])}, "
            f"target {_ms(ttft['target_s'])})"
        )
    elif turn == Turn.BATCH:
        tokens = r["prefill_tokens"]["batch"]
        streams = r["decode_streams"]["batch"]
        head = (
            f"batch's turn — {tokens:,} batch prompt tokens in prefill, "
            f"{_plural(streams, 'batch stream')} decoding"
        )
    elif turn == Turn.SATURATED:
        head = "saturated — no headroom for anyone" if r["up"] else "saturated — engine down"
    else:
        head = "idle — nothing is waiting for it"
    return f"{name}: {head}; {_batch_clause(r)}"
