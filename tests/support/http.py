"""Reading SSE responses line by line, and requests sent on a bare socket."""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import httpx

from loadtests.support.processes import LOOPBACK


def data_lines(response: httpx.Response) -> Iterator[str]:
    """The ``data:`` payloads of an SSE response, as they arrive.

    Keep the iterator while the stream should stay open: one dropped half-read
    is closed by the garbage collector, and with it the response.
    """
    for line in response.iter_lines():
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def post_raw(port: int, path: str, body: dict[str, Any]) -> socket.socket:
    """Send a JSON ``POST`` on a bare loopback socket and return the socket, unread
    (close it to hang up)."""
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(data)}\r\n\r\n"
    ).encode()
    sock = socket.create_connection((LOOPBACK, port))
    sock.sendall(head + data)
    return sock
