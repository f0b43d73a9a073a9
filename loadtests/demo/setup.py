"""The demo's processes: simulated engines and the proxy, real processes on loopback.

Each arm gets fresh engines, so no arm inherits another's prefix cache. The commands
are kept: they go into ``result.json`` as the pinned setup.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

from loadtests.support.processes import (
    free_port,
    loopback_url,
    running,
    serve_command,
    wait_until_ok,
    whoseturn_command,
)

PROFILE = "cpu-tiny"
ENGINE_FLAGS = ("--profile", PROFILE, "--long-prefill-token-threshold", "256")
READY_S = 90.0
"""How long a server may take to answer: long, as a loaded machine's imports are slow."""
PROXY_SETTINGS = {"scrape_interval_s": 0.5, "health_interval_s": 1.0}


@dataclass(frozen=True)
class Setup:
    """The URLs of one arm's servers and the commands that started them."""

    engines: list[str]
    proxy: str | None
    commands: list[list[str]]


def engine_command(port: int, time_scale: float) -> list[str]:
    return whoseturn_command(
        "sim", *ENGINE_FLAGS, "--time-scale", str(time_scale), "--port", str(port)
    )


@contextmanager
def servers(
    out: Path, arm: str, *, engines: int, time_scale: float, via_proxy: bool
) -> Iterator[Setup]:
    """Start ``engines`` simulated engines (and the proxy in front of them if
    ``via_proxy``), wait until they answer, yield them; stop them all on exit. Logs
    go to ``out/<arm>-*.log``."""
    with ExitStack() as stack:
        urls, commands, started = [], [], []
        for n in range(engines):  # all started first: they load side by side
            port = free_port()
            command = engine_command(port, time_scale)
            log = stack.enter_context((out / f"{arm}-engine-{n}.log").open("ab"))
            started.append(stack.enter_context(running(command, output=log)))
            urls.append(loopback_url(port))
            commands.append(command)
        for n, (url, process) in enumerate(zip(urls, started, strict=True)):
            what = f"engine {n} (see {out / f'{arm}-engine-{n}.log'})"
            wait_until_ok(f"{url}/health", process=process, what=what, timeout_s=READY_S)
        proxy = None
        if via_proxy:
            port = free_port()
            # The proxy on its defaults, as a newcomer runs it: the engines interleave
            # by themselves (ENGINE_FLAGS' threshold), which the proxy sees from its
            # first piece beside a chat stream, and sends batch prompts whole from then
            # on (docs/scheduling.md, piecing).
            listed = [
                {"url": url, "name": f"sim-{n}", "models": ["tiny"]} for n, url in enumerate(urls)
            ]
            command = serve_command(out / "proxy.yaml", port=port, engines=listed, **PROXY_SETTINGS)
            log = stack.enter_context((out / f"{arm}-proxy.log").open("ab"))
            process = stack.enter_context(running(command, output=log, stop_signal=signal.SIGTERM))
            proxy = loopback_url(port)
            commands.append(command)
            what = f"the proxy (see {out / f'{arm}-proxy.log'})"
            wait_until_ok(f"{proxy}/readyz", process=process, what=what, timeout_s=READY_S)
        yield Setup(urls, proxy, commands)
