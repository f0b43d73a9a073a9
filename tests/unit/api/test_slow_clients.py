"""Slow clients and large bodies at the proxy's edge.

- The header read timeout and the cap on incomplete connections, on a real uvicorn
  server configured as ``whoseturn serve`` configures it
  (:func:`proxy.process.uvicorn_server.uvicorn_config`) around a small echo app, over
  bare sockets.
- The body read timeout and the budget of bodies in flight
  (:mod:`~proxy.api.body_limits`, in :class:`~proxy.api.intake.Intake`), on the
  socket and through ``httpx.ASGITransport``.
- :class:`~proxy.api.inflight.MemoryReturn`: the garbage of a large body is collected
  once such bodies stop ending.
- The settings: defaults, environment, validation.
"""

from __future__ import annotations

import asyncio
import gc
import os
import select
import socket
import threading
import time
import weakref
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from proxy.api.body_limits import BodyLimits
from proxy.api.inflight import (
    LARGE_BODY_BYTES,
    SMALL_BODY_BYTES,
    BodyBudget,
    MemoryReturn,
    glibc_malloc_trim,
)
from proxy.api.intake import Intake
from proxy.config import ConfigError, Settings, load_settings, settings_from_dict
from proxy.process.slow_clients import IncompleteConnections
from proxy.process.uvicorn_server import uvicorn_config

pytestmark = pytest.mark.timeout(30)

LOOPBACK = "127.0.0.1"
ENGINE = "http://127.0.0.1:1"
HEADER_S = 0.3
BODY_S = 0.3
SLACK_S = 1.5  # how late a close may come on a busy 2-core machine
HEAD = b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"


async def echo(scope: Scope, receive: Receive, send: Send) -> None:
    """Answers 200 with the request's body once it has all of it; ``/slow`` first
    waits 1 s (a request being served, complete)."""
    if scope["type"] != "http":
        return
    body = await Request(scope, receive).body()
    if scope["path"] == "/slow":
        await asyncio.sleep(1.0)
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def guarded(app: ASGIApp = echo, **options: Any) -> Intake:
    return Intake(app, BodyLimits(max_body_bytes=1 << 20, **options))


@contextmanager
def serving(app: ASGIApp, **settings: Any) -> Iterator[int]:
    """Serve ``app`` as ``whoseturn serve`` would under ``settings``; yields the port."""
    config = uvicorn_config(app, settings_from_dict({"engines": [ENGINE], **settings}), "warning")
    config.lifespan = "off"
    server = uvicorn.Server(config)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind((LOOPBACK, 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 10
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
            time.sleep(0.01)
        yield sock.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)
        sock.close()


@contextmanager
def connected(port: int) -> Iterator[socket.socket]:
    with socket.create_connection((LOOPBACK, port), timeout=10) as sock:
        yield sock


def closed_within(sock: socket.socket, seconds: float) -> bytes | None:
    """Everything the server sends until it closes ``sock``; None if still open after
    ``seconds``."""
    data = b""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if not select.select([sock], [], [], left)[0]:
            return None
        try:
            piece = sock.recv(65536)
        except ConnectionResetError:
            return data
        if not piece:
            return data
        data += piece
    return None


def still_open(*socks: socket.socket, seconds: float = 0.2) -> bool:
    """Whether the server leaves every one of ``socks`` alone for ``seconds``."""
    return not select.select(list(socks), [], [], seconds)[0]


def responses(sock: socket.socket, count: int = 1) -> list[tuple[int, bytes]]:
    """``count`` whole responses (Content-Length framed) read from ``sock``: status,
    body each."""
    data, out = b"", list[tuple[int, bytes]]()
    while len(out) < count:
        while b"\r\n\r\n" not in data:
            data += sock.recv(65536)
        head, _, data = data.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        length = next(
            int(h.split(b":")[1]) for h in lines if h.lower().startswith(b"content-length")
        )
        while len(data) < length:
            data += sock.recv(65536)
        out.append((int(lines[0].split(b" ")[1]), data[:length]))
        data = data[length:]
    assert data == b"", "more than the responses expected"
    return out


def response(sock: socket.socket) -> tuple[int, bytes]:
    return responses(sock)[0]


def request(body: bytes = b"{}") -> bytes:
    return HEAD + b"Content-Length: %d\r\n\r\n" % len(body) + body


# -- the header read timeout -------------------------------------------------------------


def test_a_connection_that_sends_nothing_is_closed_after_the_header_timeout() -> None:
    with serving(echo, header_timeout_s=HEADER_S) as port, connected(port) as sock:
        opened = time.monotonic()
        assert closed_within(sock, HEADER_S + SLACK_S) == b""
        assert time.monotonic() - opened >= HEADER_S * 0.9


def test_headers_trickled_byte_by_byte_are_cut_off_at_the_header_timeout() -> None:
    """The timeout counts from the connection's opening, not from the last byte."""
    with serving(echo, header_timeout_s=HEADER_S) as port, connected(port) as sock:
        opened = time.monotonic()
        sent = 0
        for byte in HEAD + b"X-Pad: " + b"a" * 1000:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += 1
            if select.select([sock], [], [], 0.02)[0]:
                break  # the server closed it (or answered)
        lived = time.monotonic() - opened
        assert closed_within(sock, SLACK_S) is not None
        assert HEADER_S * 0.9 <= lived < HEADER_S + SLACK_S
        assert sent > 5  # it was still sending


def test_a_body_that_arrives_slowly_but_steadily_is_served() -> None:
    """The header timeout stops at the end of the headers; the body timeout is per gap."""
    app = guarded(body_timeout_s=BODY_S)
    with serving(app, header_timeout_s=HEADER_S) as port, connected(port) as sock:
        body = b'{"a": "0123456789"}'
        sock.sendall(HEAD + b"Content-Length: %d\r\n\r\n" % len(body))
        for i in range(len(body)):  # ~1 s in all, > both timeouts
            time.sleep(0.05)
            sock.sendall(body[i : i + 1])
        assert response(sock) == (200, body)


def test_after_a_response_the_next_request_has_the_header_timeout_to_arrive() -> None:
    with serving(echo, header_timeout_s=HEADER_S) as port, connected(port) as sock:
        sock.sendall(request())
        assert response(sock) == (200, b"{}")
        answered = time.monotonic()
        sock.sendall(HEAD)  # half of the next request, then nothing
        assert closed_within(sock, HEADER_S + SLACK_S) == b""
        assert time.monotonic() - answered >= HEADER_S * 0.9


def test_kept_alive_and_pipelined_requests_are_served() -> None:
    with serving(echo, header_timeout_s=HEADER_S) as port, connected(port) as sock:
        sock.sendall(request(b"[1]"))
        assert response(sock) == (200, b"[1]")
        time.sleep(HEADER_S / 2)
        sock.sendall(request(b"[2]") + request(b"[3]"))
        assert responses(sock, 2) == [(200, b"[2]"), (200, b"[3]")]


# -- the cap on incomplete connections ---------------------------------------------------


def test_beyond_the_cap_the_oldest_incomplete_connection_is_closed() -> None:
    settings = {"header_timeout_s": 10.0, "max_incomplete_connections": 3}
    with (
        serving(echo, **settings) as port,
        connected(port) as a,
        connected(port) as b,
        connected(port) as c,
    ):
        b.sendall(HEAD)  # part of a request: incomplete too
        time.sleep(0.1)
        with connected(port) as d:
            assert closed_within(a, SLACK_S) == b""
            assert still_open(b, c, d)
            d.sendall(request())
            assert response(d) == (200, b"{}")


def test_a_request_received_in_full_is_not_counted_while_it_is_served() -> None:
    settings = {"header_timeout_s": 10.0, "max_incomplete_connections": 2}
    with serving(echo, **settings) as port, connected(port) as served:
        served.sendall(request().replace(b"/echo", b"/slow"))
        time.sleep(0.1)
        with connected(port) as a, connected(port) as b:
            assert still_open(a, b, served)  # 2 incomplete: the served one is not counted
            assert response(served) == (200, b"{}")


class Conn:
    def __init__(self, name: str, closed: list[str]) -> None:
        self.name = name
        self.closed = closed

    def close_incomplete(self, why: str) -> None:
        self.closed.append(self.name)


def test_the_oldest_incomplete_connection_goes_first_and_a_kept_alive_one_is_new_again() -> None:
    closed: list[str] = []
    a, b, c, d = (Conn(name, closed) for name in "abcd")
    held = IncompleteConnections(cap=2)
    held.hold(a, 0.0)
    held.hold(b, 0.0)
    held.release(a)  # its request arrived in full
    held.hold(c, 0.0)
    assert closed == []
    held.hold(b, 1.0)  # b again (its next request): now the newest
    held.hold(d, 1.0)
    assert closed == ["c"] and held.evicted == 1


# -- the body read timeout ---------------------------------------------------------------


def test_a_body_that_stops_arriving_is_answered_408_and_the_connection_closed() -> None:
    app = guarded(body_timeout_s=BODY_S)
    with serving(app, header_timeout_s=HEADER_S) as port, connected(port) as sock:
        sock.sendall(HEAD + b'Content-Length: 100\r\n\r\n{"model": "')
        sent = time.monotonic()
        answer = closed_within(sock, BODY_S + SLACK_S)
        waited = time.monotonic() - sent
    assert answer is not None and answer.startswith(b"HTTP/1.1 408 ")
    assert b"connection: close" in answer.lower()
    assert b'"code":"request_timeout"' in answer
    assert BODY_S * 0.9 <= waited < BODY_S + SLACK_S


# -- the budget of bodies in flight ------------------------------------------------------


class Gate:
    """An app that reads the body, then waits at the gate before answering 200."""

    def __init__(self) -> None:
        self.inside = asyncio.Event()
        self.open = asyncio.Event()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await Request(scope, receive).body()
        self.inside.set()
        await self.open.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})


LIMIT = 4 * SMALL_BODY_BYTES
LARGE = b"x" * (LIMIT * 3 // 4)


@pytest.mark.anyio
async def test_a_body_the_budget_cannot_take_is_503_with_retry_after() -> None:
    gate = Gate()
    guard = guarded(gate, max_body_bytes_in_flight=LIMIT)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=guard), base_url="http://proxy"
    ) as client:
        first = asyncio.create_task(client.post("/v1/chat/completions", content=LARGE))
        await gate.inside.wait()
        assert guard.limits.bodies is not None and guard.limits.bodies.held == len(LARGE)
        refused = await client.post("/v1/chat/completions", content=LARGE)
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1"
        assert "max_body_bytes_in_flight" in refused.json()["error"]["message"]
        gate.open.set()
        assert (await first).status_code == 200
        assert (await client.post("/v1/chat/completions", content=LARGE)).status_code == 200
    assert guard.limits.bodies.held == 0


@pytest.mark.anyio
async def test_a_small_body_is_never_refused_by_the_budget() -> None:
    gate = Gate()
    guard = guarded(gate, max_body_bytes_in_flight=LIMIT)
    small = b"s" * SMALL_BODY_BYTES
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=guard), base_url="http://proxy"
    ) as client:
        first = asyncio.create_task(client.post("/v1/chat/completions", content=LARGE))
        await gate.inside.wait()
        second = asyncio.create_task(client.post("/v1/chat/completions", content=small))
        bodies = guard.limits.bodies
        for _ in range(100):
            if bodies is not None and bodies.held == len(LARGE) + len(small):
                break  # counted, beyond the limit
            await asyncio.sleep(0.01)
        gate.open.set()
        assert [(await r).status_code for r in (first, second)] == [200, 200]


@pytest.mark.anyio
async def test_a_chunked_body_is_counted_as_it_arrives_and_refused_past_the_budget() -> None:
    gate = Gate()
    guard = guarded(gate, max_body_bytes_in_flight=LIMIT)

    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(8):
            yield b"c" * (LIMIT // 8)

    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=guard), base_url="http://proxy"
    ) as client:
        first = asyncio.create_task(client.post("/v1/chat/completions", content=LARGE))
        await gate.inside.wait()
        refused = await client.post("/v1/chat/completions", content=chunks())
        assert refused.status_code == 503 and "retry-after" in refused.headers
        gate.open.set()
        await first
    assert guard.limits.bodies is not None and guard.limits.bodies.held == 0


@pytest.mark.anyio
async def test_uploads_under_their_own_limit_are_not_counted() -> None:
    gate = Gate()
    guard = Intake(
        gate,
        BodyLimits(
            max_body_bytes=LIMIT,
            path_limits={"/v1/files": 4 * LIMIT},
            max_body_bytes_in_flight=LIMIT,
        ),
    )
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=guard), base_url="http://proxy"
    ) as client:
        upload = asyncio.create_task(client.post("/v1/files", content=b"u" * (2 * LIMIT)))
        await gate.inside.wait()
        assert guard.limits.bodies is not None and guard.limits.bodies.held == 0
        gate.open.set()
        assert (await upload).status_code == 200


def test_the_budget_refuses_only_large_bodies_past_its_limit() -> None:
    budget = BodyBudget(100, small=10)
    assert budget.take(60, 60) and budget.held == 60
    assert not budget.take(50, 50) and budget.held == 60 and budget.refused == 1
    assert budget.take(10, 10) and budget.held == 70  # small: taken past the limit too
    assert budget.take(30, 30) and budget.held == 100
    budget.give(100)
    assert budget.held == 0


# -- memory given back -------------------------------------------------------------------


class Cycle:
    """A reference cycle holding a large buffer, as an upstream response holds its body."""

    def __init__(self) -> None:
        self.me = self
        self.body = bytearray(LARGE_BODY_BYTES)


@pytest.fixture
def no_automatic_gc() -> Iterator[None]:
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


@pytest.mark.anyio
@pytest.mark.usefixtures("no_automatic_gc")
async def test_the_garbage_of_large_bodies_is_collected_once_they_stop_ending() -> None:
    trims: list[float] = []
    memory = MemoryReturn(
        collect_after_bytes=100 * LARGE_BODY_BYTES, settle_s=0.2, trim=lambda: trims.append(1)
    )
    dead = Cycle()
    alive = weakref.ref(dead)
    del dead
    memory.body_freed(LARGE_BODY_BYTES - 1)  # not large: nothing happens
    await asyncio.sleep(0.3)
    assert alive() is not None and memory.runs == 0
    memory.body_freed(LARGE_BODY_BYTES)
    await asyncio.sleep(0.1)
    memory.body_freed(LARGE_BODY_BYTES)  # pushes the collection back: bodies still ending
    await asyncio.sleep(0.15)
    assert alive() is not None
    await asyncio.sleep(0.2)
    assert alive() is None
    assert memory.runs == 1 and trims == [1]


@pytest.mark.anyio
@pytest.mark.usefixtures("no_automatic_gc")
async def test_a_flow_of_large_bodies_is_collected_every_collect_after_bytes() -> None:
    memory = MemoryReturn(collect_after_bytes=3 * LARGE_BODY_BYTES, settle_s=60)
    for _ in range(3):
        memory.body_freed(LARGE_BODY_BYTES)
    await asyncio.sleep(0.2)
    assert memory.runs == 1 and memory.freed == 0


def test_malloc_trim_is_found_on_glibc() -> None:
    trim = glibc_malloc_trim()
    assert (trim is not None) == bool(os.confstr("CS_GNU_LIBC_VERSION"))
    if trim is not None:
        assert trim() in (0, 1)


# -- settings ----------------------------------------------------------------------------


def test_the_edge_settings_default_to_a_reverse_proxys_values() -> None:
    settings = settings_from_dict({"engines": [ENGINE]})
    assert settings.edge.header_timeout_s == 10.0
    assert settings.edge.body_timeout_s == 30.0
    assert settings.edge.max_incomplete_connections == 1024
    assert (
        settings.edge.max_body_bytes_in_flight
        == 8 * settings.edge.max_body_bytes
        == 64 * 1024 * 1024
    )


def test_the_edge_settings_read_the_environment(tmp_path: Path) -> None:
    env = {
        "WHOSETURN_ENGINES": ENGINE,
        "WHOSETURN_HEADER_TIMEOUT_S": "2.5",
        "WHOSETURN_BODY_TIMEOUT_S": "4",
        "WHOSETURN_MAX_INCOMPLETE_CONNECTIONS": "100",
        "WHOSETURN_MAX_BODY_BYTES_IN_FLIGHT": "16777216",
    }
    settings: Settings = load_settings(None, env=env, cwd=tmp_path)
    assert (settings.edge.header_timeout_s, settings.edge.body_timeout_s) == (2.5, 4.0)
    assert settings.edge.max_incomplete_connections == 100
    assert settings.edge.max_body_bytes_in_flight == 16777216


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("header_timeout_s", 0),
        ("body_timeout_s", -1),
        ("max_incomplete_connections", 0),
        ("max_body_bytes_in_flight", 1024),  # below max_body_bytes
        ("header_timeout_s", "soon"),
    ],
)
def test_the_edge_settings_refuse_nonsense(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=rf"^{key}:"):
        settings_from_dict({"engines": [ENGINE], key: value})
