"""The tenants benchmark: a quiet client beside a noisy one on the same chat route.

Issue 29's "What was seen", as a command: one simulated engine (``whoseturn sim``)
and the proxy in front of it with no tenant config at all, so the two clients' API
keys are two tenants (``key-`` and the key's SHA-256 prefix). The quiet client sends
a short chat every ``--quiet-every-s`` (0.5 s); the noisy one keeps
``--noisy-streams`` (32) long chat prompts in flight. Both are tenants of one
workload (``tenants:``, :mod:`loadtests.harness.workload_file`) driven by the
harness (:mod:`loadtests.harness.traffic`), which keeps every record's tenant.

Three arms, each on a fresh engine and a fresh proxy (:func:`loadtests.harness.engines.started`):

- ``alone``: the quiet client by itself, the reference;
- ``arrival``: beside the noisy client, the proxy with ``fair_share: false``
  (arrival order within a class);
- ``fair``: beside the noisy client, the proxy on its defaults (fair share on).

Each arm runs the workload twice: ``cold``, the first run after the start, and
``warm``, a repetition (new prompts, so no prefix is cached from the first). Per
arm and run: the quiet client's TTFT p50 and p95 (requests sent after the warm-up,
:mod:`loadtests.harness.tenants`), each as a ratio to the ``alone`` arm's in the same
run of this invocation, and the noisy client's throughput: the tokens streamed to it
per second over the run. The table is printed and written, under a dated heading
with the command and the machine, into ``docs/tenants.md`` (between its result
markers).

Run: ``python -m loadtests.bench.tenants [--duration-s 20] [--quick]``
(``make bench-tenants``).
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import platform
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import httpx

from loadtests.harness.engines import started
from loadtests.harness.tenants import summarize_tenants
from loadtests.harness.traffic import ArmRun, Route, new_run, proxy_route, run_arm
from loadtests.harness.workload_file import Workload, parse_workload
from loadtests.support.markdown import markdown_table

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "tenants.md"
BEGIN = "<!-- tenants-results:begin (written by python -m loadtests.bench.tenants) -->"
END = "<!-- tenants-results:end -->"
ARMS = ("alone", "arrival", "fair")
RUNS = ("cold", "warm")


def proxy_settings(arm: str) -> dict[str, Any]:
    """Arm ``arm``'s proxy settings: arrival order within a class for ``arrival``,
    the defaults (fair share on) otherwise; nothing about tenants in any."""
    return {"fair_share": False} if arm == "arrival" else {}


@dataclass(frozen=True)
class Plan:
    """The two clients, the engine, and each run's length."""

    duration_s: float = 20.0
    warmup_s: float = 2.0
    quiet_every_s: float = 0.5
    quiet_chars: int = 200
    quiet_max_tokens: int = 8
    noisy_streams: int = 32
    noisy_chars: int = 16000
    noisy_max_tokens: int = 32
    profile: str = "h100-llama3-8b"
    time_scale: float = 1.0
    seed: int = 0


QUICK = Plan(duration_s=3.0, warmup_s=0.5, noisy_streams=8, noisy_chars=4000, noisy_max_tokens=8)
"""A plan that checks the bench end to end in well under a minute (the test's)."""


def workload(plan: Plan, arm: str) -> Workload:
    """The arm's workload: the quiet tenant, and beside it the noisy one (not
    ``alone``), on one engine the harness starts with the proxy in front."""
    chat = {"route": "chat", "api": "chat"}
    quiet = {
        "name": "quiet",
        "key": "quiet-key",
        "classes": {
            "chat": chat
            | {
                "arrival": {"process": "periodic", "rate": 1.0 / plan.quiet_every_s},
                "prompt": {"source": "python-docs", "chars": plan.quiet_chars},
                "max_tokens": plan.quiet_max_tokens,
            }
        },
    }
    noisy = {
        "name": "noisy",
        "key": "noisy-key",
        "classes": {
            "chat": chat
            | {
                "arrival": {"process": "closed", "concurrency": plan.noisy_streams},
                "prompt": {"source": "python-docs", "chars": plan.noisy_chars},
                "max_tokens": plan.noisy_max_tokens,
            }
        },
    }
    command = (
        f"whoseturn sim --profile {plan.profile} --served-model-name tiny "
        f"--time-scale {plan.time_scale:g} --port {{port}}"
    )
    return parse_workload(
        {
            "name": f"tenants-{arm}",
            "model": "tiny",
            "seed": plan.seed,
            "plan": {"duration_s": plan.duration_s, "warmup_s": plan.warmup_s},
            "tenants": [quiet] if arm == "alone" else [quiet, noisy],
            "engines": {"command": command, "ready_timeout_s": 90},
            "proxy": {"settings": proxy_settings(arm)},
            "arms": [{"name": arm, "via": "proxy"}],
        },
        base=REPO,
    )


@dataclass(frozen=True)
class Figures:
    """One arm's run: the quiet client's requests (sent after the warm-up), those
    that failed, its TTFT (seconds), and the noisy client's tokens per second
    (None in the ``alone`` arm)."""

    quiet_requests: int
    quiet_failed: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    noisy_tokens_per_s: float | None


def figures(work: Workload, run: ArmRun) -> Figures:
    """The figures of one run of ``work``."""
    rows = {t.tenant: t for t in summarize_tenants(work, [run])}
    quiet = rows["quiet"]
    start, end = run.window(work)
    failed = sum(
        1
        for r in run.records["quiet/chat"]
        if start <= r.sent_at <= end and (r.status != 200 or r.error is not None)
    )
    noisy = None
    if "noisy/chat" in run.records:
        over = run.started_at, run.started_at + work.plan.duration_s
        streamed = sum(
            1 for r in run.records["noisy/chat"] for t in r.token_times if over[0] <= t <= over[1]
        )
        noisy = streamed / work.plan.duration_s
    return Figures(
        quiet.requests, failed, _seconds(quiet.ttft_p50), _seconds(quiet.ttft_p95), noisy
    )


def _seconds(value: float) -> float | None:
    return None if math.isnan(value) else value


@dataclass(frozen=True)
class ArmResult:
    """An arm's runs, by name (:data:`RUNS`), and the tenants the proxy's decisions
    name (``/turn/log``, its last decisions: tenant: decisions), so a run shows the
    two keys were told apart with no config."""

    arm: str
    runs: dict[str, Figures]
    tenants_seen: dict[str, int]


def run_arm_fresh(plan: Plan, arm: str, out: Path) -> ArmResult:
    """Arm ``arm`` on a fresh engine and proxy: its cold run, then its warm one."""
    work = workload(plan, arm)
    results: dict[str, Figures] = {}
    began = time.monotonic()
    with started(out, work.arms[0], work) as servers:
        assert servers.proxy is not None
        _say(f"{arm}: engine and proxy ready in {time.monotonic() - began:.1f} s")
        route = proxy_route(servers.proxy.url)
        for number, name in enumerate(RUNS):
            run = asyncio.run(_drive(work, route, number))
            results[name] = figures(work, run)
            _say(f"{arm}, {name}: {_line(results[name])}")
        seen = tenants_seen(servers.proxy.url)
    return ArmResult(arm, results, seen)


def tenants_seen(proxy: str) -> dict[str, int]:
    """How many of the proxy's last decisions (``GET /turn/log``) name each tenant."""
    log = httpx.get(f"{proxy}/turn/log", params={"limit": 1000}, timeout=10).json()
    return dict(Counter(str(d.get("tenant", "")) for d in log.get("decisions", [])))


async def _drive(work: Workload, route: Route, number: int) -> ArmRun:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=300, limits=limits) as http:
        return await run_arm(work, route, http, new_run(work, number=number))


def _line(f: Figures) -> str:
    noisy = "" if f.noisy_tokens_per_s is None else f", noisy {f.noisy_tokens_per_s:,.0f} tok/s"
    failed = f", {f.quiet_failed} failed" if f.quiet_failed else ""
    return (
        f"quiet TTFT p50 {_ms(f.ttft_p50_s)} / p95 {_ms(f.ttft_p95_s)} "
        f"({f.quiet_requests} requests{failed}){noisy}"
    )


def ratios(results: list[ArmResult]) -> dict[str, dict[str, dict[str, float | None]]]:
    """Each arm's quiet TTFT p50 and p95 over the ``alone`` arm's in the same run
    (arm: run: ``{"p50": x, "p95": y}``); None where either is missing."""
    alone = next(r for r in results if r.arm == "alone")
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    for result in results:
        out[result.arm] = {}
        for name, f in result.runs.items():
            base = alone.runs[name]
            out[result.arm][name] = {
                "p50": _over(f.ttft_p50_s, base.ttft_p50_s),
                "p95": _over(f.ttft_p95_s, base.ttft_p95_s),
            }
    return out


def _over(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def table(results: list[ArmResult]) -> str:
    """A row per arm; per run (cold, warm): quiet TTFT p50 / p95, the same over the
    ``alone`` arm's, and the noisy client's tokens per second."""
    by = ratios(results)
    header = ["arm"]
    for name in RUNS:
        header += [
            f"{name}: quiet TTFT p50 / p95",
            f"{name}: x alone",
            f"{name}: noisy tok/s",
        ]
    rows = []
    for r in results:
        cells = [r.arm]
        for name in RUNS:
            f, x = r.runs[name], by[r.arm][name]
            cells += [
                f"{_ms(f.ttft_p50_s)} / {_ms(f.ttft_p95_s)}",
                f"{_times(x['p50'])} / {_times(x['p95'])}",
                "-" if f.noisy_tokens_per_s is None else f"{f.noisy_tokens_per_s:,.0f}",
            ]
        rows.append(cells)
    return markdown_table(header, rows)


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.0f} ms"


def _times(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def settings_line(plan: Plan) -> str:
    """How the engine and the clients were set, for the record."""
    return (
        f"Engine: `whoseturn sim --profile {plan.profile} --time-scale {plan.time_scale:g}`, "
        f"the proxy with no tenant config. Quiet: a {plan.quiet_chars}-character chat every "
        f"{plan.quiet_every_s:g} s, answers of {plan.quiet_max_tokens} tokens; noisy: "
        f"{plan.noisy_streams} chats of {plan.noisy_chars:,} characters in flight, "
        f"answers of {plan.noisy_max_tokens} tokens; runs of {plan.duration_s:g} s, TTFT of "
        f"the requests sent after {plan.warmup_s:g} s."
    )


def with_results(doc: str, results: str) -> str:
    """``doc`` with its results section (between :data:`BEGIN` and :data:`END`)
    replaced by ``results``; the section is added at the end if there is none."""
    section = f"{BEGIN}\n{results.strip()}\n{END}"
    start, end = doc.find(BEGIN), doc.find(END)
    if start < 0 or end < start:
        return doc.rstrip("\n") + "\n\n" + section + "\n"
    return doc[:start] + section + doc[end + len(END) :]


def _commit() -> str:
    """The checkout measured: ``main at `abc1234```, and whether tracked files had
    changes not yet committed (the proxy that ran is the working tree's)."""
    try:
        head, changed = (
            subprocess.run(
                ["git", "-C", str(REPO), *args], capture_output=True, text=True, check=True
            ).stdout.strip()
            for args in (
                ["rev-parse", "--short", "HEAD"],
                ["status", "--porcelain", "--untracked-files=no"],
            )
        )
    except (OSError, subprocess.CalledProcessError):
        return "checkout unknown"
    return f"main at `{head}`" + (" with uncommitted changes" if changed else "")


def _say(text: str) -> None:
    print(f"  {text}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None) -> tuple[Plan, argparse.Namespace]:
    """The command line as a plan (and the output options)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    d = Plan()
    parser.add_argument("--quick", action="store_true", help="a short check of the bench")
    parser.add_argument("--duration-s", type=float, default=None, help=f"default {d.duration_s:g}")
    parser.add_argument("--warmup-s", type=float, default=None, help=f"default {d.warmup_s:g}")
    parser.add_argument("--noisy-streams", type=int, default=None)
    parser.add_argument("--noisy-chars", type=int, default=None)
    parser.add_argument("--profile", default=None, help=f"default {d.profile}")
    parser.add_argument("--time-scale", type=float, default=None)
    parser.add_argument("--out", type=Path, default=None, help="default artifacts/tenants/<time>")
    parser.add_argument("--doc", type=Path, default=DOC, help="where the table is written")
    parser.add_argument("--no-doc", action="store_true", help="print only")
    args = parser.parse_args(argv)
    plan = QUICK if args.quick else d
    given = {
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "noisy_streams": args.noisy_streams,
        "noisy_chars": args.noisy_chars,
        "profile": args.profile,
        "time_scale": args.time_scale,
    }
    plan = replace(plan, **{k: v for k, v in given.items() if v is not None})
    return plan, args


def main(argv: list[str] | None = None) -> int:
    """Run the three arms, print the table, write it into the doc and
    ``OUT/results.json``."""
    plan, args = parse_args(argv)
    if "WHOSETURN_FAIR_SHARE" in os.environ:
        print(
            "tenants: unset WHOSETURN_FAIR_SHARE: the bench sets fair_share per arm",
            file=sys.stderr,
        )
        return 2
    now = datetime.datetime.now()
    out = args.out or REPO / "artifacts" / "tenants" / now.strftime("%Y-%m-%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    began, load = time.monotonic(), os.getloadavg()[0]
    try:
        results = [run_arm_fresh(plan, arm, out) for arm in ARMS]
    except RuntimeError as exc:  # a server that did not start: no table to compare
        print(f"tenants: {exc}", file=sys.stderr)
        return 1
    minutes = (time.monotonic() - began) / 60
    command = "python -m loadtests.bench.tenants " + " ".join(
        sys.argv[1:] if argv is None else argv
    )
    text = (
        f"### Results ({now:%Y-%m-%d}, {_commit()})\n\n"
        f"`{command.strip()}`, {minutes:.1f} min on {os.cpu_count()} cores, Python "
        f"{platform.python_version()}; 1-minute load average {load:.2f} before, "
        f"{os.getloadavg()[0]:.2f} after. {settings_line(plan)}\n\n{table(results)}"
    )
    print(text)
    (out / "results.json").write_text(
        json.dumps(
            {
                "plan": asdict(plan),
                "arms": {r.arm: {n: asdict(f) for n, f in r.runs.items()} for r in results},
                "ratios_to_alone": ratios(results),
                "tenants_seen": {r.arm: r.tenants_seen for r in results},
                "tenants": {t.name: t.proxy_name for t in workload(plan, "fair").tenants},
            },
            indent=1,
        )
        + "\n"
    )
    if not args.no_doc:
        doc = args.doc.read_text() if args.doc.exists() else ""
        args.doc.write_text(with_results(doc, text))
        _say(f"results written into {args.doc}; logs in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
