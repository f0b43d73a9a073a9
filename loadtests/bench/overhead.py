"""What the proxy costs: every arm against one free upstream, side by side, in one run.

Arms: ``direct`` (the upstream itself), ``nginx`` (Debian's package, a streaming
reverse proxy with buffering off, one worker: the floor for any proxy),
``vllm-router`` (vLLM's Rust router from its own venv, :mod:`loadtests.bench.overhead_router`;
skipped when that venv is not built), ``whoseturn`` on its interactive route ``/v1``
and ``whoseturn-batch`` on its batch route ``/batch/v1``, ``whoseturn-2w`` (``serve
--workers 2`` on ``/v1``, the workers sharing the budget in the SQLite ledger of its
data directory: no database server), ``passthrough`` (the floor of the proxy's own
stack: :mod:`loadtests.bench.overhead_passthrough`), all in front of the same upstream
(:mod:`loadtests.bench.overhead_upstream`). Each level's streams come from a load
generator in its own process (:mod:`loadtests.bench.overhead_load`). Per arm and level:
TTFT and inter-token latency p50/p99 added to direct's, the proxy's CPU per request,
relayed tokens per CPU second of the proxy's processes, the proxy's RSS growth per
open stream, errors. Then one-token requests at the largest level (``--one-token``),
in ``--one-token-rounds`` bursts back to back: requests per CPU second, the cost of a
request alone, of the first burst (the upstream connections opened anew) and of the
others (kept open). Then the scheduler alone
(:mod:`loadtests.bench.overhead_sched`).

Run: ``python -m loadtests.bench.overhead [--levels 1,64,256,1024] [--prompt-chars 1000,100000]
[--arms direct,nginx,...]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

from loadtests.bench.overhead_load import raise_open_files
from loadtests.bench.overhead_router import ROUTER_VENV, router_binary, vllm_router
from loadtests.bench.overhead_sched import cap_table, sched_table
from loadtests.support.processes import (
    free_port,
    loopback_url,
    running,
    serve_command,
    wait_until_ok,
)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")
ARMS = (
    "direct", "nginx", "vllm-router", "passthrough", "whoseturn", "whoseturn-batch",
    "whoseturn-2w",
)  # fmt: skip
OPTIONAL_ARMS: tuple[str, ...] = ()  # run only when named
NGINX_CONF = """daemon off; worker_processes 1; pid {root}/nginx.pid; error_log {root}/error.log;
events {{ worker_connections 8192; }}
http {{
  access_log off;
  client_body_temp_path {root}/body; proxy_temp_path {root}/proxy;
  fastcgi_temp_path {root}/fcgi; uwsgi_temp_path {root}/uwsgi; scgi_temp_path {root}/scgi;
  upstream engine {{ server 127.0.0.1:{upstream}; keepalive 1024; }}
  server {{
    listen 127.0.0.1:{port} backlog=4096;
    location / {{
      proxy_pass http://engine; proxy_http_version 1.1; proxy_set_header Connection "";
      proxy_buffering off; proxy_request_buffering off; proxy_read_timeout 300s;
    }}
  }}
}}
"""


@dataclass(frozen=True)
class Arm:
    """One way to reach the upstream: its name, base URL, and the proxy's pid (if any)."""

    name: str
    url: str
    pid: int | None


def cpu_seconds(pid: int) -> float:
    """utime + stime of ``pid`` and its child processes now (from /proc)."""
    total = 0.0
    for p in [pid, *children(pid)]:
        fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS
    return total


def children(pid: int) -> list[int]:
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(p) for p in text.split()]


def rss_bytes(pid: int) -> int:
    """Resident memory of ``pid`` and its children now."""
    return sum(
        int(Path(f"/proc/{p}/statm").read_text().split()[1]) * PAGE_BYTES
        for p in [pid, *children(pid)]
    )


class PeakRss:
    """The highest :func:`rss_bytes` of a process while the ``with`` body runs."""

    def __init__(self, pid: int | None) -> None:
        self.pid, self.peak, self._stop = pid, 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def _watch(self) -> None:
        while self.pid is not None and not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def measure(arm: Arm, streams: int, prompt_chars: int, tokens: int) -> dict[str, float]:
    """One level against one arm: the load generator's summary plus the proxy's CPU
    seconds and its RSS growth."""
    command = [sys.executable, "-m", "loadtests.bench.overhead_load", "--url", arm.url]
    command += ["--streams", str(streams), "--prompt-chars", str(prompt_chars)]
    command += ["--tokens", str(tokens)]
    cpu0 = cpu_seconds(arm.pid) if arm.pid else 0.0
    rss0 = rss_bytes(arm.pid) if arm.pid else 0
    with PeakRss(arm.pid) as peak:
        done = subprocess.run(command, capture_output=True, check=True, timeout=600)
    row: dict[str, float] = json.loads(done.stdout)
    if arm.pid:
        row["cpu_s"] = cpu_seconds(arm.pid) - cpu0
        row["rss_per_stream"] = max(0, peak.peak - rss0) / streams
    return row


@contextmanager
def nginx(upstream: int, root: Path) -> Iterator[Arm]:
    """nginx with the generated configuration, as a child process."""
    port = free_port()
    for sub in ("body", "proxy", "fcgi", "uwsgi", "scgi"):
        (root / sub).mkdir(parents=True, exist_ok=True)
    conf = root / "nginx.conf"
    conf.write_text(NGINX_CONF.format(root=root, upstream=upstream, port=port))
    binary = shutil.which("nginx") or "/usr/sbin/nginx"
    with running([binary, "-c", str(conf), "-p", str(root)], stop_signal=signal.SIGTERM) as proc:
        wait_until_ok(loopback_url(port) + "/health", process=proc, what="nginx")
        yield Arm("nginx", loopback_url(port) + "/v1", proc.pid)


@contextmanager
def whoseturn(upstream: int, root: Path, max_streams: int) -> Iterator[list[Arm]]:
    """The proxy with default settings in front of the upstream (its engine's
    concurrency cap raised to the largest level, so streams are not queued)."""
    port = free_port()
    engine = {"name": "e0", "url": loopback_url(upstream), "max_inflight": max(256, max_streams)}
    data = str(root / "whoseturn-data")
    command = serve_command(root / "whoseturn.yaml", port=port, engines=[engine], data_dir=data)
    log = (root / "whoseturn.log").open("wb")
    try:
        with log, running(command, output=log, stop_signal=signal.SIGTERM, grace_s=5) as proc:
            wait_until_ok(loopback_url(port) + "/readyz", process=proc, what="whoseturn")
            base = loopback_url(port)
            yield [
                Arm("whoseturn", base + "/v1", proc.pid),
                Arm("whoseturn-batch", base + "/batch/v1", proc.pid),
            ]
    finally:
        _print_warnings(root / "whoseturn.log")


@contextmanager
def whoseturn_workers(upstream: int, root: Path, max_streams: int) -> Iterator[Arm]:
    """``whoseturn-2w``: as :func:`whoseturn`, but ``--workers 2``, sharing the budget
    through the SQLite ledger in its data directory (no database server); its CPU
    and RSS are the parent's and its children's (the two workers and
    multiprocessing's resource tracker)."""
    import time

    import httpx

    port = free_port()
    engine = {"name": "e0", "url": loopback_url(upstream), "max_inflight": max(256, max_streams)}
    config = root / "whoseturn-2w.yaml"
    data = str(root / "whoseturn-2w-data")
    command = serve_command(config, port=port, engines=[engine], workers=2, data_dir=data)
    log = (root / "whoseturn-2w.log").open("wb")
    try:
        with log, running(command, output=log, stop_signal=signal.SIGTERM, grace_s=10) as p:
            wait_until_ok(loopback_url(port) + "/readyz", process=p, what="whoseturn-2w")
            seen: set[str] = set()
            deadline = time.monotonic() + 60
            while len(seen) < 2 and time.monotonic() < deadline:  # both workers answer
                seen.add(httpx.get(loopback_url(port) + "/turn", timeout=10).json()["replica"])
            yield Arm("whoseturn-2w", loopback_url(port) + "/v1", p.pid)
    finally:
        _print_warnings(root / "whoseturn-2w.log")


@contextmanager
def passthrough(upstream: int) -> Iterator[Arm]:
    """The bare passthrough (:mod:`loadtests.bench.overhead_passthrough`) as a child."""
    port = free_port()
    command = [sys.executable, "-m", "loadtests.bench.overhead_passthrough"]
    command += ["--port", str(port), "--upstream", loopback_url(upstream)]
    with running(command, stop_signal=signal.SIGTERM, grace_s=5) as proc:
        wait_until_ok(loopback_url(port) + "/health", process=proc, what="the passthrough")
        yield Arm("passthrough", loopback_url(port) + "/v1", proc.pid)


def _print_warnings(path: Path, limit: int = 10) -> None:
    """The proxy's warnings (an engine ejected, a stream broken) on stderr: why
    requests failed, when some did."""
    lines = [x for x in path.read_text(errors="replace").splitlines() if "WARNING" in x]
    for line in lines[:limit]:
        print(f"  whoseturn log: {line}", file=sys.stderr)
    if len(lines) > limit:
        print(f"  whoseturn log: ... {len(lines) - limit} more warnings", file=sys.stderr)


@contextmanager
def upstream_server(tokens: int, interval_s: float) -> Iterator[int]:
    """The free upstream (:mod:`loadtests.bench.overhead_upstream`) as a child; its port."""
    port = free_port()
    command = [sys.executable, "-m", "loadtests.bench.overhead_upstream", "--port", str(port)]
    command += ["--tokens", str(tokens), "--interval", str(interval_s)]
    with running(command, stop_signal=signal.SIGTERM, grace_s=2) as proc:
        wait_until_ok(loopback_url(port) + "/health", process=proc, what="the upstream")
        yield port


def parse_arms(text: str) -> tuple[str, ...]:
    """``--arms``: comma-separated names of :data:`ARMS` and :data:`OPTIONAL_ARMS`, in
    the order given (direct is always run, as the others' reference). An unknown name
    is an error, so a typo does not silently drop an arm."""
    names = tuple(x.strip() for x in text.split(",") if x.strip())
    known = ARMS + OPTIONAL_ARMS
    unknown = [x for x in names if x not in known]
    if unknown or not names:
        raise argparse.ArgumentTypeError(
            f"unknown arm(s) {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}"
        )
    return names


@dataclass(frozen=True)
class Plan:
    """What to run: the levels (concurrent streams), prompt sizes, answer length,
    the arms by name, and the venv the ``vllm-router`` arm runs from."""

    levels: tuple[int, ...] = (1, 64, 256, 1024)
    prompt_chars: tuple[int, ...] = (1000,)
    tokens: int = 256
    interval_s: float = 0.020
    arms: tuple[str, ...] = ARMS
    router_venv: Path = ROUTER_VENV
    one_token: int = 1024  # one-token requests at once, after the levels (0: none)
    one_token_rounds: int = 4  # bursts of them, back to back: the first, then again


Rows = dict[tuple[str, int, int], dict[str, float]]


def run_arms(plan: Plan) -> Rows:
    """Every (arm, prompt size, level) of the plan, arms interleaved per level."""
    return run_plan(replace(plan, one_token=0))[0]


Bursts = dict[str, list[dict[str, float]]]
"""By arm, each burst of one-token requests as :func:`measure` saw it, in order."""


def run_plan(plan: Plan) -> tuple[Rows, Bursts]:
    """Every (arm, prompt size, level) of the plan, arms interleaved per level; then,
    by arm, ``plan.one_token_rounds`` bursts of ``plan.one_token`` one-token requests at
    once (the shortest prompt), back to back. The first burst of an arm opens its
    upstream connections (those of the levels went idle minutes before and were
    closed); the next find them open: the cold figure and the warm one."""
    rows: Rows = {}
    single: Bursts = {}
    with ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="overhead-")))
        port = stack.enter_context(upstream_server(plan.tokens, plan.interval_s))
        arms = [Arm("direct", loopback_url(port) + "/v1", None)]
        if "nginx" in plan.arms:
            arms.append(stack.enter_context(nginx(port, root / "nginx")))
        if "vllm-router" in plan.arms:
            arms += _router_arm(stack, plan, port, root / "vllm-router")
        if "passthrough" in plan.arms:
            arms.append(stack.enter_context(passthrough(port)))
        if {"whoseturn", "whoseturn-batch"} & set(plan.arms):
            arms += stack.enter_context(whoseturn(port, root, max(plan.levels)))
        if "whoseturn-2w" in plan.arms:
            arms.append(stack.enter_context(whoseturn_workers(port, root, max(plan.levels))))
        arms = [a for a in arms if a.name in plan.arms or a.name == "direct"]
        for chars in plan.prompt_chars:
            for level in plan.levels:
                for arm in arms:
                    row = rows[arm.name, chars, level] = measure(arm, level, chars, plan.tokens)
                    error = f", first error: {row['first_error']}" if row["errors"] else ""
                    print(
                        f"  {arm.name} {chars} chars {level} streams done{error}", file=sys.stderr
                    )
        for arm in arms if plan.one_token else ():
            chars = min(plan.prompt_chars)
            rounds = max(1, plan.one_token_rounds)
            single[arm.name] = [measure(arm, plan.one_token, chars, 1) for _ in range(rounds)]
            print(f"  {arm.name} {plan.one_token} one-token requests done", file=sys.stderr)
    return rows, single


def _router_arm(stack: ExitStack, plan: Plan, upstream: int, root: Path) -> list[Arm]:
    """The ``vllm-router`` arm, started on ``stack``; none (and a message saying so)
    when its venv is not built."""
    binary = router_binary(plan.router_venv)
    if binary is None:
        print(
            f"  vllm-router: skipped, {plan.router_venv}/bin/vllm-router not found "
            "(`make bench` builds that venv)",
            file=sys.stderr,
        )
        return []
    url, pid = stack.enter_context(vllm_router(binary, upstream, root, max(plan.levels)))
    return [Arm("vllm-router", url, pid)]


def table(plan: Plan, rows: Rows) -> str:
    """The Markdown table: figures per arm, added latency against direct's."""
    head = (
        "| prompt chars | streams | arm | TTFT p50 / p99 ms | added TTFT p50 / p99 ms "
        "| ITL p50 / p99 ms | added ITL p50 / p99 ms | CPU ms per request | tokens per CPU s "
        "| RSS KiB per stream | errors |\n" + "|---" * 11 + "|"
    )
    lines = [head]
    for chars in plan.prompt_chars:
        for level in plan.levels:
            base = rows["direct", chars, level]
            for arm in (a for a in plan.arms if (a, chars, level) in rows):
                lines.append(_line(chars, level, arm, rows[arm, chars, level], base))
    return "\n".join(lines)


def _line(chars: int, level: int, arm: str, row: dict[str, float], base: dict[str, float]) -> str:
    def ms(key: str) -> str:
        return f"{row[key] * 1000:.1f}"

    def added(key: str) -> str:
        return "—" if arm == "direct" else f"{(row[key] - base[key]) * 1000:+.1f}"

    cpu = row.get("cpu_s")
    per_cpu = f"{row['tokens'] / cpu:,.0f}" if cpu else "—"
    per_request = f"{cpu * 1000 / level:.2f}" if cpu is not None else "—"
    rss = row.get("rss_per_stream")
    rss_kib = f"{rss / 1024:.0f}" if rss is not None else "—"
    return (
        f"| {chars:,} | {level:,} | {arm} | {ms('ttft_p50')} / {ms('ttft_p99')} "
        f"| {added('ttft_p50')} / {added('ttft_p99')} | {ms('itl_p50')} / {ms('itl_p99')} "
        f"| {added('itl_p50')} / {added('itl_p99')} | {per_request} | {per_cpu} | {rss_kib} "
        f"| {int(row['errors'])} |"
    )


def single_table(plan: Plan, single: Bursts) -> str:
    """One-token requests: each proxy's requests per CPU second and CPU per request,
    its first burst and the next ones (their CPU over their requests), side by side."""
    lines = [
        f"{plan.one_token:,} one-token requests at once, {min(plan.prompt_chars):,}-character "
        f"prompts, {plan.one_token_rounds} bursts back to back (first / the others):",
        "",
        "| arm | requests per CPU s | CPU ms per request | TTFT p50 ms | errors |",
        "|---|---|---|---|---|",
    ]
    for arm, bursts in single.items():
        first, again = bursts[0], bursts[1:]
        cpu_first = first.get("cpu_s")
        if not cpu_first:
            continue
        cpu_again = sum(b.get("cpu_s") or 0.0 for b in again)
        n_again = plan.one_token * len(again)
        rate = f"{plan.one_token / cpu_first:,.0f}"
        per = f"{cpu_first * 1000 / plan.one_token:.2f}"
        ttft = f"{first['ttft_p50'] * 1000:.1f}"
        if again and cpu_again:
            rate += f" / {n_again / cpu_again:,.0f}"
            per += f" / {cpu_again * 1000 / n_again:.2f}"
            ttft += " / " + " ".join(f"{b['ttft_p50'] * 1000:.1f}" for b in again)
        errors = sum(int(b["errors"]) for b in bursts)
        lines.append(f"| {arm} | {rate} | {per} | {ttft} | {errors} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Parse the options, run the plan, print both tables."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--levels", default="1,64,256,1024", help="concurrent streams, comma-separated"
    )
    parser.add_argument("--prompt-chars", default="1000", help="prompt sizes, comma-separated")
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument(
        "--arms",
        type=parse_arms,
        default=ARMS,
        help=f"comma-separated, of {','.join(ARMS + OPTIONAL_ARMS)} (default: {','.join(ARMS)})",
    )
    parser.add_argument(
        "--one-token", type=int, default=Plan.one_token, metavar="N",
        help="one-token requests at once after the levels (0: none)",
    )  # fmt: skip
    parser.add_argument(
        "--one-token-rounds", type=int, default=Plan.one_token_rounds, metavar="K",
        help="bursts of them, back to back: the first (cold connections), then again",
    )  # fmt: skip
    parser.add_argument("--no-sched", action="store_true", help="skip the scheduler-alone table")
    args = parser.parse_args(argv)
    plan = Plan(
        levels=tuple(int(x) for x in args.levels.split(",")),
        prompt_chars=tuple(int(x) for x in args.prompt_chars.split(",")),
        tokens=args.tokens,
        arms=args.arms,
        one_token=args.one_token,
        one_token_rounds=args.one_token_rounds,
    )
    raise_open_files()
    print(f"load average before: {os.getloadavg()[0]:.2f}")
    rows, single = run_plan(plan)
    print(table(plan, rows))
    if single:
        print()
        print(single_table(plan, single))
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    if not args.no_sched:
        print()
        print(sched_table())
        print()
        print(cap_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
