"""The demo's processes: simulated engines and the proxy, real processes on loopback.

Each arm gets fresh engines, so no arm inherits another's prefix cache. The commands
are kept: they go into ``result.json`` as the pinned setup.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

from loadtests.support.processes import serve_command, serving, whoseturn_command

PROFILE = "cpu-tiny"
ENGINE_FLAGS = ("--profile", PROFILE, "--long-prefill-token-threshold", "256")
READY_S = 90.0
"""How long a server may take to answer: long, as a loaded machine's imports are slow."""
PROXY_SETTINGS: dict[str, Any] = {"scrape_interval_s": 0.5, "health_interval_s": 1.0}


@dataclass(frozen=True)
class Setup:
    """The URLs of one arm's servers and the commands that started them."""

    engines: list[str]
    proxy: str | None
    commands: list[list[str]]


def engine_command(time_scale: float, *, port: int) -> list[str]:
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
        started = []
        for n in range(engines):  # all started first: they load side by side
            log = stack.enter_context((out / f"{arm}-engine-{n}.log").open("ab"))
            command = partial(engine_command, time_scale)
            started.append(stack.enter_context(serving(command, output=log)))
        for n, engine in enumerate(started):
            what = f"engine {n} (see {out / f'{arm}-engine-{n}.log'})"
            engine.wait_ready("/health", what=what, timeout_s=READY_S)
        urls, commands = [e.url for e in started], [e.command for e in started]
        proxy = None
        if via_proxy:
            # The proxy on its defaults, as a newcomer runs it: the engines interleave
            # by themselves (ENGINE_FLAGS' threshold), which the proxy sees from its
            # first piece beside a chat stream, and sends batch prompts whole from then
            # on (docs/scheduling.md, piecing).
            listed = [
                {"url": url, "name": f"sim-{n}", "models": ["tiny"]} for n, url in enumerate(urls)
            ]
            command = partial(serve_command, out / "proxy.yaml", engines=listed, **PROXY_SETTINGS)
            log = stack.enter_context((out / f"{arm}-proxy.log").open("ab"))
            server = stack.enter_context(serving(command, output=log, stop_signal=signal.SIGTERM))
            proxy = server.url
            commands.append(server.command)
            server.wait_ready(
                "/readyz", what=f"the proxy (see {out / f'{arm}-proxy.log'})", timeout_s=READY_S
            )
        yield Setup(urls, proxy, commands)
