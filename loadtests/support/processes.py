"""Servers as child processes on loopback ports, for the bench's launchers and the tests.

- :func:`free_port`: a loopback TCP port that nothing listens on at the moment;
- :func:`whoseturn_command`: the argument list that runs ``whoseturn ARGS`` with this
  interpreter (warnings only in its log); :func:`serve_command` writes a proxy
  configuration file and gives the command that serves it;
- :func:`running`: a child process for the length of a ``with`` body, stopped on exit
  (a signal, then ``SIGKILL`` after a grace period);
- :func:`wait_until_ok`: poll a URL until it answers 200, failing early
  (:class:`NotReady`) if the child that should serve it has exited;
- :func:`serving`: a server's command on a free port, run as a :class:`Server` that
  can be waited for (:meth:`Server.wait_ready`).

The harness cannot import ``tests/``; ``tests/support`` re-uses these.
"""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

import httpx
import yaml

LOOPBACK = "127.0.0.1"


def free_port() -> int:
    """A loopback port that is free now (another process may take it later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def loopback_url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}"


def whoseturn_command(*args: str) -> list[str]:
    """``python -m proxy --log-level warning ARGS`` with this interpreter."""
    return [sys.executable, "-m", "proxy", "--log-level", "warning", *args]


def serve_command(
    config_path: Path, *, port: int, engines: Sequence[dict[str, Any]], **settings: Any
) -> list[str]:
    """Write a proxy configuration (``port``, top-level ``settings``, ``engines``) to
    ``config_path`` as YAML; the command that serves it: ``whoseturn serve --config``."""
    config = {"port": port, **settings, "engines": list(engines)}
    config_path.write_text(yaml.safe_dump(config))
    return whoseturn_command("serve", "--config", str(config_path))


@contextmanager
def running(
    command: Sequence[str],
    *,
    output: IO[bytes] | int = subprocess.DEVNULL,
    cwd: Path | None = None,
    stop_signal: signal.Signals = signal.SIGINT,
    grace_s: float = 10.0,
) -> Iterator[subprocess.Popen[bytes]]:
    """Run ``command`` (stdout and stderr to ``output``) until the ``with`` body ends,
    then :func:`stop` it."""
    process = subprocess.Popen(list(command), stdout=output, stderr=subprocess.STDOUT, cwd=cwd)
    try:
        yield process
    finally:
        stop(process, stop_signal, grace_s)


def stop(
    process: subprocess.Popen[bytes],
    stop_signal: signal.Signals = signal.SIGINT,
    grace_s: float = 10.0,
) -> None:
    """Send ``stop_signal`` to a running process; ``SIGKILL`` it if it is still there
    after ``grace_s`` seconds."""
    if process.poll() is not None:
        return
    process.send_signal(stop_signal)
    try:
        process.wait(grace_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


class NotReady(RuntimeError):
    """A server did not answer 200 in time, or its process exited first; the message
    names it (and its log, when the caller gave one in ``what``)."""


def wait_until_ok(
    url: str,
    *,
    process: subprocess.Popen[bytes] | None = None,
    what: str = "the server",
    timeout_s: float = 30.0,
    interval_s: float = 0.05,
) -> None:
    """Poll ``GET url`` until it answers 200. Raises :class:`NotReady` once
    ``process`` (the server's, if given) has exited or after ``timeout_s``; ``what``
    names the server in the message."""
    deadline = time.monotonic() + timeout_s
    while True:
        if process is not None and process.poll() is not None:
            raise NotReady(f"{what} exited early ({process.returncode})")
        try:
            if httpx.get(url, timeout=1).status_code == 200:
                return
        except httpx.TransportError:
            pass
        if time.monotonic() > deadline:
            raise NotReady(f"{what} not ready at {url} within {timeout_s:.0f} s")
        time.sleep(interval_s)


class ServeCommand(Protocol):
    """A server's command line, given the port it is to listen on."""

    def __call__(self, *, port: int) -> list[str]: ...


@dataclass(frozen=True)
class Server:
    """A child process serving HTTP at ``url``, and the command that started it."""

    url: str
    process: subprocess.Popen[bytes]
    command: list[str]

    def wait_ready(self, path: str, *, what: str, timeout_s: float = 30.0) -> None:
        """:func:`wait_until_ok` on ``url + path``; ``what`` names the server."""
        wait_until_ok(self.url + path, process=self.process, what=what, timeout_s=timeout_s)


@contextmanager
def serving(
    command: ServeCommand,
    *,
    output: IO[bytes] | int = subprocess.DEVNULL,
    stop_signal: signal.Signals = signal.SIGINT,
) -> Iterator[Server]:
    """``command`` on a free loopback port until the ``with`` body ends
    (:func:`running`). Not waited for: servers started one after the other load side
    by side, then each is waited for (:meth:`Server.wait_ready`)."""
    port = free_port()
    argv = command(port=port)
    with running(argv, output=output, stop_signal=stop_signal) as process:
        yield Server(loopback_url(port), process, argv)
