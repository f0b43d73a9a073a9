"""Several proxy replicas in front of the same two engines: does each engine's budget hold?

Arms, each on two fresh simulated engines (``--scheduling-policy priority``, so the
engine tells batch, priority 0, from chat, priority -10):

- ``1 replica``: one proxy, no ledger (exactly the single-replica proxy);
- ``2 replicas`` and ``3 replicas``: sharing one PostgreSQL ledger (docs/replicas.md);
- ``2 uncoordinated``: two proxies without a ledger, each with the whole budget;
- ``2, one killed``: two with the ledger; one is killed (``SIGKILL``) halfway;
- ``2 workers, no database``: one ``serve --workers 2``, its workers sharing the
  budget in the SQLite ledger of its data directory (no PostgreSQL at all).

Chat streams and batch requests are spread over the replicas. Each engine's budget
is fixed (``initial = min = max``), and batch prompts are token ids of one size, so
every number can be read against it. Per arm: interactive TTFT p50/p95 (arrival at
the proxy to first streamed byte, seen by the client), batch records/s, and the
engines' own view: the most batch prompt tokens in prefill each engine ever held
(``whoseturn_sim_prefill_prompt_tokens_peak{priority="0"}``), against the budget.
For the kill arm, also the batch records/s of the survivor before the kill, in the
lease after it, and after the lease.

Run: ``python -m loadtests.bench.replicas [--dsn postgresql://...] [--duration 20]``;
without ``--dsn`` a throwaway PostgreSQL is started (Debian's ``postgresql``, as
the tests do).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import signal
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import httpx

from loadtests.engine_io.metrics import labelled_samples
from loadtests.support.processes import Server as Server  # the replicas test reads it
from loadtests.support.processes import serve_command, serving, whoseturn_command

MODEL = "tiny"
PEAK = "whoseturn_sim_prefill_prompt_tokens_peak"


@dataclass(frozen=True, kw_only=True)
class Plan:
    """One run's shape; the defaults fit two shared CPU cores."""

    budget: int = 600  # each engine's fixed prefill budget, tokens
    batch_prompt: int = 200  # tokens per batch prompt
    batch_tokens: int = 8  # tokens per batch answer
    batch_workers: int = 12  # batch requests kept in flight (each sends the next on its answer)
    chat_workers: int = 4  # chat streams, each pausing chat_pause_s between its chats
    chat_tokens: int = 16  # tokens per chat answer
    chat_pause_s: float = 0.2
    duration_s: float = 20.0  # of each arm's load
    time_scale: float = 2.0  # the engines' --time-scale
    lease_s: float = 2.0  # the replicas' ledger_lease_s
    ledger_interval_s: float = 0.1


@dataclass
class Tally:
    """What the load saw, with the time of each event."""

    ttfts: list[float] = field(default_factory=list)
    batch_done: list[tuple[float, int]] = field(default_factory=list)  # time, replica
    errors: int = 0


@dataclass
class Result:
    arm: str
    replicas: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    batch_per_s: float
    peaks: list[int]
    budget: int
    errors: int
    survivor_per_s: tuple[float, float, float] | None = None

    @property
    def within_budget(self) -> bool:
        return max(self.peaks) <= self.budget


def percentile(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * len(ordered)) - 1))]


# -- processes -------------------------------------------------------------------


@contextmanager
def engines(plan: Plan) -> Iterator[list[Server]]:
    """Two fresh simulated engines."""

    def sim(*, port: int) -> list[str]:
        return whoseturn_command(
            "sim", "--profile", "cpu-tiny", "--served-model-name", MODEL,
            "--scheduling-policy", "priority", "--time-scale", str(plan.time_scale),
            "--port", str(port),
        )  # fmt: skip

    with ExitStack() as stack:
        out = []
        for _ in range(2):
            engine = stack.enter_context(serving(sim))
            engine.wait_ready("/health", what="the simulated engine")
            out.append(engine)
        yield out


@contextmanager
def proxies(
    plan: Plan,
    engine_urls: Sequence[str],
    count: int,
    dsn: str | None,
    root: Path,
    *,
    workers: int = 1,
) -> Iterator[list[Server]]:
    """``count`` proxy replicas in front of ``engine_urls``, sharing ``dsn`` if given;
    each of ``workers`` processes (above 1 with no ``dsn``: sharing the SQLite ledger
    in the replica's data directory under ``root``)."""
    budget = {"initial_tokens": plan.budget, "min_tokens": plan.budget, "max_tokens": plan.budget}
    configs = [
        {"url": url, "name": f"engine-{i}", "models": [MODEL], "scheduling_policy": "priority",
         "budget": budget}
        for i, url in enumerate(engine_urls)
    ]  # fmt: skip
    shared: dict[str, Any] = {
        "ledger_dsn": dsn,
        "ledger_lease_s": plan.lease_s,
        "ledger_interval_s": plan.ledger_interval_s,
    }
    if not dsn:  # the workers of one box share the SQLite ledger; a lone process nothing
        del shared["ledger_dsn"]
        shared = shared if workers > 1 else {}
    with ExitStack() as stack:
        out = []
        for n in range(count):
            command = partial(
                serve_command, root / f"replica-{n}.yaml", engines=configs, replica_id=f"r{n}",
                scrape_interval_s=0.2, health_interval_s=0.5, workers=workers,
                data_dir=str(root / f"replica-{n}-data"), **shared,
            )  # fmt: skip
            replica = stack.enter_context(serving(command))
            replica.wait_ready("/readyz", what=f"proxy replica {n}")
            out.append(replica)
        yield out


# -- load ------------------------------------------------------------------------


async def chat_loop(
    http: httpx.AsyncClient, urls: list[str], alive: list[bool], plan: Plan, n: int, t: Tally
) -> None:
    body = {"model": MODEL, "max_tokens": plan.chat_tokens, "stream": True}
    for k in itertools.count():
        replica = _pick(alive, n + k)
        messages = [{"role": "user", "content": f"question {n}-{k}: how are you today?"}]
        sent = time.monotonic()
        try:
            url = urls[replica] + "/v1/chat/completions"
            async with http.stream("POST", url, json={**body, "messages": messages}) as r:
                first = True
                async for _ in r.aiter_raw():
                    if first and r.status_code == 200:
                        t.ttfts.append(time.monotonic() - sent)
                        first = False
                if r.status_code != 200:
                    t.errors += 1
        except httpx.HTTPError:
            t.errors += alive[replica]
        await asyncio.sleep(plan.chat_pause_s)


async def batch_loop(
    http: httpx.AsyncClient, urls: list[str], alive: list[bool], plan: Plan, n: int, t: Tally
) -> None:
    prompt = [(n * 7 + i) % 200 + 10 for i in range(plan.batch_prompt)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": plan.batch_tokens}
    for k in itertools.count():
        replica = _pick(alive, n + k)
        try:
            r = await http.post(urls[replica] + "/batch/v1/completions", json=body)
            if r.status_code == 200:
                t.batch_done.append((time.monotonic(), replica))
            else:
                t.errors += 1
        except httpx.HTTPError:
            t.errors += alive[replica]  # a request cut by the kill is not the proxy's error
            await asyncio.sleep(0.05)


def _pick(alive: list[bool], k: int) -> int:
    up = [i for i, a in enumerate(alive) if a]
    return up[k % len(up)]


async def run_load(
    plan: Plan, replicas: list[Server], kill_at_s: float | None = None
) -> tuple[Tally, float, float | None]:
    """The load for ``plan.duration_s``; returns the tally, the start time and the
    time of the kill (if any)."""
    urls = [r.url for r in replicas]
    alive = [True] * len(urls)
    tally = Tally()
    limits = httpx.Limits(max_connections=200)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        tasks = [asyncio.create_task(chat_loop(http, urls, alive, plan, n, tally))
                 for n in range(plan.chat_workers)]  # fmt: skip
        tasks += [asyncio.create_task(batch_loop(http, urls, alive, plan, n, tally))
                  for n in range(plan.batch_workers)]  # fmt: skip
        start, killed = time.monotonic(), None
        if kill_at_s is not None:
            await asyncio.sleep(kill_at_s)
            alive[-1] = False
            replicas[-1].process.send_signal(signal.SIGKILL)
            killed = time.monotonic()
            await asyncio.sleep(plan.duration_s - kill_at_s)
        else:
            await asyncio.sleep(plan.duration_s)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return tally, start, killed


def engine_peaks(servers: Sequence[Server]) -> list[int]:
    """Each engine's most batch prompt tokens in prefill since it started."""
    peaks = []
    for server in servers:
        samples = labelled_samples(httpx.get(server.url + "/metrics", timeout=5).text)
        peaks.append(round(samples.get((PEAK, frozenset({("priority", "0")})), 0.0)))
    return peaks


# -- arms ------------------------------------------------------------------------


def run_arm(
    plan: Plan,
    name: str,
    count: int,
    dsn: str | None,
    root: Path,
    *,
    kill: bool = False,
    workers: int = 1,
) -> Result:
    with (
        engines(plan) as sims,
        proxies(plan, [s.url for s in sims], count, dsn, root, workers=workers) as reps,
    ):
        kill_at = plan.duration_s / 2 if kill else None
        tally, start, killed = asyncio.run(run_load(plan, reps, kill_at))
        peaks = engine_peaks(sims)
    end = start + plan.duration_s
    result = Result(
        name, count, percentile(tally.ttfts, 0.5) * 1000, percentile(tally.ttfts, 0.95) * 1000,
        len(tally.batch_done) / plan.duration_s, peaks, plan.budget, tally.errors,
    )  # fmt: skip
    if killed is not None:
        result.survivor_per_s = _survivor_rates(tally, start, killed, end, plan.lease_s)
    return result


def _survivor_rates(
    tally: Tally, start: float, killed: float, end: float, lease_s: float
) -> tuple[float, float, float]:
    """Batch records/s of replica 0: before the kill, in the lease after, after it."""
    windows = [(start, killed), (killed, killed + lease_s), (killed + lease_s, end)]
    done = [t for t, replica in tally.batch_done if replica == 0]
    return tuple(  # type: ignore[return-value]
        sum(1 for t in done if a <= t < b) / max(b - a, 1e-9) for a, b in windows
    )


def run_all(
    plan: Plan, dsn: str, arms: Sequence[str] = ("1", "2", "3", "2u", "kill", "2w")
) -> list[Result]:
    out = []
    with tempfile.TemporaryDirectory(prefix="whoseturn-replicas-") as tmp:
        root = Path(tmp)
        table = {
            "1": ("1 replica", 1, None, False, 1),
            "2": ("2 replicas", 2, dsn, False, 1),
            "3": ("3 replicas", 3, dsn, False, 1),
            "2u": ("2 uncoordinated", 2, None, False, 1),
            "kill": ("2, one killed", 2, dsn, True, 1),
            "2w": ("2 workers, no database", 1, None, False, 2),
        }
        for arm in arms:
            name, count, ledger, kill, workers = table[arm]
            out.append(run_arm(plan, name, count, ledger, root, kill=kill, workers=workers))
    return out


def render(results: Sequence[Result], plan: Plan) -> str:
    lines = [
        f"budget {plan.budget} tokens per engine, batch prompts {plan.batch_prompt} tokens, "
        f"{plan.batch_workers} batch and {plan.chat_workers} chat workers, "
        f"{plan.duration_s:g} s per arm, engines at {plan.time_scale:g}x, "
        f"ledger_interval_s {plan.ledger_interval_s:g}",
        "",
        "| arm | TTFT p50 ms | TTFT p95 ms | batch rec/s | engine peak batch prefill "
        "(a, b) | within budget | errors |",
        "|---|---:|---:|---:|---|---|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r.arm} | {r.ttft_p50_ms:.0f} | {r.ttft_p95_ms:.0f} | {r.batch_per_s:.1f} | "
            f"{r.peaks[0]}, {r.peaks[1]} / {r.budget} | {'yes' if r.within_budget else 'NO'} | "
            f"{r.errors} |"
        )
    for r in results:
        if r.survivor_per_s is not None:
            before, lease, after = r.survivor_per_s
            lines.append(
                f"\n{r.arm}: the survivor's batch rec/s before the kill {before:.1f}, "
                f"in the lease after it ({plan.lease_s:g} s) {lease:.1f}, after the lease "
                f"{after:.1f}"
            )
    return "\n".join(lines)


@contextmanager
def _database(dsn: str | None) -> Iterator[str]:
    if dsn:
        yield dsn
        return
    from loadtests.support.postgres import fresh_database, postgres_cluster

    with postgres_cluster(durable=True) as cluster:
        yield fresh_database(cluster.dsn(), "replicas")


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m loadtests.bench.replicas", description=__doc__)
    parser.add_argument("--dsn", help="PostgreSQL for the ledger (default: a throwaway one)")
    parser.add_argument("--duration", type=float, default=Plan.duration_s, metavar="S")
    parser.add_argument("--budget", type=int, default=Plan.budget, metavar="TOKENS")
    parser.add_argument("--arms", default="1,2,3,2u,kill,2w", help="of 1, 2, 3, 2u, kill, 2w")
    parser.add_argument(
        "--ledger-interval", type=float, default=Plan.ledger_interval_s, metavar="S",
        help="the replicas' ledger_interval_s",
    )  # fmt: skip
    parser.add_argument("--json", action="store_true", help="print the results as JSON too")
    args = parser.parse_args(argv)
    plan = Plan(
        duration_s=args.duration, budget=args.budget, ledger_interval_s=args.ledger_interval
    )
    with _database(args.dsn) as dsn:
        results = run_all(plan, dsn, args.arms.split(","))
    print(render(results, plan))
    if args.json:
        print(json.dumps([r.__dict__ for r in results], indent=1))


if __name__ == "__main__":
    main()
