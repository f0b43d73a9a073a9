"""Before a run against servers the caller started (``--target``, ``--direct``): is
each one there, and can it serve the workload? ``GET /v1/models`` of each (and of a
proxy ``GET /readyz``), a second or two at most, so that a server that is down is said
at once in one line that names it and what to do, not after a whole run of failed
requests and a traceback.

A server is there if it answers at all: a 401 or 403 (a proxy with keys; the
workload's tenants send theirs) counts. A 404 means the URL is not a base URL (one
ending in ``/v1`` is the usual slip); a 5xx, a server that is up but failing. If it
lists its models and the workload's is not among them, every request would be
refused: that is said too. A proxy with no engine ready (``/readyz`` 503) would
answer every request 503; a ``/readyz`` of any other status passes (not a whoseturn
proxy: its models alone are judged).

:class:`Unreachable` is also what a run raises when none of its requests got an
answer (:func:`unanswered`), and :func:`failure_line` words any other failure to
reach a server, so the command ends with the same kind of line.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import httpx

if TYPE_CHECKING:
    from loadtests.harness.client import Record

TIMEOUT = httpx.Timeout(2.0, connect=1.0)
"""A server on this machine or the next answers ``/v1/models`` in milliseconds."""


class Unreachable(Exception):
    """A server the run needs does not answer, or cannot serve it: the message is the
    whole line to print (what, where, what to do)."""


@dataclass(frozen=True)
class Server:
    """A server the caller gave: its base URL, the flag that gave it, what it is."""

    url: str
    flag: str  # "--target" or "--direct"

    @property
    def what(self) -> str:
        return "the proxy" if self.flag == "--target" else "the engine"

    @property
    def remedy(self) -> str:
        if self.flag == "--target":
            return "start it (whoseturn serve --engine URL) or give its base URL with --target"
        return "start it or give its base URL (without /v1) with --direct"


def check(servers: list[Server], model: str, client: httpx.Client | None = None) -> None:
    """Raise :class:`Unreachable` for the first of ``servers`` that does not answer,
    or that lists its models without ``model``, or (a proxy) has no engine ready."""
    with client or httpx.Client(timeout=TIMEOUT) as http:
        for server in servers:
            _check_one(http, server, model)


def _check_one(http: httpx.Client, server: Server, model: str) -> None:
    models = _get(http, server, "/v1/models")
    if models.status_code == 404:
        raise Unreachable(
            f"{server.url} answers, but not as an OpenAI-compatible server (GET "
            f"{server.url}/v1/models: 404): give {server.what}'s base URL, without /v1, "
            f"with {server.flag}"
        )
    if models.status_code >= 500:
        raise Unreachable(
            f"{server.what} at {server.url} is up but failing (GET /v1/models: "
            f"{models.status_code} {_excerpt(models)}): see its log"
        )
    served = _model_ids(models)
    if served and model not in served:
        raise Unreachable(
            f"{server.what} at {server.url} serves {', '.join(served)}, not the "
            f"workload's model {model!r}: set model: in the workload file, or give "
            f"{server.flag} a server of {model!r}"
        )
    if server.flag != "--target":
        return
    ready = _get(http, server, "/readyz")
    if ready.status_code == 503:
        up = _json(ready).get("engines_up")
        raise Unreachable(
            f"the proxy at {server.url} has no engine ready (GET /readyz: 503, engines "
            f"up: {up if up is not None else 'none said'}): start its engines, or wait "
            "until they have loaded (its log says when)"
        )


def _get(http: httpx.Client, server: Server, path: str) -> httpx.Response:
    try:
        return http.get(server.url + path)
    except httpx.TimeoutException:
        why = f"no answer within {TIMEOUT.connect:g} s"
    except httpx.TransportError as exc:
        why = str(exc) or type(exc).__name__
    raise Unreachable(f"nothing answers at {server.url} ({server.flag}: {why}): {server.remedy}")


def _json(response: httpx.Response) -> dict[str, Any]:
    try:
        body = response.json()
    except ValueError:
        return {}
    return body if isinstance(body, dict) else {}


def _model_ids(response: httpx.Response) -> list[str]:
    if response.status_code != 200:
        return []  # 401 or 403: a proxy with keys does not list them to a stranger
    data = _json(response).get("data")
    if not isinstance(data, list):
        return []
    return [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]


def _excerpt(response: httpx.Response) -> str:
    return " ".join(response.text.split())[:120]


def unanswered(records: Sequence[Record], label: str) -> None:
    """Raise :class:`Unreachable` if none of a run's ``records`` got an answer (an HTTP
    status) and some failed without one: the run's servers went away. A request the
    client closed while it still waited (a proxy may hold a batch request for a whole
    run) failed nothing. ``label`` names the run in the message."""
    if any(r.status is not None for r in records):
        return
    failed = [r for r in records if r.error is not None]
    if failed:
        raise Unreachable(
            f"no request of {label} got an answer ({len(failed)} failed; the first, to "
            f"{failed[0].url}: {failed[0].error}): is the server still running? its log "
            "says why it stopped"
        )


_ENGINE_INFO = re.compile(r"^whoseturn_engine_info\{([^}]*)\}", re.M)


def engine_names(proxy: str, client: httpx.Client | None = None) -> dict[str, str]:
    """The proxy's name for each engine it serves, by base URL (its
    ``whoseturn_engine_info{engine,url}``), so the harness names an engine as the
    proxy's ``/turn``, ``/status`` and the timeline plot do; empty when the proxy does
    not say (no answer, not a whoseturn proxy)."""
    try:
        with client or httpx.Client(timeout=TIMEOUT) as http:
            text = http.get(f"{proxy}/metrics").text
    except httpx.HTTPError:
        return {}
    names = {}
    for match in _ENGINE_INFO.finditer(text):
        labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group(1)))
        if labels.get("engine") and labels.get("url"):
            names[labels["url"].rstrip("/")] = labels["engine"]
    return names


def failure_line(exc: BaseException) -> str:
    """The line that ends a run on ``exc`` (:class:`Unreachable`, a server that never
    became ready, a connection lost): what failed and where, no traceback."""
    if isinstance(exc, httpx.TransportError):
        try:
            where = f" to {exc.request.url}"
        except RuntimeError:  # an error raised before its request was made
            where = ""
        why = str(exc) or type(exc).__name__
        return f"lost the connection{where} ({why}): is the server still running?"
    return str(exc)
