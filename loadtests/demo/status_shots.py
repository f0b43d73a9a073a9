"""``make status-shots``: the status page as a person sees it, kept in ``docs/``.

The picture in the docs is only worth keeping if it is the page as it is today, so
it is taken, not drawn: two simulated engines (``whoseturn sim``, cpu-tiny) and the
proxy in front of them on loopback; batch prompts streaming on both and a chat every
:data:`CHAT_EVERY_S` beside them; after a few seconds one engine is stopped, so the
page shows a dead engine as it reads one; then ``/status`` is opened in Debian's
headless Chromium (driven by Playwright, as the browser tests drive it) and a
full-page PNG is written to each path given.

    python -m loadtests.demo.status_shots docs/status-page.png

Logs of the servers go to ``--logs`` (``artifacts/status-shots`` by default).
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from loadtests.support.processes import serve_command, serving, stop, whoseturn_command

MODEL = "tiny"
SIM_FLAGS = ("--profile", "cpu-tiny", "--served-model-name", MODEL)
PROXY_SETTINGS: dict[str, Any] = {"scrape_interval_s": 0.25, "health_interval_s": 0.5}
READY_S = 90.0
"""How long a server may take to answer: a loaded machine's imports are slow."""
BATCH_STREAMS = 16  # each sends a batch request after the other: more than the budget
BATCH_WORDS = 700  # takes at once, so some wait, held and then admitted, all along
BATCH_MAX_TOKENS = 200
CHAT_WORDS = 300
CHAT_MAX_TOKENS = 24
CHAT_EVERY_S = 0.6
WORDS = "river stone amber cloud maple harbor lantern meadow copper violet".split()


def text(tag: str, n: int) -> str:
    """``n`` words led by ``tag``, so that no two prompts share a cached prefix."""
    return " ".join([tag, *(WORDS[i % len(WORDS)] for i in range(n))])


def chromium_path() -> str | None:
    """``$WHOSETURN_CHROMIUM``, else ``chromium`` on the PATH, else Debian's path (as
    the browser tests find it)."""
    candidates = (
        os.environ.get("WHOSETURN_CHROMIUM"),
        shutil.which("chromium"),
        "/usr/bin/chromium",
    )
    return next((c for c in candidates if c and os.access(c, os.X_OK)), None)


@dataclass
class Traffic:
    """Streaming requests to the proxy, each in its own thread; errors are counted
    (a stream on the engine that is stopped breaks: that is the point), never raised."""

    base_url: str
    stop: threading.Event = field(default_factory=threading.Event)
    errors: list[str] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)

    def start(self, target: object, *args: object) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)  # type: ignore[arg-type]
        thread.start()
        self.threads.append(thread)

    def stream(self, path: str, body: dict[str, object]) -> None:
        """One streaming request, read to its end or until :attr:`stop`."""
        try:
            with (
                httpx.Client(base_url=self.base_url, timeout=httpx.Timeout(60, connect=5)) as c,
                c.stream("POST", path, json={**body, "stream": True}) as response,
            ):
                for _ in response.iter_lines():
                    if self.stop.is_set():
                        return
        except httpx.HTTPError as exc:
            if not self.stop.is_set():
                self.errors.append(f"{path}: {exc!r}")

    def batches(self, stream: int) -> None:
        """Batch requests one after the other until :attr:`stop`."""
        n = 0
        while not self.stop.is_set():
            prompt = text(f"batch{stream}-{n}", BATCH_WORDS)
            body = {"model": MODEL, "prompt": prompt, "max_tokens": BATCH_MAX_TOKENS}
            self.stream("/batch/v1/completions", body)
            n += 1

    def chats(self) -> None:
        """A chat every :data:`CHAT_EVERY_S` (one at a time) until :attr:`stop`."""
        n = 0
        while not self.stop.is_set():
            started = time.monotonic()
            content = text(f"chat{n}", CHAT_WORDS)
            body = {"model": MODEL, "messages": [{"role": "user", "content": content}]}
            self.stream("/v1/chat/completions", {**body, "max_tokens": CHAT_MAX_TOKENS})
            n += 1
            self.stop.wait(max(0.0, CHAT_EVERY_S - (time.monotonic() - started)))

    def close(self) -> None:
        self.stop.set()
        deadline = time.monotonic() + 5
        for thread in self.threads:
            thread.join(max(0.0, deadline - time.monotonic()))


@dataclass(frozen=True)
class Stack:
    """The proxy's URL, and engine-1's process (the engine that goes down)."""

    proxy_url: str
    engine_1: subprocess.Popen[bytes]


@contextmanager
def stack(logs: Path) -> Iterator[Stack]:
    """Two simulated engines and the proxy in front of them (``engine-0`` and
    ``engine-1``), until the ``with`` body ends."""
    logs.mkdir(parents=True, exist_ok=True)
    with ExitStack() as es:
        sims = []
        for n in range(2):
            log = es.enter_context((logs / f"engine-{n}.log").open("ab"))
            sims.append(es.enter_context(serving(_sim_command, output=log)))
        for n, sim in enumerate(sims):
            sim.wait_ready("/health", what=f"engine-{n} ({logs}/engine-{n}.log)", timeout_s=READY_S)
        engines = [
            {"url": s.url, "name": f"engine-{n}", "models": [MODEL]} for n, s in enumerate(sims)
        ]
        config = logs / "proxy.yaml"
        command = partial(serve_command, config, engines=engines, **PROXY_SETTINGS)
        log = es.enter_context((logs / "proxy.log").open("ab"))
        proxy = es.enter_context(serving(command, output=log, stop_signal=signal.SIGTERM))
        proxy.wait_ready("/readyz", what=f"the proxy ({logs}/proxy.log)", timeout_s=READY_S)
        yield Stack(proxy.url, sims[1].process)


def _sim_command(*, port: int) -> list[str]:
    return whoseturn_command(*("sim", *SIM_FLAGS, "--port", str(port)))


def shoot(paths: Sequence[Path], *, warm_s: float, down_after_s: float, logs: Path) -> int:
    """Run the scene and write the page's picture to each of ``paths``; 0 if it was
    taken, 1 with a message on stderr if not."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        print("status-shots needs playwright: pip install -e '.[dev]'", file=sys.stderr)
        return 1
    browser_path = chromium_path()
    if browser_path is None:
        print("Chromium not found: apt-get install chromium", file=sys.stderr)
        return 1
    with stack(logs) as s:
        traffic = Traffic(s.proxy_url)
        try:
            for i in range(BATCH_STREAMS):
                traffic.start(traffic.batches, i)
            traffic.start(traffic.chats)
            with sync_playwright() as playwright:
                browser = playwright.chromium.launch(
                    executable_path=browser_path,
                    headless=True,
                    args=["--no-sandbox", "--disable-gpu", "--no-first-run"],
                )
                context = browser.new_context(
                    viewport={"width": 1280, "height": 1000}, device_scale_factor=1
                )
                page = context.new_page()
                page.goto(f"{s.proxy_url}/status")
                began = time.monotonic()
                page.wait_for_timeout(down_after_s * 1000)
                stop(s.engine_1, signal.SIGKILL)  # a crash: no goodbye to the proxy
                page.wait_for_timeout(max(0.0, warm_s - (time.monotonic() - began)) * 1000)
                for path in paths:
                    path.parent.mkdir(parents=True, exist_ok=True)
                    page.screenshot(path=str(path), full_page=True)
                    print(f"wrote {path}")
                browser.close()
        finally:
            traffic.close()
    if traffic.errors:
        print(f"{len(traffic.errors)} streams broke (engine-1 was stopped)", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.demo.status_shots",
        description="Take full-page screenshots of /status beside chat and batch work.",
    )
    parser.add_argument(
        "paths", nargs="*", type=Path, default=[Path("docs/status-page.png")],
        help="PNG files to write (default: docs/status-page.png)",
    )  # fmt: skip
    parser.add_argument(
        "--seconds", type=float, default=16.0,
        help="how long the page runs before the picture (default: 16)",
    )  # fmt: skip
    parser.add_argument(
        "--down-after", type=float, default=6.0,
        help="seconds after the page opens that engine-1 is stopped (default: 6)",
    )  # fmt: skip
    parser.add_argument(
        "--logs", type=Path, default=Path("artifacts/status-shots"),
        help="where the servers' logs go (default: artifacts/status-shots)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    return shoot(args.paths, warm_s=args.seconds, down_after_s=args.down_after, logs=args.logs)


if __name__ == "__main__":
    sys.exit(main())
