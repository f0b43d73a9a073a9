"""``whoseturn loadtest WORKLOAD.yaml [--target URL] [--direct URL ...]``: a workload
file's plan against a running proxy and, if given, directly against its engines (the
same workload, one variable changed); the side-by-side table and a result directory
(:mod:`loadtests.harness.runs`). When the workload file names its engines (``engines:``), the
harness starts them itself, fresh for each arm of its ``arms`` (and the proxy in
front of them for the proxy arm), and stops them after (:mod:`loadtests.harness.engines`).

The target is a whoseturn proxy: a ``chat`` route goes to its ``/v1``, a ``batch``
route to its ``/batch/v1``, and its ``GET /turn`` is sampled for the timeline. Direct
URLs are engines (vLLM or ``whoseturn sim``), taken in turn for every class. The
direct arm runs first. With ``--target``, nothing is started or stopped: the servers
are the caller's, so the launch commands in ``result.json`` are what the caller says
with ``--setup-note``, and each is checked first, in about a second
(:mod:`loadtests.harness.preflight`): one that is not there ends the command at once
with a line that names it. Either way the servers on this machine are watched during
the run (:mod:`loadtests.harness.watch`), and a server that stops answering ends it
with one line too, not a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from loadtests.harness.engines import started
from loadtests.harness.preflight import Server, Unreachable, check, engine_names, failure_line
from loadtests.harness.runs import ArmResult, ArmTarget, finish, run_plan
from loadtests.harness.traffic import direct_route, proxy_route
from loadtests.harness.workload_file import Workload, WorkloadError, load_workload, narrowed
from loadtests.support.processes import NotReady

if TYPE_CHECKING:
    from rich.console import Console

DEFAULT_OUT = Path("artifacts/loadtest")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``whoseturn loadtest``'s arguments."""
    parser.add_argument("workload", type=Path, metavar="WORKLOAD.yaml", help="workload file")
    parser.add_argument(
        "--target",
        metavar="URL",
        help="the proxy's base URL (not with a workload that names its engines)",
    )
    parser.add_argument(
        "--direct",
        action="append",
        default=[],
        metavar="URL",
        help="an engine's base URL for the direct arm (repeat for several); named as the "
        "proxy names the engine at that URL, else engine-N",
    )
    parser.add_argument(
        "--out", type=Path, default=DEFAULT_OUT, help="results go to OUT/<name>-<date-time>/"
    )
    parser.add_argument(
        "--arms",
        metavar="A,B",
        help="run only these of the file's arms (bars that judge another arm are left out)",
    )
    parser.add_argument(
        "--warm-runs", type=int, metavar="N", help="warm runs per arm (default: the file's)"
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="check the workload file and print what would run (arms, commands, bars)",
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
    """Run the workload's plan on each arm and write the result; 0, 2 for a bad
    workload file (the message names the key), 1 for a server that is not there
    (checked first, :mod:`loadtests.harness.preflight`) or that stops answering: one
    line that names it, no traceback."""
    try:
        workload = load_workload(args.workload)
        only = args.arms.split(",") if args.arms else None
        workload, left_out = narrowed(workload, only, args.warm_runs)
    except WorkloadError as exc:
        print(f"whoseturn: error: {exc}", file=sys.stderr)
        return 2
    for bar in left_out:
        of = bar.arm or " / ".join(bar.ratio)
        print(f"whoseturn: bar {bar.figure} ({of}) left out: its arm is not run", file=sys.stderr)
    if args.dry_run:
        print(dry_run(workload))
        return 0
    if workload.engines is not None and (args.target or args.direct):
        print(
            f"whoseturn: error: {args.workload} names its engines (engines:): the harness "
            "starts them; give no --target or --direct",
            file=sys.stderr,
        )
        return 2
    if workload.engines is None and not args.target:
        print(
            f"whoseturn: error: {args.workload} names no engines: --target URL is needed",
            file=sys.stderr,
        )
        return 2
    if workload.engines is None:
        try:
            check(_given(args), workload.model)
        except Unreachable as exc:
            print(f"whoseturn: error: {exc}", file=sys.stderr)
            return 1
    out = args.out / f"{workload.name}-{dt.datetime.now().strftime('%Y-%m-%d-%H%M%S')}"
    out.mkdir(parents=True)
    from rich.console import Console  # the bench's commands parse without rich

    console = Console()
    try:
        if workload.engines is not None:
            return _run_started(args, workload, out, console)
        return _run_given(args, workload, out, console)
    except (Unreachable, NotReady, httpx.TransportError) as exc:
        print(f"whoseturn: error: {failure_line(exc)} (the run's files: {out})", file=sys.stderr)
        return 1


def _given(args: argparse.Namespace) -> list[Server]:
    """The servers the caller gave, to check before the run (:mod:`.preflight`)."""
    return [
        Server(args.target.rstrip("/"), "--target"),
        *(Server(url.rstrip("/"), "--direct") for url in args.direct),
    ]


def _run_given(args: argparse.Namespace, workload: Workload, out: Path, console: Console) -> int:
    """The workload against the caller's proxy and, with ``--direct``, its engines."""
    target = args.target.rstrip("/")
    engines = [url.rstrip("/") for url in args.direct]
    named = direct_names(engines, engine_names(target) if engines else {})
    proxy = ArmTarget("proxy", proxy_route(target), target, {"proxy": target, **named})
    direct = ArmTarget("direct", direct_route(engines), servers=named)
    targets = [direct, proxy] if engines else [proxy]  # the direct arm runs first
    arms = {t.name: asyncio.run(run_plan(workload, t, out=out, console=console)) for t in targets}
    setup = {"target": target, "direct": args.direct, "launch": args.setup_note or None}
    intro = f"Workload `{args.workload}` against the proxy at {target}" + (
        f" and directly against {', '.join(args.direct)}." if args.direct else "."
    )
    reasoning = args.reasoning or "not given (--reasoning)"
    finish(out, workload, arms, setup=setup, reasoning=reasoning, intro=intro)
    return 0


def direct_names(urls: list[str], known: dict[str, str]) -> dict[str, str]:
    """The ``--direct`` engines by name: the proxy's name for an engine it serves at the
    same URL (``known``: URL to name, :func:`loadtests.harness.preflight.engine_names`),
    so the report's tables name it as the proxy's timeline plot does; ``engine-N``
    otherwise, and for all of them if that would give two the same name."""
    names = [known.get(url, f"engine-{n}") for n, url in enumerate(urls)]
    if len(set(names)) < len(names):
        names = [f"engine-{n}" for n in range(len(urls))]
    return dict(zip(names, urls, strict=True))


def _run_started(args: argparse.Namespace, workload: Workload, out: Path, console: Console) -> int:
    """Each arm of the workload on engines the harness starts (and its proxy)."""
    arms: dict[str, ArmResult] = {}
    assert workload.engines is not None
    for spec in workload.arms:
        console.print(f"{spec.name}: starting {workload.engines.count} engine(s)")
        with started(out, spec, workload) as s:
            engines = [e.url for e in s.engines]
            proxy = s.proxy.url if s.proxy else None
            route = proxy_route(proxy) if proxy else direct_route(engines)
            watched = {srv.name: srv.url for srv in s.servers()}
            arm = ArmTarget(spec.name, route, proxy, watched, spec.priority)
            result = asyncio.run(run_plan(workload, arm, out=out, console=console))
            result.started = [srv.to_json() for srv in s.servers()]
            arms[spec.name] = result
    setup = {
        "engines": workload.engines.command,
        "engine_count": workload.engines.count,
        "proxy_settings": workload.proxy_settings,
        "launch": "started by the harness (setup.started has every command)",
    }
    intro = (
        f"Workload `{args.workload}` on {workload.engines.count} engine(s) the harness "
        f"started fresh for each arm ({', '.join(a.name for a in workload.arms)}): "
        f"`{workload.engines.command}`."
    )
    finish(
        out,
        workload,
        arms,
        setup=setup,
        reasoning=args.reasoning or "not given (--reasoning)",
        intro=intro,
    )
    return 0


def dry_run(workload: Workload) -> str:
    """What a run of ``workload`` would do: its classes, its arms with the commands
    that would start their servers, its bars. Nothing is started."""
    from loadtests.harness.engines import engine_argv

    plan = workload.plan
    lines = [
        f"workload {workload.name}: {'a cold run, then ' if plan.cold else ''}"
        f"{plan.warm_runs} warm run(s) of {plan.duration_s:g} s per arm",
        *(
            f"  class {c.name}: route {c.route}, {c.arrival.process} arrivals, "
            f"prompts from {c.prompt_source}, {c.max_tokens} tokens"
            for c in workload.classes
        ),
        *(
            f"  tenant {t.name}: its key sent as a bearer token (a proxy without config "
            f"names it {t.proxy_name})"
            for t in workload.tenants
        ),
    ]
    for arm in workload.arms:
        lines.append(f"arm {arm.name} (via {arm.via})")
        if workload.engines is not None:
            argv = engine_argv(workload.engines.command, 0, arm.engine_args)
            lines.append(
                f"  engines x{workload.engines.count}: {' '.join(argv)}  (port chosen then)"
            )
        if arm.priority:
            lines.append(f"  request priorities: {arm.priority}")
        if arm.proxy_engine:
            lines.append(f"  the proxy's engine settings: {arm.proxy_engine}")
    lines += [
        f"bar: {b.figure or 'all valid'} {(b.arm or b.ratio) if b.figure else ''}".rstrip()
        for b in workload.bars
    ]
    return "\n".join(lines)
