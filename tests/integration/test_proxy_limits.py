"""Body size limits on a real ``whoseturn serve`` process: an oversized body is
refused with 413 before it is read in full, and costs the proxy's memory less
than twice the limit."""

from __future__ import annotations

import select
import socket
from pathlib import Path

import pytest

from .proxyserver import Process, spawn_proxy
from .simserver import SimServer

LIMIT = 8 * 1024 * 1024
CHUNK = 1024 * 1024
HEAD = (
    "POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    "Content-Type: application/json\r\n{length}\r\n"
)


def memory_kib(process: Process, field: str) -> int:
    """``VmRSS`` (resident now) or ``VmHWM`` (its peak) of the proxy, in KiB."""
    for line in Path(f"/proc/{process.process.pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc status")


def answered(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def read_status(sock: socket.socket) -> int:
    """The status code of the response on ``sock``."""
    data = b""
    while b"\r\n" not in data:
        piece = sock.recv(4096)
        if not piece:
            break
        data += piece
    return int(data.split(b" ", 2)[1])


def send_chunked(port: int, total: int) -> tuple[int, int]:
    """POST ``total`` bytes chunked (no Content-Length), stopping as soon as the
    proxy answers; returns the status and the bytes sent."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=20)
    sent = 0
    with sock:
        sock.sendall(HEAD.format(length="Transfer-Encoding: chunked\r\n").encode())
        piece = f"{CHUNK:x}\r\n".encode() + b" " * CHUNK + b"\r\n"
        while sent < total and not answered(sock):
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                break
            sent += CHUNK
        return read_status(sock), sent


def send_declared(port: int, length: int) -> int:
    """Only the head of a request that declares ``length`` bytes; the status."""
    with socket.create_connection(("127.0.0.1", port), timeout=20) as sock:
        sock.sendall(HEAD.format(length=f"Content-Length: {length}\r\n").encode())
        return read_status(sock)


@pytest.mark.timeout(60)
def test_an_oversized_body_is_413_and_costs_less_than_twice_the_limit(
    sim: SimServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WHOSETURN_MAX_BODY_BYTES", str(LIMIT))
    with spawn_proxy(sim.base_url) as proxy:
        assert proxy.http.get("/v1/models").status_code == 200
        rss, peak = memory_kib(proxy, "VmRSS"), memory_kib(proxy, "VmHWM")
        assert send_declared(proxy.port, 64 * LIMIT) == 413
        status, sent = send_chunked(proxy.port, 4 * LIMIT)
        assert status == 413
        assert sent < 4 * LIMIT  # refused before the client had sent it all
        grown_kib = max(memory_kib(proxy, "VmHWM") - peak, memory_kib(proxy, "VmRSS") - rss)
        print(f"RSS growth for a {4 * LIMIT} B body: {grown_kib} KiB (limit {LIMIT // 1024} KiB)")
        assert grown_kib * 1024 < 2 * LIMIT
        assert proxy.http.get("/healthz").status_code == 200
