"""``whoseturn demo``: the workload ``loadtests/workloads/demo.yaml`` run directly
against two simulated engines and through the proxy in front of them; the
side-by-side table and a result directory (:mod:`loadtests.harness.runs`).

Each arm starts its own processes (:mod:`loadtests.demo.setup`) and stops them after.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime as dt
import sys
from pathlib import Path
from typing import Any

import httpx

from loadtests.demo.setup import ENGINE_FLAGS, PROXY_SETTINGS, servers
from loadtests.harness.preflight import Unreachable, failure_line
from loadtests.harness.runs import ArmResult, ArmTarget, finish, run_plan
from loadtests.harness.traffic import direct_route, proxy_route
from loadtests.harness.workload_file import Workload, load_workload
from loadtests.support.processes import NotReady

DEFAULT_OUT = Path("artifacts/demo")
WORKLOAD = Path(__file__).parent.parent / "workloads" / "demo.yaml"
TIME_SCALE = 1.0

REASONING = (
    "Chat beside a saturating batch job on two simulated vLLM engines (cpu-tiny "
    "profile, chunked prefill, long-prefill threshold 256). Direct, each engine's "
    "FCFS queue holds batch prefills ahead of chat; through the proxy, batch waits in "
    "the proxy and is admitted within a prefill budget, so chat TTFT should fall while "
    "the engines stay busy with batch prefill, keeping batch valid records per hour."
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``whoseturn demo``'s flags."""
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="results go to OUT/<date-time>/"
    )
    parser.add_argument(
        "--duration", type=float, default=None, help="seconds per arm (default: the workload's)"
    )
    parser.add_argument(
        "--warmup", type=float, default=None, help="seconds not counted (default: the workload's)"
    )
    parser.add_argument(
        "--time-scale", type=float, default=TIME_SCALE, help="the engines' --time-scale"
    )


def demo_workload(duration_s: float | None, warmup_s: float | None) -> Workload:
    """The demo's workload file, with its run's length and warm-up replaced if given."""
    workload = load_workload(WORKLOAD)
    plan = workload.plan
    plan = dataclasses.replace(
        plan,
        duration_s=plan.duration_s if duration_s is None else duration_s,
        warmup_s=plan.warmup_s if warmup_s is None else warmup_s,
    )
    return dataclasses.replace(workload, plan=plan)


def run_demo(args: argparse.Namespace) -> int:
    """Run both arms, write the result directory, print the table; exit status 0, or 1
    with one line (no traceback) for a server that did not start or stopped answering."""
    workload = demo_workload(args.duration, args.warmup)
    out = args.out / dt.datetime.now().strftime("%Y-%m-%d-%H%M%S")
    out.mkdir(parents=True)
    try:
        return _run_arms(args, workload, out)
    except (Unreachable, NotReady, httpx.TransportError) as exc:
        print(f"whoseturn: error: {failure_line(exc)} (the run's files: {out})", file=sys.stderr)
        return 1


def _run_arms(args: argparse.Namespace, workload: Workload, out: Path) -> int:
    from rich.console import Console  # the bench's commands parse without rich

    console = Console()
    arms: dict[str, ArmResult] = {}
    commands: dict[str, list[list[str]]] = {}
    for arm in ("direct", "proxy"):
        via_proxy = arm == "proxy"
        console.print(f"{arm}: two simulated engines" + (" and the proxy" if via_proxy else ""))
        with servers(out, arm, engines=2, time_scale=args.time_scale, via_proxy=via_proxy) as s:
            route = proxy_route(s.proxy) if s.proxy else direct_route(list(s.engines.values()))
            target = ArmTarget(arm, route, s.proxy, s.watched())
            arms[arm] = asyncio.run(run_plan(workload, target, out=out, console=console))
            commands[arm] = s.commands
    finish(
        out,
        workload,
        arms,
        setup=_setup(args.time_scale, commands),
        reasoning=REASONING,
        intro=_intro(workload, args.time_scale),
    )
    return 0


def _setup(time_scale: float, commands: dict[str, list[list[str]]]) -> dict[str, Any]:
    return {
        "engine": "whoseturn sim (simulated vLLM V1 scheduler), two per arm, fresh per arm",
        "engine_flags": list(ENGINE_FLAGS),
        "profile": "cpu-tiny",
        "model": "tiny",
        "tokenizer": "loadtests.sim.tokenizer.SimTokenizer (word-level, CRC-32 ids)",
        "time_scale": time_scale,
        "proxy_settings": PROXY_SETTINGS,
        "launch_commands": commands,
        "workload_file": str(WORKLOAD.name),
    }


def _intro(workload: Workload, time_scale: float) -> str:
    chat, batch = workload.classes
    return (
        f"Two simulated engines (`cpu-tiny`, `--long-prefill-token-threshold 256`, time "
        f"scale {time_scale:g}), fresh for each arm; {workload.plan.duration_s:g} s per "
        f"arm. Chat: Poisson at {chat.arrival.rate:g}/s, {chat.max_tokens}-token answers. "
        f"Batch: a closed loop keeping {batch.arrival.concurrency} documents of "
        f"{batch.prompt_chars:,} characters submitted, {batch.max_tokens}-token answers. "
        "Greedy sampling. Direct: round robin over the engines' `/v1`; through the proxy: "
        "chat on `/v1`, batch on `/batch/v1`, the proxy on its defaults (it sees that the "
        "engines interleave by themselves and sends batch prompts whole)."
    )
