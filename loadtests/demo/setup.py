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


def engine_name(n: int) -> str:
    """Engine ``n``'s name, the one name it has everywhere: in the proxy's config, so
    in its ``/turn`` and the timeline plot drawn from it, and in the report's tables
    of what the servers did (the servers watched, :meth:`Setup.watched`)."""
    return f"engine-{n}"


@dataclass(frozen=True)
class Setup:
    """One arm's servers, the engines by name (:func:`engine_name`) and the proxy by
    URL, and the commands that started them."""

    engines: dict[str, str]  # name: base URL, in the order started
    proxy: str | None
    commands: list[list[str]]

    def watched(self) -> dict[str, str]:
        """The servers to watch during the arm (name: base URL), the proxy as ``proxy``."""
        return {**self.engines, **({"proxy": self.proxy} if self.proxy else {})}


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
        named = {engine_name(n): e.url for n, e in enumerate(started)}
        commands = [e.command for e in started]
        proxy = None
        if via_proxy:
            # The proxy on its defaults, as a newcomer runs it: the engines interleave
            # by themselves (ENGINE_FLAGS' threshold), which the proxy sees from its
            # first piece beside a chat stream, and sends batch prompts whole from then
            # on (docs/scheduling.md, piecing).
            listed = [{"url": url, "name": name, "models": ["tiny"]} for name, url in named.items()]
            command = partial(serve_command, out / "proxy.yaml", engines=listed, **PROXY_SETTINGS)
            log = stack.enter_context((out / f"{arm}-proxy.log").open("ab"))
            server = stack.enter_context(serving(command, output=log, stop_signal=signal.SIGTERM))
            proxy = server.url
            commands.append(server.command)
            server.wait_ready(
                "/readyz", what=f"the proxy (see {out / f'{arm}-proxy.log'})", timeout_s=READY_S
            )
        yield Setup(named, proxy, commands)
