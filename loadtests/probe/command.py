"""``whoseturn probe``: its flags, and the run that prints the report."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys

from loadtests.probe.runner import ProbeConfig, ProbeError, run_probe
from loadtests.probe.verdict_text import render_text, to_json


def add_probe_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add the ``probe`` subcommand to the ``whoseturn`` parser's subparsers."""
    probe = commands.add_parser(
        "probe",
        help="tell from outside whether an engine interleaves prefill with decode",
        description=(
            "Hold a steady decode stream on the engine, inject prompts of growing size "
            "beside it and time the stream's worst stall around each: a serializing "
            "engine's stall grows with the prompt, an interleaving one's levels off at "
            "its per-step chunk."
        ),
    )
    # each flag's dest is the ProbeConfig field it sets (run_probe_command)
    probe.add_argument(
        "--engine", dest="engine_url", required=True, metavar="URL", help="the engine's base URL"
    )
    probe.add_argument("--model", default=None, help="model name (default: the engine's first)")
    probe.add_argument(
        "--sizes",
        type=_sizes,
        default=(),
        metavar="N,N,...",
        help="prompt sizes in tokens (default: 128, 256, ... up to max_model_len)",
    )
    probe.add_argument("--repeats", type=int, default=3, help="measurements per size")
    probe.add_argument(
        "--extra-repeats",
        type=int,
        default=3,
        help="rounds of one more measurement of each size whose repeats disagree",
    )
    probe.add_argument(
        "--timeout",
        dest="timeout_s",
        type=float,
        default=300.0,
        metavar="TIMEOUT",
        help="seconds per request",
    )
    probe.add_argument("--api-key", default=None)
    probe.add_argument("--json", action="store_true", help="print the report as JSON")


def run_probe_command(args: argparse.Namespace) -> int:
    """Probe, print the report; 0 with any verdict, 1 if the engine could not be measured."""
    given = {f.name for f in dataclasses.fields(ProbeConfig)} & set(vars(args))
    config = ProbeConfig(**{name: getattr(args, name) for name in given})
    try:
        result = asyncio.run(run_probe(config))
    except ProbeError as exc:
        print(f"whoseturn probe: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(to_json(result), indent=2) if args.json else render_text(result).rstrip())
    return 0


def _sizes(text: str) -> tuple[int, ...]:
    try:
        sizes = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not a list of token counts: {text!r}") from exc
    if not sizes or any(s < 1 for s in sizes):
        raise argparse.ArgumentTypeError(f"token counts must be positive: {text!r}")
    return sizes
