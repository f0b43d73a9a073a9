"""``GET /turn`` and ``GET /turn/log``: whose turn it is, and the decisions behind it."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from proxy.admission import Admission
from proxy.scheduler.turns import sentence, turn_report


def wants_text(request: Request) -> bool:
    if request.query_params.get("format") == "text":
        return True
    accept = request.headers.get("accept", "")
    return "text/plain" in accept and "application/json" not in accept


def turn_body(admission: Admission) -> dict[str, Any]:
    admission.tick()
    return {"time": time.time(), "engines": turn_report(admission.scheduler)}


def log_body(admission: Admission, limit: int) -> dict[str, Any]:
    """The most recent decisions, oldest first, with wall-clock times."""
    scheduler = admission.scheduler
    offset = time.time() - scheduler.clock.now()
    decisions = list(scheduler.log)[-limit:] if limit > 0 else []
    return {
        "decisions": [
            {
                "time": d.time + offset,
                "engine": d.engine,
                "request_id": d.job_id,
                "class": d.cls.value,
                "admitted": d.admitted,
                "reason": d.reason.value if d.reason else None,
                "budget": d.budget,
            }
            for d in decisions
        ]
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
