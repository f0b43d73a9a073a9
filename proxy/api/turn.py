"""``GET /turn``, ``GET /turn/log`` and ``GET /turn/history``: whose turn it is,
the decisions behind it, and the turns of the last minutes; and, per class, what
each tenant was served against what it is owed, with Jain's fairness index.

Every time these routes give is wall-clock ISO 8601 UTC with milliseconds
(``2026-12-01T06:29:41.001+00:00``); the scheduler's own clock is converted at
this edge. All three are reads: they never run the scheduler or change its state.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from proxy.admission import Admission
from proxy.api.box import Box, box_turns
from proxy.api.docs import TURN, TURN_HISTORY, TURN_LOG, TURN_QUERY
from proxy.api.piece_sender import PieceChoice
from proxy.cards import CardKeeper
from proxy.openai.line_ids import job_line
from proxy.scheduler import Abort, Route, TrafficClass
from proxy.scheduler.budget import BudgetChange
from proxy.scheduler.fair import WINDOW_S, TenantShare
from proxy.scheduler.history import DEFAULT_SPAN_S
from proxy.scheduler.turns import sentence


def turn_text(body: dict[str, Any]) -> str:
    """``/turn`` as text: a sentence per engine, the tenants', the ledger's; in a box,
    each worker's engines, the worker named."""
    lines = [sentence(e) for e in body["engines"]]
    lines += tenant_sentences(body)
    lines += [card_sentence(c) for c in body.get("cards", ())]
    if "ledger" in body:
        lines.append(ledger_sentence(body["ledger"]))
    box = body.get("box")
    if box:
        for name, turn in box["workers"].items():
            if name != box["this_worker"]:
                lines += [f"[{name}] {sentence(e)}" for e in turn.get("engines", ())]
        if box["missing"]:
            lines.append(f"Workers that did not answer: {', '.join(box['missing'])}.")
    return "\n".join(lines) + "\n"


def wants_text(request: Request) -> bool:
    if request.query_params.get("format") == "text":
        return True
    accept = request.headers.get("accept", "")
    return "text/plain" in accept and "application/json" not in accept


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds")


def _with_times(engine: dict[str, Any], wall: float) -> dict[str, Any]:
    """The report's ages (seconds before now) as ISO times: the budget's history
    and last cut, and when the current turn began."""
    budget = dict(engine["budget"])
    budget["history"] = [[_iso(wall + age), tokens] for age, tokens in budget["history"]]
    if budget.get("why") is not None:
        budget["why"] = {**budget["why"], "time": _iso(wall + budget["why"]["age_s"])}
    since = _iso(wall - engine["turn_for_s"])
    return {**engine, "turn_since": since, "budget": budget}


class EngineWatch(Protocol):
    """What ``/turn`` reads of the engines' health checks and outlier ejection
    (:class:`proxy.engines.EngineMonitor` meets it)."""

    @property
    def failures(self) -> Mapping[str, int]: ...

    @property
    def ejected_because(self) -> Mapping[str, str]: ...


HEALTH_CHECK_EJECTION = "health checks failed in a row"
"""How the monitor words an ejection by its health checks; any other reason is the
request path's outlier detection (:mod:`proxy.engines._monitor`)."""


def engine_health(
    admission: Admission, entry: dict[str, Any], watch: EngineWatch | None
) -> dict[str, Any]:
    """An engine's health facts, for the status page to name its state by: whether it
    is ``up``; ``draining`` (it left discovery: no new work; an engine whose models
    are not known yet never reads draining); the health checks failed in a row now;
    and, while it is out, ``ejected_by`` (``health_checks``, or ``requests``: outlier
    detection on the request path) with the monitor's ``why``. Without ``watch``
    the last three are unknown (0 and None)."""
    name, up, models = entry["engine"], entry["up"], entry["models"]
    resting = entry.get("residency") not in (None, "awake")  # on a card, not leaving
    leaving = bool(models) and name not in admission.engines_up_for(models[0])
    draining = up and not resting and leaving
    why = None if up or watch is None else watch.ejected_because.get(name)
    by = (
        None
        if why is None
        else ("health_checks" if why.endswith(HEALTH_CHECK_EJECTION) else "requests")
    )
    failed = 0 if watch is None else watch.failures.get(name, 0)
    return {"up": up, "draining": draining, "failed_checks": failed, "ejected_by": by, "why": why}


def turn_body(
    admission: Admission,
    pieces: dict[str, dict[str, object]] | None = None,
    replica: str | None = None,
    ledger: dict[str, Any] | None = None,
    watch: EngineWatch | None = None,
    cards: Sequence[CardKeeper] = (),
) -> dict[str, Any]:
    """Whose turn it is on each engine, as of now (a read: the scheduler does not run);
    each engine's ``health`` (:func:`engine_health`, from ``watch`` where given); with
    ``pieces``, each engine's piecing facts (:mod:`proxy.api.piece_sender`); with
    ``replica``, the name of the proxy process that answers (with several workers or
    replicas, each answers with its own view); with ``ledger``, the shared ledger's
    state (:meth:`proxy.replicas.SharedBudget.report`; ``down_since`` added while it
    is down); with ``cards``, each card's models and which is awake
    (:meth:`proxy.cards.CardKeeper.view`)."""
    wall = time.time()
    engines = [_with_times(e, wall) for e in admission.report()]
    for entry in engines:
        entry["health"] = engine_health(admission, entry, watch)
        if pieces is not None and entry.get("engine") in pieces:
            entry["piecing"] = pieces[entry["engine"]]
    body: dict[str, Any] = {"time": _iso(wall), "replica": replica, "engines": engines}
    body |= tenants_body(admission)
    if cards:
        body["cards"] = [k.view() for k in cards]
    if ledger is not None:
        down_for = ledger.get("down_for_s")
        since = None if down_for is None else _iso(wall - down_for)
        body["ledger"] = {**ledger, "down_since": since}
    return body


def _tenant_body(t: TenantShare) -> dict[str, Any]:
    return {
        "tenant": t.tenant,
        "weight": t.weight,
        "tier": t.tier.value,
        "queued": t.queued,
        "in_flight": t.in_flight,
        "tokens": t.tokens,
        "share": t.share,
        "owed": t.owed,
    }


def tenants_body(admission: Admission) -> dict[str, Any]:
    """Per class, each tenant active in the fair-share window (``fairness_window_s``)
    by name, with its weight, tier, work queued and in flight, and its share of the
    class's tokens against what it is owed; and each class's Jain index (None while
    fewer than two tenants waited)."""
    tenants: dict[str, list[dict[str, Any]]] = {c.value: [] for c in TrafficClass}
    for t in admission.tenant_shares():
        tenants[t.cls.value].append(_tenant_body(t))
    return {
        "fairness_window_s": WINDOW_S,
        "tenants": tenants,
        "fairness": {c.value: admission.fairness(c) for c in TrafficClass},
    }


def fairness_words(index: float | None) -> str:
    """Jain's index in plain words: it is 1 when every tenant that waited got its
    weight's part, and falls only slowly (two tenants, one served twice its part
    over the other: 0.9), so the verdicts are drawn close to 1. The status page
    says the same words."""
    if index is None:
        return "not judged: fewer than two tenants waited"
    if index >= 0.99:
        return "fair"
    if index >= 0.9:
        return "nearly fair"
    return "unfair"


def card_sentence(card: dict[str, Any]) -> str:
    """A card in a sentence: which model is awake, for how long, and what is next."""
    name = card["card"]
    if not card["swaps"]:
        return f"Card {name}: every model fits awake ({', '.join(card['awake'])})."
    awake = card["awake"]
    if card["swapping_to"] is not None:
        now = f"waking {card['swapping_to']}"
    elif awake:
        now = f"{awake[0]} awake for {card['awake_for_s']:.0f} s"
    else:
        now = "nothing awake"
    asleep = [m for m, v in card["models"].items() if v["state"] == "asleep"]
    text = f"Card {name}: {now}"
    if asleep:
        text += f"; asleep: {', '.join(asleep)}"
    decision = card.get("decision")
    if decision is not None and decision["reason"]:
        text += f" ({decision['reason']})"
    return text + "."


def tenant_sentences(body: dict[str, Any]) -> list[str]:
    """For ``/turn?format=text``: a line per class with active tenants, its fairness
    and each tenant's share against what it is owed."""
    lines = []
    window = f"{body['fairness_window_s']:.0f} s"
    for cls, rows in body["tenants"].items():
        if not rows:
            continue
        index = body["fairness"][cls]
        head = f"{cls} tenants, last {window}: fairness "
        head += f"{index:.2f}, {fairness_words(index)}" if index is not None else "n/a"
        parts = [
            f"{t['tenant']} {t['share']:.0%} of tokens (owed {t['owed']:.0%}; "
            f"{t['queued']:,} queued, {t['in_flight']:,} in flight)"
            for t in sorted(rows, key=lambda t: (-t["share"], t["tenant"]))
        ]
        if index is None:
            parts.append(fairness_words(None))
        lines.append(f"{head} — {'; '.join(parts)}")
    return lines


def ledger_sentence(ledger: dict[str, Any]) -> str:
    """The shared ledger's state in one line, for ``/turn?format=text``."""
    if ledger["up"]:
        return "shared ledger: up"
    shares = ", ".join(f"{name} {e['local_share_tokens']}" for name, e in ledger["engines"].items())
    return (
        f"shared ledger: DOWN for {ledger['down_for_s']:.1f} s ({ledger['cause']}); "
        f"batch on a local budget (tokens: {shares or 'no engine'})"
    )


def history_body(admission: Admission, seconds: int) -> dict[str, Any]:
    """Each engine's last ``seconds`` whole seconds (at most the ring's span), oldest
    first: for each, its start and the share of it spent in each turn."""
    wall, now = time.time(), admission.now()
    seconds = max(1, min(seconds, DEFAULT_SPAN_S))
    return {
        "time": _iso(wall),
        "seconds": seconds,
        "engines": [
            {
                "engine": name,
                "history": [
                    {
                        "time": _iso(wall + (second - now)),
                        "turns": {t.value: s for t, s in spent.items()},
                    }
                    for second, spent in ring
                ],
            }
            for name, ring in admission.turn_history(seconds)
        ],
    }


def budget_change_body(engine: str, c: BudgetChange, offset: float) -> dict[str, Any]:
    """One move of an engine's budget with the numbers judged (time in ISO 8601)."""
    return {
        "time": _iso(c.time + offset),
        "engine": engine,
        "before": c.before,
        "after": c.after,
        "cause": c.cause,
        "ttft_s": c.ttft_s,
        "ttft_samples": c.ttft_samples,
        "ttft_aim_s": c.ttft_aim_s,
        "gap_s": c.gap_s,
        "gap_samples": c.gap_samples,
        "gap_aim_s": c.gap_aim_s,
    }


def _batch_line(job_id: str) -> dict[str, Any] | None:
    """The Batch API job and line a decision's work belongs to, if any."""
    found = job_line(job_id.partition("#")[0])  # a piece's job: its prompt's line
    if found is None:
        return None
    return {"id": found[0], "custom_id": found[1], "attempt": found[2]}


def _abort_body(abort: Abort | None) -> dict[str, Any] | None:
    """Why a batch job was aborted in prefill (:mod:`proxy.scheduler.aborts`)."""
    if abort is None:
        return None
    return {
        "chat": abort.chat_id,
        "chat_waited_s": round(abort.waited_s, 4),
        "prefill_left_s": round(abort.remaining_s, 4),
        "ttft_aim_s": round(abort.aim_s, 4),
        "number": abort.number,
        "max": abort.limit,
    }


def _route_body(route: Route | None) -> dict[str, Any] | None:
    """Why the engine was chosen, with the cached tokens expected on each candidate
    that held any (:func:`proxy.scheduler.routing.by_cost`)."""
    if route is None:
        return None
    return {
        "why": route.why,
        "cached_tokens": dict(route.cached),
        "expected_prefill_tokens": route.cost,
    }


def log_body(
    admission: Admission,
    limit: int,
    choices: Sequence[PieceChoice] = (),
    cards: Sequence[CardKeeper] = (),
) -> dict[str, Any]:
    """The most recent decisions, oldest first, with wall-clock times and each one's
    tenant (``""``: anonymous); the most recent moves of the budgets (``budget``),
    each with the numbers it judged; the most recent choices of whole or pieces
    for a long batch prompt (``piecing``: the engine, and why); and the most recent
    drains and swaps of ``cards`` (``cards``: the model woken and put to sleep, the
    reason, each step's seconds)."""
    offset = time.time() - admission.now()
    decisions = admission.decisions(limit)
    moves = admission.budget_changes(limit)
    events = sorted((e for k in cards for e in k.log), key=lambda e: e.time)[-limit:]
    return {
        "cards": [
            {
                "time": _iso(e.time + offset),
                "card": e.card,
                "action": e.action,
                "model": e.model,
                "asleep": e.asleep,
                "reason": e.reason,
                "why": e.why,
                "sleep_s": e.sleep_s,
                "wake_s": e.wake_s,
            }
            for e in events
        ],
        "budget": [budget_change_body(name, c, offset) for name, c in moves],
        "piecing": [
            {
                "time": _iso(c.time + offset),
                "engine": c.engine,
                "request_id": c.request_id,
                "pieces": c.choice.pieces,
                "why": c.choice.why,
                "batch": _batch_line(c.request_id),
            }
            for c in choices
        ],
        "decisions": [
            {
                "time": _iso(d.time + offset),
                "engine": d.engine,
                "request_id": d.job_id,
                "class": d.cls.value,
                "tenant": d.tenant,
                "admitted": d.admitted,
                "reason": d.reason.value if d.reason else None,
                "budget": d.budget,
                "piece": d.piece,
                "action": d.action,
                "abort": _abort_body(d.abort),
                "route": _route_body(d.route),
                "batch": _batch_line(d.job_id),
            }
            for d in decisions
        ],
    }


def install_turn_routes(
    app: FastAPI,
    admission_of: Callable[[Request], Admission],
    pieces_of: Callable[[Request], dict[str, dict[str, object]] | None] = lambda _: None,
    replica_of: Callable[[Request], str | None] = lambda _: None,
    choices_of: Callable[[Request, int], Sequence[PieceChoice]] = lambda _, __: (),
    ledger_of: Callable[[Request], dict[str, Any] | None] = lambda _: None,
    watch_of: Callable[[Request], EngineWatch | None] = lambda _: None,
    box_of: Callable[[Request], Box | None] = lambda _: None,
    cards_of: Callable[[Request], Sequence[CardKeeper]] = lambda _: (),
) -> None:
    """``admission_of(request)`` returns the running app's :class:`Admission`;
    ``pieces_of(request)`` its engines' piecing facts, if it has any;
    ``replica_of(request)`` its replica name; ``choices_of(request, limit)`` its most
    recent piecing choices; ``ledger_of(request)`` its shared ledger's state, if it
    has one; ``watch_of(request)`` its engine monitor (why an engine is out);
    ``box_of(request)`` its box, when it is one of a box's workers: its ``/turn``
    then holds every worker's (:func:`proxy.api.box.box_turns`), unless asked for its
    own (``?scope=worker``); ``cards_of(request)`` its cards' keepers."""

    @app.get("/turn", response_model=None, responses=TURN, openapi_extra=TURN_QUERY)
    async def turn(request: Request) -> Response:
        body = turn_body(
            admission_of(request),
            pieces_of(request),
            replica_of(request),
            ledger_of(request),
            watch_of(request),
            cards_of(request),
        )
        box = box_of(request)
        if box is not None and request.query_params.get("scope") != "worker":
            authorization = request.headers.get("authorization")
            body["box"] = await box_turns(box, dict(body), authorization)
        if wants_text(request):
            return PlainTextResponse(turn_text(body))
        return JSONResponse(body)

    @app.get("/turn/log", responses=TURN_LOG)
    async def turn_log(request: Request, limit: int = 100) -> JSONResponse:
        body = log_body(admission_of(request), limit, choices_of(request, limit), cards_of(request))
        return JSONResponse(body)

    @app.get("/turn/history", responses=TURN_HISTORY)
    async def turn_history(request: Request, seconds: int = 60) -> JSONResponse:
        return JSONResponse(history_body(admission_of(request), seconds))
