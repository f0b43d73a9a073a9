"""``whoseturn loadtest WORKLOAD.yaml --target URL [--direct URL ...]``: a workload
file's plan against a running proxy and, if given, directly against its engines (the
same workload, one variable changed); the side-by-side table and a result directory
(:mod:`loadtests.runs`).

The target is a whoseturn proxy: a ``chat`` route goes to its ``/v1``, a ``batch``
route to its ``/batch/v1``, and its ``GET /turn`` is sampled for the timeline. Direct
URLs are engines (vLLM or ``whoseturn sim``), taken in turn for every class. The
direct arm runs first. Nothing is started or stopped here: the servers are the
caller's, so the launch commands in ``result.json`` are what the caller says with
``--setup-note``.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
from pathlib import Path

from loadtests.harness import direct_route, proxy_route
from loadtests.runs import ArmResult, finish, run_plan
from loadtests.workload_file import WorkloadError, load_workload

DEFAULT_OUT = Path("artifacts/loadtest")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``whoseturn loadtest``'s arguments."""
    parser.add_argument("workload", type=Path, metavar="WORKLOAD.yaml", help="workload file")
    parser.add_argument("--target", required=True, metavar="URL", help="the proxy's base URL")
    parser.add_argument(
        "--direct",
        action="append",
        default=[],
        metavar="URL",
        help="an engine's base URL for the direct arm (repeat for several)",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="results go to OUT/<name>-<date-time>/"
    )
    parser.add_argument(
        "--setup-note",
        default="",
        metavar="TEXT",
        help="how the servers were launched, kept in result.json",
    )
    parser.add_argument(
        "--reasoning",
        default="",
        metavar="TEXT",
        help="why this run, what it should show; kept in result.json",
    )


def run_loadtest(args: argparse.Namespace) -> int:
    """Run the workload's plan on each arm and write the result; 0, or 2 for a bad
    workload file (the message names the key)."""
    try:
        workload = load_workload(args.workload)
    except WorkloadError as exc:
        print(f"whoseturn: error: {exc}", file=sys.stderr)
        return 2
    out = args.out / f"{workload.name}-{dt.datetime.now().strftime('%Y-%m-%d-%H%M%S')}"
    out.mkdir(parents=True)
    from rich.console import Console  # the bench's commands parse without rich

    console = Console()
    target = args.target.rstrip("/")
    arms: dict[str, ArmResult] = {}
    if args.direct:
        engines = [url.rstrip("/") for url in args.direct]
        arms["direct"] = asyncio.run(
            run_plan(
                workload, direct_route(engines), arm="direct", proxy=None, out=out, console=console
            )
        )
    arms["proxy"] = asyncio.run(
        run_plan(workload, proxy_route(target), arm="proxy", proxy=target, out=out, console=console)
    )
    setup = {"target": target, "direct": args.direct, "launch": args.setup_note or None}
    intro = f"Workload `{args.workload}` against the proxy at {target}" + (
        f" and directly against {', '.join(args.direct)}." if args.direct else "."
    )
    reasoning = args.reasoning or "not given (--reasoning)"
    finish(out, workload, arms, setup=setup, reasoning=reasoning, intro=intro)
    return 0
