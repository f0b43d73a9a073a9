"""``GET /status``: the live status page, read from the top in five seconds: one
verdict (``Chat on target; batch running within budget``), a row per engine with the
numbers behind it, then each engine's card and the decisions grouped by story.

Every figure has one source, its window said beside it: TTFT and token gap are the
budget loop's own (``/turn``'s ``judged_s``, or the figure that cut), coloured by the
loop's aim and target from ``/turn``; an engine's state (down, ejected, draining,
saturated, idle, or whose turn) is derived from ``/turn``'s ``up``, ``health`` and
``turn``. docs/scheduling.md says what the page used to contradict itself with.

The page is one self-contained HTML file shipped as package data
(``proxy/api/static/status.html``: plain HTML, CSS and JavaScript, nothing fetched
from elsewhere). In the browser it polls ``GET /turn``, ``GET /turn/log``,
``GET /turn/history`` and ``GET /status/batches``, relative to its own address, so it
also works behind a path prefix; and ``GET /metrics`` every two seconds for the
prefix cache's hit rate since start (its counters are the proxy's metrics and
nothing else keeps them), so no route of its own is needed for them. Its tenants
panel (each tenant's share against what it is owed, and each class's fairness
index) is drawn from ``GET /turn`` and shown only while a tenant is active.
"""

from __future__ import annotations

from importlib.resources import files

from fastapi import FastAPI
from fastapi.responses import HTMLResponse

PAGE = "static/status.html"


def status_page() -> str:
    """The page's HTML, read from the installed package."""
    return files("proxy.api").joinpath(PAGE).read_text(encoding="utf-8")


def install_status_route(app: FastAPI) -> None:
    """Serve the page at ``GET /status``; it is read once, here."""
    html = status_page()
    headers = {
        "Cache-Control": "no-cache",
        # Everything the page needs is inline; it talks only to this proxy.
        "Content-Security-Policy": (
            "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; "
            "connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'"
        ),
        "X-Content-Type-Options": "nosniff",
    }

    @app.get("/status", response_class=HTMLResponse, include_in_schema=False)
    async def status() -> HTMLResponse:
        return HTMLResponse(html, headers=headers)
