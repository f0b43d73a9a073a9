"""``GET /turn`` and ``GET /turn/log``: whose turn it is, and the decisions behind it."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from proxy.admission import Admission
from proxy.batch.lines import job_line
from proxy.scheduler.budget import BudgetChange
from proxy.scheduler.turns import sentence


def wants_text(request: Request) -> bool:
    if request.query_params.get("format") == "text":
        return True
    accept = request.headers.get("accept", "")
    return "text/plain" in accept and "application/json" not in accept


def turn_body(admission: Admission) -> dict[str, Any]:
    """Whose turn it is on each engine, as of now (a read: the scheduler does not run)."""
    return {"time": time.time(), "engines": admission.report()}


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="milliseconds")


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
    found = job_line(job_id)
    if found is None:
        return None
    return {"id": found[0], "custom_id": found[1], "attempt": found[2]}


def log_body(admission: Admission, limit: int) -> dict[str, Any]:
    """The most recent decisions, oldest first, with wall-clock times; and the most
    recent moves of the budgets (``budget``), each with the numbers it judged."""
    offset = time.time() - admission.now()
    decisions = admission.decisions(limit)
    moves = admission.budget_changes(limit)
    return {
        "budget": [budget_change_body(name, c, offset) for name, c in moves],
        "decisions": [
            {
                "time": d.time + offset,
                "engine": d.engine,
                "request_id": d.job_id,
                "class": d.cls.value,
                "admitted": d.admitted,
                "reason": d.reason.value if d.reason else None,
                "budget": d.budget,
                "batch": _batch_line(d.job_id),
            }
            for d in decisions
        ],
    }


def install_turn_routes(app: FastAPI, admission_of: Callable[[Request], Admission]) -> None:
    """``admission_of(request)`` returns the running app's :class:`Admission`."""

    @app.get("/turn", response_model=None)
    async def turn(request: Request) -> Response:
        body = turn_body(admission_of(request))
        if wants_text(request):
            return PlainTextResponse("\n".join(sentence(e) for e in body["engines"]) + "\n")
        return JSONResponse(body)

    @app.get("/turn/log")
    async def turn_log(request: Request, limit: int = 100) -> JSONResponse:
        return JSONResponse(log_body(admission_of(request), limit))
