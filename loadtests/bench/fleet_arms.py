"""The fleet benchmark's processes (:mod:`loadtests.bench.fleet`): a fleet of simulated
engines, the router or proxy of each arm in front of it, and the CPU they use.

- :func:`fleet`: ``whoseturn sim`` engines, one process each, on free loopback
  ports, each with a small KV cache (so that caching and eviction matter), usage
  reporting cached tokens (``--enable-prompt-tokens-details``), and vLLM's KV-cache
  events (``--kv-events-config``). As in vLLM, the engine's PUB socket binds only
  when its endpoint has a wildcard (an address like ``tcp://127.0.0.1:P`` makes it
  connect, and the subscribers connect too, so nobody would listen): it is given
  ``tcp://*:P`` and the subscribers ``tcp://127.0.0.1:P``. The replay socket
  always binds, so it gets the loopback address.
- :func:`arm`: one arm in front of a fleet. ``round-robin``, ``cache-aware`` and
  ``kv-aware`` are vLLM's router (:mod:`loadtests.bench.overhead_router`: its
  binary and relay flags) with that policy; ``least-load`` and ``whoseturn`` are
  the proxy with ``route_by: load`` and with its default (``prefix``) and the
  engines' event endpoints (:func:`whoseturn_config`).
- :class:`CpuMeter`: the cores the bench's processes used over a phase, and the
  machine's.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from loadtests.bench.overhead import cpu_seconds
from loadtests.bench.overhead_router import router_binary, router_command, router_warnings
from loadtests.support.processes import (
    free_port,
    loopback_url,
    running,
    serve_command,
    wait_until_ok,
    whoseturn_command,
)

ARMS = ("round-robin", "least-load", "cache-aware", "kv-aware", "whoseturn")
ROUTER_POLICIES = {
    "round-robin": "round_robin",
    "cache-aware": "cache_aware",
    "kv-aware": "kv_aware",
}
"""The arms that are vLLM's router, and its ``--policy`` for each."""
PROXY_ARMS = ("least-load", "whoseturn")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
READY_S = 120.0  # sixteen engines starting at once on two cores take ~12 s


@dataclass(frozen=True)
class EngineSpec:
    """How every engine of a fleet runs (``whoseturn sim`` flags)."""

    profile: str = "cpu-tiny"
    model: str = "tiny"
    time_scale: float = 0.5
    blocks: int = 256
    block_size: int = 16


@dataclass(frozen=True)
class Engine:
    """A running engine: its base URL, pid, and where its KV events can be read
    (``events``: the PUB socket, ``replay``: its replay socket), as subscribers
    connect to them."""

    url: str
    pid: int
    events: str
    replay: str


@dataclass(frozen=True)
class Target:
    """An arm ready for traffic: its base URL, its process, and whether batch lines
    go through its Batch API (the proxy's arms) or are sent as plain requests by the
    client."""

    arm: str
    url: str
    pid: int
    batch_api: bool


def sim_command(spec: EngineSpec, port: int, events_port: int, replay_port: int) -> list[str]:
    """One engine's command line (see the module's docstring for the endpoints)."""
    events = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
    }
    return whoseturn_command(
        "sim",
        "--profile", spec.profile,
        "--served-model-name", spec.model,
        "--port", str(port),
        "--time-scale", str(spec.time_scale),
        "--block-size", str(spec.block_size),
        "--num-gpu-blocks-override", str(spec.blocks),
        "--max-model-len", str(spec.blocks * spec.block_size),  # one request fits, as vLLM asks
        "--enable-prompt-tokens-details",
        "--kv-events-config", json.dumps(events),
    )  # fmt: skip


def distinct_ports(count: int) -> list[int]:
    """``count`` free loopback ports, no two the same."""
    ports: list[int] = []
    while len(ports) < count:
        port = free_port()
        if port not in ports:
            ports.append(port)
    return ports


@contextmanager
def fleet(size: int, spec: EngineSpec, logs: Path) -> Iterator[list[Engine]]:
    """``size`` fresh engines (empty caches), started side by side, once every one
    answers ``/health``; each one's log in ``logs``."""
    logs.mkdir(parents=True, exist_ok=True)
    ports = distinct_ports(3 * size)
    with ExitStack() as stack:
        started = []
        for i in range(size):
            port, events, replay = ports[3 * i : 3 * i + 3]
            log = stack.enter_context((logs / f"engine-{i}.log").open("wb"))
            command = sim_command(spec, port, events, replay)
            process = stack.enter_context(running(command, output=log, grace_s=5))
            engine = Engine(
                loopback_url(port),
                process.pid,
                f"tcp://127.0.0.1:{events}",
                f"tcp://127.0.0.1:{replay}",
            )
            started.append((engine, process))
        for engine, process in started:
            wait_until_ok(
                engine.url + "/health",
                process=process,
                what=f"engine {engine.url}",
                timeout_s=READY_S,
            )
        yield [engine for engine, _ in started]


def unavailable(name: str, router_venv: Path) -> str | None:
    """Why arm ``name`` cannot run here (its program is not installed), or None."""
    if name in ROUTER_POLICIES and router_binary(router_venv) is None:
        return f"{router_venv}/bin/vllm-router not found (`make bench-fleet` builds it)"
    return None


def fleet_router_command(
    binary: Path, engines: Sequence[Engine], policy: str, port: int, spec: EngineSpec
) -> list[str]:
    """vLLM's router in front of every engine with ``policy``: the overhead bench's
    relay flags (:func:`loadtests.bench.overhead_router.router_command`) with every
    engine as a worker; for ``kv_aware``, each engine's event and replay sockets,
    the engines' block size and their model (the router wants both for static
    event sources)."""
    command = router_command(binary, engines[0].url, port, free_port(), 0)
    at = command.index("--worker-urls") + 2
    command[at:at] = [e.url for e in engines[1:]]
    command[command.index("--policy") + 1] = policy
    if policy == "kv_aware":
        for e in engines:
            command += ["--kv-event-source", f"{e.url}={e.events}"]
            command += ["--kv-event-replay-source", f"{e.url}={e.replay}"]
        command += ["--kv-event-block-size", str(spec.block_size)]
        command += ["--kv-event-model", spec.model]
    return command


def whoseturn_config(
    arm: str, engines: Sequence[Engine], *, batch_store: Path, batch_window: int
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The proxy's engine entries and settings for ``arm``: the Batch API on (its
    store at ``batch_store``), one job's lines in flight capped at ``batch_window``
    (the concurrency the router arms' batch client keeps); ``least-load`` routes by
    load (``route_by: load``) and is given no event endpoints, ``whoseturn`` keeps
    its default (``prefix``) and follows each engine's events. A key is written
    only where the arm needs it."""
    events = arm == "whoseturn"
    entries = [
        {"name": f"e{i}", "url": e.url}
        | ({"kv_events": e.events, "kv_events_replay": e.replay} if events else {})
        for i, e in enumerate(engines)
    ]
    settings: dict[str, Any] = {"batch_store_path": str(batch_store), "batch_window": batch_window}
    if arm == "least-load":
        settings["route_by"] = "load"
    return entries, settings


@contextmanager
def arm(
    name: str,
    engines: Sequence[Engine],
    spec: EngineSpec,
    logs: Path,
    *,
    batch_window: int,
    router_venv: Path,
) -> Iterator[Target]:
    """Arm ``name`` in front of ``engines``, ready for traffic. Raises RuntimeError
    when it cannot start (:func:`unavailable`) or does not (its log's last lines in
    the message)."""
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    if name in ROUTER_POLICIES:
        binary = router_binary(router_venv)
        if binary is None:
            raise RuntimeError(unavailable(name, router_venv))
        command = fleet_router_command(binary, engines, ROUTER_POLICIES[name], port, spec)
        log_path, ready = logs / "vllm-router.log", "/health"
    else:
        entries, settings = whoseturn_config(
            name, engines, batch_store=logs / "batch.db", batch_window=batch_window
        )
        command = serve_command(logs / "whoseturn.yaml", port=port, engines=entries, **settings)
        log_path, ready = logs / "whoseturn.log", "/readyz"
    url = loopback_url(port)
    with (
        log_path.open("wb") as log,
        running(command, output=log, stop_signal=signal.SIGTERM, grace_s=10) as p,
    ):
        try:
            wait_until_ok(url + ready, process=p, what=name, timeout_s=60)
            if name in PROXY_ARMS:
                _wait_engines_up(url, len(engines), p.pid)
        except RuntimeError as exc:
            raise RuntimeError(f"{exc}; {_tail(log_path)}") from exc
        try:
            yield Target(name, url, p.pid, batch_api=name in PROXY_ARMS)
        finally:
            warnings = router_warnings(log_path) if name in ROUTER_POLICIES else _warnings(log_path)
            for line in warnings:
                print(f"  {name} log: {line}", file=sys.stderr, flush=True)


def _wait_engines_up(url: str, count: int, pid: int, timeout_s: float = 60.0) -> None:
    """Until the proxy's ``/readyz`` lists all ``count`` engines up (it is ready
    once one is)."""
    deadline = time.monotonic() + timeout_s
    while True:
        up = httpx.get(url + "/readyz", timeout=5).json().get("engines_up", [])
        if len(up) >= count:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"proxy {pid}: {len(up)} of {count} engines up after {timeout_s:.0f} s"
            )
        time.sleep(0.2)


def _warnings(path: Path, limit: int = 10) -> list[str]:
    """The proxy's warnings and errors (why requests failed, when some did), but
    the one it always logs when stopped (its drain)."""
    lines = [
        x for x in path.read_text(errors="replace").splitlines() if "WARNING" in x or "ERROR" in x
    ]
    lines = [x for x in lines if "draining" not in x]
    more = [f"... {len(lines) - limit} more"] if len(lines) > limit else []
    return lines[:limit] + more


def _tail(path: Path, lines: int = 5) -> str:
    text = path.read_text(errors="replace").strip().splitlines() if path.exists() else []
    return "log: " + (" | ".join(text[-lines:]) if text else "(empty)")


def scrape(engines: Sequence[Engine]) -> list[str]:
    """Every engine's ``/metrics`` text, in order."""
    with httpx.Client(timeout=10) as http:
        return [http.get(e.url + "/metrics").text for e in engines]


@dataclass(frozen=True)
class CpuUse:
    """Cores used over a phase: by the bench's processes (the client, the engines,
    the arm's process), and by the whole machine (others' work included)."""

    client: float
    engines: float
    arm: float
    machine: float

    @property
    def ours(self) -> float:
        return self.client + self.engines + self.arm


class CpuMeter:
    """CPU seconds of the bench's processes from :meth:`start` to :meth:`stop`."""

    def __init__(self, engine_pids: Sequence[int], arm_pid: int | None) -> None:
        self._engines, self._arm = list(engine_pids), arm_pid
        self._start = self._read()

    def start(self) -> None:
        self._start = self._read()

    def stop(self) -> CpuUse:
        end = self._read()
        wall = max(end[0] - self._start[0], 1e-9)
        client, engines, arm_s, machine = (
            (b - a) / wall for a, b in zip(self._start[1:], end[1:], strict=True)
        )
        return CpuUse(client, engines, arm_s, machine)

    def _read(self) -> tuple[float, float, float, float, float]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        engines = sum(_cpu(p) for p in self._engines)
        arm_s = _cpu(self._arm) if self._arm is not None else 0.0
        return (
            time.monotonic(),
            usage.ru_utime + usage.ru_stime,
            engines,
            arm_s,
            _machine_busy_s(),
        )


def _cpu(pid: int) -> float:
    try:
        return cpu_seconds(pid)
    except (FileNotFoundError, ProcessLookupError):
        return 0.0


def _machine_busy_s() -> float:
    """CPU seconds the whole machine spent busy since boot (``/proc/stat``: all but
    idle and iowait)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / CLOCK_TICKS
