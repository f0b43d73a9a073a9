"""The fleet benchmark: what routing by prefix cache is worth across a fleet of engines.

For fleets of 4 and 16 simulated engines (``whoseturn sim``, one process each, a
small KV cache, KV-cache events on: :mod:`loadtests.bench.fleet_arms`), three
workloads (:mod:`loadtests.bench.fleet_workloads`: ``conversations``,
``system-prompt``, ``documents``) and five arms in front of the fleet: vLLM's router
with ``round_robin``, ``cache_aware`` and ``kv_aware`` (the last following the
engines' KV events), and whoseturn routing by load (``least-load``) and by prefix
(``whoseturn``). Every arm gets a fresh fleet (fresh engines, empty caches), so its
first run is a cold one; ``--repeat N`` runs the workload N more times on the same,
now warm, fleet and reports them as a second set of columns.

Per arm (:mod:`loadtests.bench.fleet_figures`): the fleet's prefix-cache hit rate
from the engines' own counters, prompt tokens prefilled per prompt token answered,
chat TTFT p50/p95 as the client saw it, batch valid records per hour (documents),
makespan, and the CPU the bench's processes used; each with its ratio to round
robin's in the same phase. One Markdown table per fleet size and workload, printed
and written with the date into ``docs/fleet.md`` (between its result markers).

Run: ``python -m loadtests.bench.fleet [--engines 4,16] [--workloads ...]
[--arms ...] [--duration-s 20] [--repeat N]`` (``make bench-fleet``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path

from loadtests.bench.fleet_arms import (
    ARMS,
    CpuMeter,
    CpuUse,
    Engine,
    EngineSpec,
    Target,
    arm,
    fleet,
    scrape,
    unavailable,
)
from loadtests.bench.fleet_client import run_phase
from loadtests.bench.fleet_figures import (
    Phase,
    Row,
    cache_counts,
    figures,
    fleet_delta,
    table,
    with_results,
)
from loadtests.bench.fleet_workloads import WORKLOADS, Workload, make
from loadtests.bench.overhead_load import raise_open_files
from loadtests.bench.overhead_router import ROUTER_VENV

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "fleet.md"


@dataclass(frozen=True)
class Plan:
    """What to run, and how the engines and the batch client are set."""

    engines: tuple[int, ...] = (4, 16)
    workloads: tuple[str, ...] = WORKLOADS
    arms: tuple[str, ...] = ARMS
    duration_s: float = 20.0
    repeat: int = 0
    seed: int = 1
    spec: EngineSpec = field(default_factory=EngineSpec)
    batch_per_engine: int = 2  # the batch client's concurrency, per engine of the fleet
    router_venv: Path = ROUTER_VENV

    def deadline_s(self) -> float:
        """How long a phase may send for: enough for the slowest arm's batch."""
        return max(60.0, 6 * self.duration_s)


def run_arm(plan: Plan, size: int, workload: Workload, name: str, logs: Path) -> Row:
    """One arm on a fresh fleet: its cold phase, then ``plan.repeat`` warm ones."""
    where = f"{size} engines, {workload.name}, {name}"
    missing = unavailable(name, plan.router_venv)
    if missing:
        _say(f"{where}: skipped, {missing}")
        return Row(name, note=f"skipped: {missing}")
    with ExitStack() as stack:
        started = time.monotonic()
        engines = stack.enter_context(fleet(size, plan.spec, logs))
        try:
            target = stack.enter_context(
                arm(
                    name,
                    engines,
                    plan.spec,
                    logs,
                    batch_window=plan.batch_per_engine * size,
                    router_venv=plan.router_venv,
                )
            )
        except RuntimeError as exc:
            _say(f"{where}: did not start: {exc}")
            return Row(name, note="did not start (see its log)")
        _say(f"{where}: ready in {time.monotonic() - started:.1f} s")
        meter = CpuMeter([e.pid for e in engines], target.pid)
        phases = [
            _phase(plan, target, workload, engines, meter, where, p) for p in range(1 + plan.repeat)
        ]
    return Row(
        name,
        cold=figures(phases[:1]),
        warm=figures(phases[1:]) if plan.repeat else None,
    )


def _phase(
    plan: Plan,
    target: Target,
    workload: Workload,
    engines: Sequence[Engine],
    meter: CpuMeter,
    where: str,
    number: int,
) -> Phase:
    """One run of the workload against the arm, measured."""
    before = [cache_counts(text) for text in scrape(engines)]
    meter.start()
    outcome = asyncio.run(
        run_phase(
            target.url,
            workload,
            model=plan.spec.model,
            batch_api=target.batch_api,
            concurrency=plan.batch_per_engine * len(engines),
            deadline_s=plan.deadline_s(),
        )
    )
    cpu = meter.stop()
    after = [cache_counts(text) for text in scrape(engines)]
    phase = Phase(fleet_delta(before, after), outcome, cpu.ours, cpu.machine)
    _say(_progress(where, "cold" if number == 0 else f"warm {number}", phase, cpu))
    return phase


def _progress(where: str, label: str, phase: Phase, cpu: CpuUse) -> str:
    f, o = figures([phase]), phase.outcome
    rate = "—" if f.hit_rate is None else f"{f.hit_rate:.1%}"
    p95 = "—" if f.ttft_p95_s is None else f"{f.ttft_p95_s * 1000:,.0f} ms"
    batch = (
        f", {o.valid_lines}/{o.lines} lines valid in {o.batch_s:.1f} s"
        if o.lines and o.batch_s
        else ""
    )
    error = f"; first error: {o.first_error}" if o.first_error else ""
    return (
        f"{where}, {label}: hit rate {rate}, TTFT p95 {p95} ({o.chat_requests} chats), "
        f"makespan {o.makespan_s:.1f} s{batch}; CPU cores: ours {cpu.ours:.2f} "
        f"(client {cpu.client:.2f}, engines {cpu.engines:.2f}, arm {cpu.arm:.2f}), "
        f"machine {cpu.machine:.2f}{error}"
    )


def _say(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def run(plan: Plan, out: Path) -> dict[tuple[int, str], list[Row]]:
    """Every fleet size, workload and arm of the plan; each arm's logs under ``out``."""
    results: dict[tuple[int, str], list[Row]] = {}
    for size in plan.engines:
        for name in plan.workloads:
            workload = make(name, size, plan.duration_s, plan.seed)
            _say(
                f"{size} engines, {name}: {workload.chat_requests} chat requests, "
                f"{len(workload.lines)} batch lines"
            )
            results[size, name] = [
                run_arm(plan, size, workload, a, out / f"{size}-{name}-{a}") for a in plan.arms
            ]
    return results


def tables(plan: Plan, results: dict[tuple[int, str], list[Row]]) -> str:
    """Every table, with its heading."""
    parts = []
    for (size, name), rows in results.items():
        batch = name == "documents"
        parts.append(
            f"#### {size} engines, {name}\n\n{table(rows, batch=batch, warm=plan.repeat > 0)}"
        )
    return "\n\n".join(parts)


def cpu_line(results: dict[tuple[int, str], list[Row]]) -> str:
    """The most CPU any phase used: the bench's processes, and the machine."""
    runs = [f for rows in results.values() for r in rows for f in (r.cold, r.warm) if f]
    ours = [f.cpu_cores for f in runs if f.cpu_cores is not None]
    machine = [f.machine_cores for f in runs if f.machine_cores is not None]
    if not ours or not machine:
        return ""
    return (
        f"CPU: the bench's processes (client, engines, router or proxy) used at most "
        f"{max(ours):.2f} of the {os.cpu_count()} cores in a phase, the machine at most "
        f"{max(machine):.2f} (others' work included)."
    )


def settings_line(plan: Plan) -> str:
    """How the engines and the client were set, for the record."""
    s = plan.spec
    return (
        f"Engines: `whoseturn sim --profile {s.profile} --time-scale {s.time_scale} "
        f"--block-size {s.block_size} --num-gpu-blocks-override {s.blocks}` "
        f"({s.blocks * s.block_size:,} tokens of KV cache each); workloads sized for "
        f"{plan.duration_s:g} s, seed {plan.seed}; batch client concurrency "
        f"{plan.batch_per_engine} per engine (the proxy's `batch_window` the same); "
        f"warm repeats: {plan.repeat}."
    )


def _commit() -> str:
    try:
        done = subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return done.stdout.strip()


def _csv(text: str) -> tuple[str, ...]:
    return tuple(x.strip() for x in text.split(",") if x.strip())


def _names(known: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """An option's parser: comma-separated names of ``known``, in the order given;
    an unknown name is an error, so that a typo does not drop an arm silently."""

    def parse(text: str) -> tuple[str, ...]:
        names = _csv(text)
        unknown = [x for x in names if x not in known]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(unknown) or '(none given)'}; known: {', '.join(known)}"
            )
        return names

    return parse


def parse_args(argv: list[str] | None) -> tuple[Plan, argparse.Namespace]:
    """The command line as a plan (and the output options)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--engines", type=lambda t: tuple(int(x) for x in _csv(t)), default=(4, 16))
    parser.add_argument("--workloads", type=_names(WORKLOADS), default=WORKLOADS)
    parser.add_argument("--arms", type=_names(ARMS), default=ARMS)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument(
        "--repeat", type=int, default=0, help="warm runs after the cold one, on the same fleet"
    )
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--time-scale", type=float, default=EngineSpec.time_scale)
    parser.add_argument("--profile", default=EngineSpec.profile)
    parser.add_argument(
        "--blocks", type=int, default=EngineSpec.blocks, help="KV blocks per engine"
    )
    parser.add_argument("--batch-per-engine", type=int, default=2)
    parser.add_argument(
        "--out", type=Path, default=None, help="logs (default artifacts/fleet/<time>)"
    )
    parser.add_argument("--doc", type=Path, default=DOC, help="where the results are written")
    parser.add_argument("--no-doc", action="store_true", help="print only")
    args = parser.parse_args(argv)
    spec = EngineSpec(profile=args.profile, time_scale=args.time_scale, blocks=args.blocks)
    plan = Plan(
        engines=args.engines,
        workloads=args.workloads,
        arms=args.arms,
        duration_s=args.duration_s,
        repeat=args.repeat,
        seed=args.seed,
        spec=spec,
        batch_per_engine=args.batch_per_engine,
    )
    return plan, args


def main(argv: list[str] | None = None) -> int:
    """Run the plan, print the tables, write them into the doc."""
    plan, args = parse_args(argv)
    now = datetime.datetime.now()
    out = args.out or REPO / "artifacts" / "fleet" / now.strftime("%Y-%m-%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    raise_open_files()
    started, load = time.monotonic(), os.getloadavg()[0]
    results = run(plan, out)
    minutes = (time.monotonic() - started) / 60
    command = "python -m loadtests.bench.fleet " + " ".join(sys.argv[1:] if argv is None else argv)
    text = (
        f"### Results ({now:%Y-%m-%d}, main at `{_commit()}`)\n\n"
        f"`{command.strip()}`, {minutes:.1f} min; 1-minute load average {load:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after. {settings_line(plan)} {cpu_line(results)}\n\n"
        f"{tables(plan, results)}"
    )
    print(text)
    (out / "results.json").write_text(
        json.dumps(
            {f"{size} {name}": [asdict(r) for r in rows] for (size, name), rows in results.items()},
            indent=1,
        )
    )
    if not args.no_doc:
        doc = args.doc.read_text() if args.doc.exists() else ""
        args.doc.write_text(with_results(doc, text))
        _say(f"results written into {args.doc}; logs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
