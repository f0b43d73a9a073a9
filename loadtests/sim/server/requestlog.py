"""The simulated engine's request log (``--request-log PATH``): what reached the engine.

Tests read it to count, at the engine, the requests a proxy sent: a JSON line when a
generation request's body has arrived and one when its answer ends, paired by
``seq`` (a number counting from 1 in this log)::

    {"event": "start", "seq": 7, "time": 1760000000.12, "path": "/v1/chat/completions",
     "request_id": null, "user": "line-3", "model": "tiny"}
    {"event": "end", "seq": 7, "time": 1760000000.15, "status": 200, "outcome": "finished"}

``time`` is epoch seconds (``time.time()``), so it can be compared with another
process's clock on the same machine. ``request_id`` is the ``X-Request-Id`` header,
else the body's ``request_id`` (vLLM's extra field); ``user`` is the body's
``user`` (OpenAI's end-user field: a client can put its own id for each request
there); each is null where not given, and ``user`` and ``model`` are null in a
body that is not a JSON object. ``outcome`` is ``finished`` (the whole answer was
sent), ``aborted`` (the client hung up first) or ``error`` (the server failed).
Only the two generation routes are logged; a request refused as invalid is logged
too (its ``status`` says so), one whose body never arrived is not.

The log is appended to, a line at a time, and flushed after each line;
:class:`RequestLogReader` follows it as it grows. An engine started again on the
same file counts ``seq`` from 1 again after the lines of the one before (whose
requests still open when it was killed never end in the log).
"""

from __future__ import annotations

import itertools
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

LOGGED_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
REQUEST_ID_HEADER = b"x-request-id"


class RequestLog:
    """An open request log file; :meth:`close` it when the server stops."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file: IO[str] | None = path.open("a", encoding="utf-8", buffering=1)
        self._seq = itertools.count(1)

    def next_seq(self) -> int:
        return next(self._seq)

    def write(self, event: str, seq: int, **fields: Any) -> None:
        """One line (dropped once the log is closed: a request ending after shutdown)."""
        if self._file is None:
            return
        line = {"event": event, "seq": seq, "time": time.time(), **fields}
        self._file.write(json.dumps(line) + "\n")

    def close(self) -> None:
        if self._file is not None:
            file, self._file = self._file, None
            file.close()


def _body_fields(body: bytes) -> tuple[str | None, str | None, str | None]:
    """``user``, ``model`` and ``request_id`` of a JSON body (None where missing)."""
    try:
        data = json.loads(body)
    except ValueError:
        return None, None, None
    if not isinstance(data, dict):
        return None, None, None

    def text(key: str) -> str | None:
        value = data.get(key)
        return value if isinstance(value, str) else None

    return text("user"), text("model"), text("request_id")


class RequestLogMiddleware:
    """ASGI middleware writing the generation requests to the server's
    :class:`RequestLog` (``app.state.sim.request_log``; nothing if it has none)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        log = _log_of(scope)
        if log is None or scope["type"] != "http" or scope["path"] not in LOGGED_PATHS:
            await self.app(scope, receive, send)
            return
        await _Logged(log, scope).run(self.app, receive, send)


def _log_of(scope: Scope) -> RequestLog | None:
    state = getattr(getattr(scope.get("app"), "state", None), "sim", None)
    log = getattr(state, "request_log", None)
    return log if isinstance(log, RequestLog) else None


class _Logged:
    """One logged request: its body, as it arrives, and how its answer went."""

    def __init__(self, log: RequestLog, scope: Scope) -> None:
        self.log = log
        self.scope = scope
        self.seq = 0  # 0 until the body has arrived and the start was logged
        self.chunks: list[bytes] = []
        self.status: int | None = None
        self.sent = False  # the last part of the answer went out
        self.hung_up = False  # the client left before that

    async def run(self, app: ASGIApp, receive: Receive, send: Send) -> None:
        async def logged_receive() -> Message:
            message = await receive()
            self._received(message)
            return message

        async def logged_send(message: Message) -> None:
            if message["type"] == "http.response.start":
                self.status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body"):
                self.sent = True
            await send(message)

        outcome = "error"
        try:
            await app(self.scope, logged_receive, logged_send)
            outcome = "aborted" if self.hung_up or not self.sent else "finished"
        except BaseException:
            if self.hung_up:
                outcome = "aborted"
            raise
        finally:
            if self.seq:
                self.log.write("end", self.seq, status=self.status, outcome=outcome)

    def _received(self, message: Message) -> None:
        if message["type"] == "http.disconnect":
            self.hung_up = self.hung_up or not self.sent
            return
        if message["type"] != "http.request" or self.seq:
            return
        self.chunks.append(message.get("body", b""))
        if message.get("more_body"):
            return
        body, self.chunks = b"".join(self.chunks), []
        user, model, body_id = _body_fields(body)
        header_id = next(
            (v.decode("latin-1") for k, v in self.scope["headers"] if k == REQUEST_ID_HEADER),
            None,
        )
        self.seq = self.log.next_seq()
        self.log.write(
            "start",
            self.seq,
            path=self.scope["path"],
            request_id=header_id or body_id,
            user=user,
            model=model,
        )


@dataclass
class LoggedRequest:
    """A request as the log tells it; ``ended`` (and ``status``, ``outcome``) None
    while it runs."""

    seq: int
    started: float
    path: str
    request_id: str | None
    user: str | None
    model: str | None
    ended: float | None = None
    status: int | None = None
    outcome: str | None = None


class RequestLogReader:
    """Follows a request log as it grows (only whole lines are read)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.requests: list[LoggedRequest] = []  # in the order they started
        self._by_seq: dict[int, LoggedRequest] = {}  # the latest start of each seq
        self._offset = 0

    def read(self) -> list[LoggedRequest]:
        """Read what was added since the last call; the requests that started in it."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        whole = data[: data.rfind(b"\n") + 1]
        self._offset += len(whole)
        started: list[LoggedRequest] = []
        for line in whole.splitlines():
            event = json.loads(line)
            if event["event"] == "start":
                request = LoggedRequest(
                    event["seq"], event["time"], event["path"], event["request_id"],
                    event["user"], event["model"],
                )  # fmt: skip
                self.requests.append(request)
                self._by_seq[request.seq] = request
                started.append(request)
            else:
                request = self._by_seq[event["seq"]]
                request.ended, request.status = event["time"], event["status"]
                request.outcome = event["outcome"]
        return started

    def running(self) -> list[LoggedRequest]:
        """The requests read as started and not (yet) as ended."""
        return [r for r in self.requests if r.ended is None]
