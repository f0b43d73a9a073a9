"""Slow clients cannot hold a real ``whoseturn serve`` process's sockets, nor slow its
chat.

One proxy (header and body read timeouts of 2 s) in front of one simulated engine in
real time, child processes on loopback. The same chat load (four streaming clients,
one short question after another) runs twice in one run: alone, then while 500
incomplete connections are held against the proxy, each opened again as soon as the
proxy closes it (half trickle their request headers a byte at a time, half send
their headers and part of a body, then nothing). Then the attack stops opening new
ones and leaves the last ones open: the proxy must close them all itself.

Must hold: each slow connection is closed by the proxy within its read timeout (plus
slack for a busy machine); the proxy's open file descriptors are back to the
baseline within the read timeout plus 5 s of the attack's end; chat TTFT p95 during
the attack is within 2x of chat TTFT p95 alone; and the chat of the second arm ran
while the slow connections were held (else the run proves nothing, and fails saying
so).
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest

from tests.support import MODEL
from tests.support.children import logged_proxy
from tests.support.processes import LOOPBACK, Child

from .proxyserver import engine, spawn_sim

pytestmark = [pytest.mark.integration, pytest.mark.timeout(90)]

READ_TIMEOUT_S = 2.0  # header_timeout_s and body_timeout_s both
SLOW = 500
CHAT_CLIENTS = 4
ARM_S = 6.0
MAX_RATIO = 2.0
TRICKLE_S = 0.2  # one header byte this often
CLOSE_SLACK_S = 2.0  # a slow connection's life past its timeout, on a busy 2-core machine
FDS_BACK_WITHIN_S = READ_TIMEOUT_S + 5
HEAD = (
    f"POST /v1/chat/completions HTTP/1.1\r\nHost: {LOOPBACK}\r\nContent-Type: application/json\r\n"
)


@dataclass
class Attack:
    """500 incomplete connections held against ``port`` until ``stop()``."""

    port: int
    open: int = 0
    lifetimes: dict[str, list[float]] = field(default_factory=lambda: {"headers": [], "body": []})
    answers: dict[str, int] = field(default_factory=dict)
    stopped: asyncio.Event = field(default_factory=asyncio.Event)

    async def hold(self, kind: str, after_s: float) -> None:
        """Keep one connection of ``kind`` open from ``after_s`` on: again each time
        the proxy closes it."""
        await asyncio.sleep(after_s)
        while not self.stopped.is_set():
            reader, writer = await asyncio.open_connection(LOOPBACK, self.port)
            opened = time.monotonic()
            self.open += 1
            try:
                if kind == "headers":
                    await self._trickle_headers(reader, writer)
                else:
                    await self._part_of_a_body(reader, writer)
            finally:
                self.open -= 1
                self.lifetimes[kind].append(time.monotonic() - opened)
                writer.close()

    async def _trickle_headers(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        head = (HEAD + "X-Slow: " + "a" * 4096).encode()
        for i in range(len(head)):
            try:
                writer.write(head[i : i + 1])
                await writer.drain()
                if await asyncio.wait_for(reader.read(1024), TRICKLE_S) == b"":
                    return  # closed by the proxy
            except TimeoutError:
                continue
            except ConnectionError:
                return
        raise AssertionError("the proxy read 4 KiB of headers trickled at 5 bytes/s")

    async def _part_of_a_body(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write((HEAD + "Content-Length: 1000\r\n\r\n" + '{"model": "').encode())
        try:
            answer = await reader.read()  # until the proxy closes the connection
        except ConnectionError:
            answer = b""
        status = answer.split(b" ", 2)[1].decode() if answer.startswith(b"HTTP/") else "none"
        self.answers[status] = self.answers.get(status, 0) + 1


def chat_body(n: int) -> dict[str, object]:
    messages = [{"role": "user", "content": f"question {n}"}]
    return {"model": MODEL, "messages": messages, "max_tokens": 8, "stream": True}


async def chat_ttfts(
    client: httpx.AsyncClient, seconds: float, attack: Attack | None
) -> tuple[list[float], list[int]]:
    """TTFT of each chat of ``CHAT_CLIENTS`` clients for ``seconds``, and the slow
    connections open when each began."""
    ttfts: list[float] = []
    held: list[int] = []
    end = time.monotonic() + seconds

    async def one_client(c: int) -> None:
        n = 0
        while time.monotonic() < end:
            n += 1
            held.append(attack.open if attack else 0)
            started = time.monotonic()
            body = chat_body(c * 10_000 + n)
            async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                assert response.status_code == 200, await response.aread()
                first: float | None = None
                async for line in response.aiter_lines():
                    if first is None and line.startswith("data: ") and '"content"' in line:
                        first = time.monotonic() - started
                assert first is not None, "a stream with no content"
                ttfts.append(first)

    await asyncio.gather(*(one_client(c) for c in range(CHAT_CLIENTS)))
    return ttfts, held


def p95(samples: list[float]) -> float:
    return statistics.quantiles(samples, n=20)[-1]


@contextmanager
def serve(tmp_path: Path, engine_url: str) -> Iterator[tuple[Child, str]]:
    settings: dict[str, Any] = {
        "header_timeout_s": READ_TIMEOUT_S,
        "body_timeout_s": READ_TIMEOUT_S,
    }
    with logged_proxy(tmp_path, [engine(engine_url, "a")], **settings) as (child, url):
        yield child, url


async def fds_back_within(process: psutil.Process, baseline: int, seconds: float) -> float | None:
    """Seconds until ``process`` has at most ``baseline`` open descriptors, or None."""
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        if process.num_fds() <= baseline:
            return time.monotonic() - started
        await asyncio.sleep(0.05)
    return None


@dataclass
class Run:
    alone: list[float]  # chat TTFTs without the slow connections
    beside: list[float]  # ... and beside them
    held: list[int]  # slow connections open as each chat of the second arm began
    baseline: int  # the proxy's open descriptors before the attack
    attacked: int  # ... once it held 90 % of them
    back_s: float | None  # from the attack's end until back at the baseline
    fds_after: int
    attack: Attack

    def report(self) -> dict[str, object]:
        return {
            "fds (baseline, attacked, after)": (self.baseline, self.attacked, self.fds_after),
            "fds back in s": self.back_s,
            "chats": (len(self.alone), len(self.beside)),
            "ttft p95 ms": (round(p95(self.alone) * 1000, 1), round(p95(self.beside) * 1000, 1)),
            "slow connections": {k: len(v) for k, v in self.attack.lifetimes.items()},
            "longest lives s": {k: round(max(v), 2) for k, v in self.attack.lifetimes.items()},
            "body answers": self.attack.answers,
            "held at chat start (min, median)": (min(self.held), statistics.median(self.held)),
        }


async def run(url: str, proxy: psutil.Process) -> Run:
    port = int(url.rsplit(":", 1)[1])
    limits = httpx.Limits(max_connections=CHAT_CLIENTS, max_keepalive_connections=CHAT_CLIENTS)
    async with httpx.AsyncClient(base_url=url, timeout=30, limits=limits) as client:
        await chat_ttfts(client, 1.0, None)  # warm-up: the connections both ways
        alone, _ = await chat_ttfts(client, ARM_S, None)
        baseline = proxy.num_fds()
        attack = Attack(port)
        # Opened over one timeout, so that they are closed (and opened again) at a
        # steady rate, as a patient attacker would: 250 a second.
        holders = [
            asyncio.create_task(
                attack.hold("headers" if i % 2 else "body", i / SLOW * READ_TIMEOUT_S)
            )
            for i in range(SLOW)
        ]
        for _ in range(1000):  # 10 s at most
            if attack.open >= SLOW * 0.9:
                break
            await asyncio.sleep(0.01)
        attacked = proxy.num_fds()
        beside, held = await chat_ttfts(client, ARM_S, attack)
        attack.stopped.set()  # no new connections; the open ones stay as they are
        back_s = await fds_back_within(proxy, baseline, FDS_BACK_WITHIN_S)
        _, still_open = await asyncio.wait(holders, timeout=READ_TIMEOUT_S + CLOSE_SLACK_S)
        for holder in still_open:  # a proxy that never closes them fails below
            holder.cancel()
        await asyncio.gather(*holders, return_exceptions=True)
    return Run(alone, beside, held, baseline, attacked, back_s, proxy.num_fds(), attack)


def test_slow_clients_are_closed_and_chat_keeps_its_ttft(tmp_path: Path) -> None:
    with spawn_sim(time_scale=1.0) as sim, serve(tmp_path, sim.base_url) as (child, url):
        out = asyncio.run(run(url, psutil.Process(child.process.pid)))
        child.check_alive()
    report = out.report()
    print(json.dumps(report, default=str))
    # the slow connections are closed at their timeout and opened again, so the count
    # dips between (398 of 500 at one chat's start in a CI run): most chats must start
    # beside nearly all of them, and none beside fewer than 60 %
    beside = f"chat did not run beside the slow connections: {report}"
    assert statistics.median(out.held) >= SLOW * 0.8 and min(out.held) >= SLOW * 0.6, beside
    assert out.attacked >= out.baseline + SLOW * 0.8, report
    for lives in out.attack.lifetimes.values():
        assert max(lives) < READ_TIMEOUT_S + CLOSE_SLACK_S, report
    assert set(out.attack.answers) == {"408"}, report
    assert out.back_s is not None, f"fds not back within {FDS_BACK_WITHIN_S} s: {report}"
    assert len(out.alone) >= 40 and len(out.beside) >= 40, report
    assert p95(out.beside) <= MAX_RATIO * p95(out.alone), report
