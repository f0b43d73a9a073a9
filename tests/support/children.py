"""``whoseturn sim`` and ``whoseturn serve`` as child processes on free loopback ports,
each with its output in a log file a failure can quote (:func:`.processes.logged_child`),
yielded with its URL once it answers."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from loadtests.support.processes import free_port, loopback_url, serve_command, wait_until_ok
from tests.support.processes import Child, logged_child, sim_command


@contextmanager
def logged_sim(logs: Path, *flags: str, grace_s: float = 10.0) -> Iterator[tuple[Child, str]]:
    """``whoseturn sim --profile cpu-tiny FLAGS`` (:func:`.processes.sim_command`), its
    output in ``logs/sim.log``, until the ``with`` body ends; yields the child and its
    URL once ``/health`` answers 200."""
    port = free_port()
    command = sim_command("--port", str(port), *flags)
    with logged_child("sim", command, logs, grace_s=grace_s) as child:
        url = loopback_url(port)
        wait_until_ok(f"{url}/health", process=child.process, what=f"whoseturn sim ({child.log})")
        yield child, url


@contextmanager
def logged_proxy(
    tmp: Path,
    engines: Sequence[dict[str, Any]],
    *,
    logs: Path | None = None,
    name: str = "proxy",
    flags: Sequence[str] = (),
    timeout_s: float = 30.0,
    grace_s: float = 10.0,
    **settings: Any,
) -> Iterator[tuple[Child, str]]:
    """``whoseturn serve --config TMP/whoseturn.yaml FLAGS``, the file written with
    ``engines`` and the top-level ``settings`` (:func:`.processes.serve_command`), its
    output in ``NAME.log`` in ``logs`` (default ``TMP/logs``), until the ``with`` body
    ends; yields the child and its URL once ``/readyz`` answers 200 (within
    ``timeout_s``)."""
    port = free_port()
    config = tmp / "whoseturn.yaml"
    command = [*serve_command(config, port=port, engines=engines, **settings), *flags]
    with logged_child(name, command, logs or tmp / "logs", grace_s=grace_s) as child:
        url = loopback_url(port)
        what = f"whoseturn serve ({child.log})"
        wait_until_ok(f"{url}/readyz", process=child.process, what=what, timeout_s=timeout_s)
        yield child, url
