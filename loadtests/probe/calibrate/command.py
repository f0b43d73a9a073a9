"""``whoseturn sim calibrate``: measure an engine, fit a profile, print and write it."""

from __future__ import annotations

import argparse
import asyncio
import sys
from datetime import UTC, datetime
from pathlib import Path

import httpx

from loadtests.engine_io import EngineIOError
from loadtests.probe.calibrate.cost_fit import fit
from loadtests.probe.calibrate.measure import Measured, Plan, measure_engine
from loadtests.probe.calibrate.profile_report import profile_file, report
from loadtests.probe.calibrate.token_times import WindowError

DEFAULT_BUDGET = 2048
"""vLLM's default ``--max-num-batched-tokens`` for the OpenAI server on CPU."""


DESCRIPTION = """Probe an OpenAI-compatible engine (vLLM, or `whoseturn sim`) over HTTP, one
thing at a time: prefills alone of several sizes, decode at several batch sizes and
contexts, and prefills beside a decode stream. Fit the simulator's step-cost
coefficients to the medians by least squares, print the fit and its residuals, and
write the profile. Times are wall-clock at this client: against `whoseturn sim
--time-scale X` the fitted coefficients are the sim profile's divided by X (with
--clock engine they are the engine's own, model time for the simulator)."""


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.description = DESCRIPTION
    p.add_argument("--engine", required=True, metavar="URL", help="the engine's base URL")
    p.add_argument("--out", default=None, help="write the profile here (.yaml); else print it")
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help=f"the engine's step token budget, as it was started (default {DEFAULT_BUDGET});"
        " a small one (e.g. 512) lets the fit tell the fixed step cost from request overhead",
    )
    p.add_argument("--name", default="calibrated", help="the profile's name")
    p.add_argument("--model", default=None, help="model to ask for (default: the first served)")
    p.add_argument("--repeats", type=int, default=3, help="runs of each measurement (median)")
    p.add_argument(
        "--clock",
        choices=["client", "engine"],
        default="client",
        help="client: time tokens as they arrive here (default); engine: read the"
        " engine's own prefill-time and inter-token histograms from its /metrics (vLLM"
        " takes them from engine-core timestamps, so a busy API server does not blur"
        " them; whoseturn sim keeps them in model time)",
    )
    p.add_argument(
        "--max-prompt-tokens",
        type=int,
        default=4096,
        help="largest prompt of the prefill measurements",
    )


def plan_from(args: argparse.Namespace) -> Plan:
    default = Plan(budget=DEFAULT_BUDGET)
    largest = args.max_prompt_tokens
    sizes = (*tuple(s for s in default.prefill_sizes if s < largest), largest)
    return Plan(
        budget=args.max_num_batched_tokens or DEFAULT_BUDGET,
        prefill_sizes=sizes,
        repeats=args.repeats,
        engine_clock=args.clock == "engine",
    )


def run(args: argparse.Namespace) -> int:
    """The command's body; returns the exit status."""
    out = Path(args.out) if args.out else None
    if out is not None and out.suffix not in {".yaml", ".yml"}:
        raise ValueError(f"--out {out}: a profile file must end in .yaml or .yml")
    plan = plan_from(args)
    try:
        measured = asyncio.run(_measure(args.engine, plan, args.model))
    except (httpx.HTTPError, EngineIOError, WindowError) as exc:
        print(f"whoseturn: calibration against {args.engine} failed: {exc}", file=sys.stderr)
        return 1
    result = fit(measured.measurements)
    clock = "the engine's own clock" if plan.engine_clock else "wall time at this client"
    print(f"Calibration of {measured.info.model} at {measured.info.url}, {clock}:\n")
    print(report(result))
    text = profile_file(
        result,
        measured.info,
        measured.plan,
        name=args.name,
        now=datetime.now(UTC),
        seconds=measured.seconds,
    )
    if out is None:
        print("\n" + text, end="")
    else:
        out.write_text(text)
        print(f"\nprofile written to {out}")
    return 0


async def _measure(url: str, plan: Plan, model: str | None) -> Measured:
    timeout = httpx.Timeout(30.0, read=600.0)
    async with httpx.AsyncClient(base_url=url, timeout=timeout) as client:
        return await measure_engine(
            client, plan, model=model, progress=lambda m: print(m, file=sys.stderr)
        )
