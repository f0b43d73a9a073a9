"""Child processes on loopback ports: ``whoseturn`` servers, Prometheus, with logs.

The port and process helpers are :mod:`loadtests.support.processes`' (re-exported here);
this adds what only the tests need: a closed port, the simulated engine's command
line, and a child whose output is kept in a log file that a failure can quote.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from subprocess import Popen

from loadtests.support.processes import (
    LOOPBACK,
    free_port,
    loopback_url,
    running,
    serve_command,
    wait_until_ok,
    whoseturn_command,
)
from tests.support import MODEL

__all__ = [
    "LOOPBACK",
    "Child",
    "closed_port_url",
    "free_port",
    "logged_child",
    "loopback_url",
    "running",
    "serve_command",
    "sim_command",
    "wait_until_ok",
    "whoseturn_command",
]


def closed_port_url() -> str:
    """A loopback URL where nothing listens (connections are refused)."""
    return loopback_url(free_port())


def sim_command(*flags: str) -> list[str]:
    """``whoseturn sim --profile cpu-tiny --served-model-name tiny FLAGS``."""
    return whoseturn_command("sim", "--profile", "cpu-tiny", "--served-model-name", MODEL, *flags)


@dataclass
class Child:
    """A child process whose output goes to a log file."""

    name: str
    process: Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        text = self.log.read_text(errors="replace").splitlines()
        return f"--- {self.name} log ({self.log}) ---\n" + "\n".join(text[-lines:])

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name} exited ({self.process.returncode})\n{self.tail()}")


@contextmanager
def logged_child(
    name: str,
    command: Sequence[str],
    logs: Path,
    *,
    cwd: Path | None = None,
    grace_s: float = 10.0,
) -> Iterator[Child]:
    """Run ``command`` with its output in ``logs/NAME.log`` until the ``with`` body
    ends: ``SIGINT``, then ``SIGKILL`` after ``grace_s``."""
    logs.mkdir(parents=True, exist_ok=True)
    log = logs / f"{name}.log"
    with log.open("wb") as out, running(command, output=out, cwd=cwd, grace_s=grace_s) as process:
        yield Child(name, process, log)
