"""The first batch burst beside live chat, on real vLLM: direct FCFS against the proxy
on its defaults, the first burst on a fresh engine and proxy beside a second one
(issue #25).

Usage: ``python -m loadtests.compare.first_burst [--repeats N] [--out DIR] [--arms A,B]``.

The workload is :mod:`loadtests.compare.baseline`'s: a chat stream running, eight ~5,300-token
batch prompts submitted at once, three new chats arriving over the next 1.5 s. Each
arm runs on its own fresh vLLM server (:func:`loadtests.compare.arms.run_arm`): its
repetition 0 is the first burst after start (fresh engine, fresh proxy, empty
caches, nothing learned), the later ones are second bursts on the same processes.
Every figure of the proxy is a ratio to FCFS's figure of the same kind (first to
first, second to the median of the seconds), measured in the same run, because the
machines this runs on differ in speed by 5x.

Arms: ``fcfs`` (vLLM's defaults, direct), ``proxy_auto`` (the proxy with no piecing
setting, vLLM's defaults); with ``--arms`` also ``threshold_auto`` and
``threshold_off`` (vLLM with ``--long-prefill-token-threshold 256``, the proxy with
piecing on its default and off): pieces per prompt, and the batch's rate against
piecing off.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests.compare.arms import (
    EXTRA_ARMS,
    RECOMMENDED_FLAGS,
    Arm,
    ArmResult,
    Repetition,
    run_arm,
    seconds,
)
from loadtests.compare.baseline import Workload
from loadtests.engine_io import samples
from loadtests.harness.stalls import StallWatch
from loadtests.support.vllm import REPO

logger = logging.getLogger(__name__)

FCFS = Arm("fcfs", "direct, FCFS (vLLM defaults)", ())
PROXY = next(a for a in EXTRA_ARMS if a.key == "proxy_auto")
THRESHOLD_AUTO = Arm(
    "threshold_auto",
    "through the proxy, defaults, vLLM --long-prefill-token-threshold 256",
    RECOMMENDED_FLAGS,
    via_proxy=True,
)
THRESHOLD_OFF = Arm(
    "threshold_off",
    "through the proxy, piecing off, vLLM --long-prefill-token-threshold 256",
    RECOMMENDED_FLAGS,
    via_proxy=True,
    engine_settings={"piecing": "off"},
)
ARMS = (FCFS, PROXY)
ALL_ARMS = (FCFS, PROXY, THRESHOLD_AUTO, THRESHOLD_OFF)

# The bars, as ratios to FCFS's same figure (at most).
BARS = {"ttft_max": 0.05, "done_max": 0.15, "worst_gap": 0.3, "makespan": 1.15}


@dataclass(frozen=True)
class Burst:
    """One repetition's figures: the new chats' TTFT and done (the largest of the
    three), the running stream's worst gap, the batch's makespan, answers not whole."""

    arm: str
    index: int
    ttft_max: float
    done_max: float
    worst_gap: float
    makespan: float
    errors: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @classmethod
    def of(cls, arm: str, rep: Repetition) -> Burst:
        new = rep.of("new")
        return cls(
            arm,
            rep.index,
            max((r.ttft for r in new if r.ttft is not None), default=float("nan")),
            max((r.done for r in new if r.done is not None), default=float("nan")),
            max((r.worst_gap for r in rep.of("running")), default=float("nan")),
            rep.batch_done_s,
            sum(1 for r in rep.records if not r.valid),
        )


def bursts(result: ArmResult) -> list[Burst]:
    """The first burst and the kept second ones (set-aside repetitions left out)."""
    kept = [r for r in result.repetitions if r.cold or not r.set_aside]
    return [Burst.of(result.arm.key, r) for r in kept]


def ratios(proxy: Sequence[Burst], fcfs: Sequence[Burst]) -> list[dict[str, Any]]:
    """Each of the proxy's bursts as ratios to FCFS's: first to first, each second
    to the median of FCFS's seconds."""
    base_first = next(b for b in fcfs if b.first)
    later = [b for b in fcfs if not b.first]
    out = []
    for b in proxy:
        base = base_first if b.first or not later else _median_burst(later)
        row: dict[str, Any] = {"index": b.index, "first": b.first, "errors": b.errors}
        for key in BARS:
            row[key] = getattr(b, key) / getattr(base, key)
        out.append(row)
    return out


def _median_burst(bs: Sequence[Burst]) -> Burst:
    def med(key: str) -> float:
        return float(statistics.median(float(getattr(b, key)) for b in bs))

    return Burst("median", 1, med("ttft_max"), med("done_max"), med("worst_gap"),
                 med("makespan"), sum(b.errors for b in bs))  # fmt: skip


def misses(rows: Sequence[dict[str, Any]]) -> list[str]:
    """Every bar a burst missed, in words; empty if all were met."""
    out = []
    for row in rows:
        kind = "first burst" if row["first"] else f"burst {row['index'] + 1}"
        out += [
            f"{kind}: {key} {row[key]:.3f}x of FCFS (bar {bar:g}x)"
            for key, bar in BARS.items()
            if not row[key] <= bar
        ]
        if row["errors"]:
            out.append(f"{kind}: {row['errors']} answers not whole")
    return out


def table(results: Sequence[ArmResult]) -> str:
    lines = [
        "| arm | burst | new-chat TTFT max | new-chat done max | stream worst gap "
        "| makespan | answers not whole |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        for b in bursts(result):
            kind = "first (fresh)" if b.first else f"{b.index + 1}"
            lines.append(
                f"| {result.arm.name} | {kind} | {seconds(b.ttft_max)} | {seconds(b.done_max)}"
                f" | {seconds(b.worst_gap)} | {seconds(b.makespan)} | {b.errors} |"
            )
    return "\n".join(lines)


def ratio_table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        "| proxy burst | TTFT max / FCFS | done max / FCFS | worst gap / FCFS | makespan / FCFS |",
        "|---|---|---|---|---|",
    ]
    for row in rows:
        kind = "first (fresh)" if row["first"] else f"{row['index'] + 1}"
        cells = " | ".join(f"{row[k]:.3f}x (bar {bar:g}x)" for k, bar in BARS.items())
        lines.append(f"| {kind} | {cells} |")
    return "\n".join(lines)


def pieces_per_prompt(out: Path, arm: str) -> tuple[float, float]:
    """Pieces sent and prompts sent after pieces, from the arm's last ``/metrics``."""
    found = samples((out / f"proxy-metrics-{arm}.txt").read_text())
    return (
        found.get("whoseturn_prefill_pieces_total", 0.0),
        found.get("whoseturn_prefill_pieced_prompts_total", 0.0),
    )


def run(
    repeats: int, out: Path, arms: Sequence[Arm] = ARMS, extra_tries: int = 2
) -> list[ArmResult]:
    out.mkdir(parents=True, exist_ok=True)
    workload = Workload()
    watch = StallWatch().start()
    prompts: list[Any] = []
    results = []
    try:
        for index, arm in enumerate(arms):
            results.append(run_arm(arm, index, prompts, repeats, workload, watch, out, extra_tries))
    finally:
        watch.stop()
    return results


def report(results: Sequence[ArmResult], out: Path) -> dict[str, Any]:
    """The tables and the verdicts, written to ``first-burst.md`` and ``.json``."""
    by = {r.arm.key: r for r in results}
    text = [table(results)]
    found = {k: [b.__dict__ for b in bursts(r)] for k, r in by.items()}
    summary: dict[str, Any] = {"bursts": found}
    if "fcfs" in by and "proxy_auto" in by:
        rows = ratios(bursts(by["proxy_auto"]), bursts(by["fcfs"]))
        summary["ratios"], summary["misses"] = rows, misses(rows)
        text += ["", ratio_table(rows), "", "missed: " + ("; ".join(summary["misses"]) or "none")]
    if "threshold_auto" in by and "threshold_off" in by:
        pieces, prompts = pieces_per_prompt(out, "threshold_auto")
        sent = sum(len(r.of("batch")) for r in by["threshold_auto"].repetitions)
        rate = {k: _records_per_hour(by[k]) for k in ("threshold_auto", "threshold_off")}
        summary["threshold"] = {
            "pieces": pieces, "pieced_prompts": prompts, "batch_prompts": sent,
            "pieces_per_prompt": pieces / sent if sent else float("nan"),
            "records_per_hour": rate,
            "rate_ratio": rate["threshold_auto"] / rate["threshold_off"],
        }  # fmt: skip
        t = summary["threshold"]
        text.append(
            f"\nthreshold 256: {pieces:.0f} pieces over {sent} batch prompts "
            f"({t['pieces_per_prompt']:.2f} a prompt); batch records per hour "
            f"{rate['threshold_auto']:,.0f} (defaults) against {rate['threshold_off']:,.0f} "
            f"(piecing off): {t['rate_ratio']:.3f}x"
        )
    (out / "first-burst.md").write_text("\n".join(text) + "\n")
    (out / "first-burst.json").write_text(json.dumps(summary, indent=2))
    summary["text"] = "\n".join(text)
    return summary


def _records_per_hour(result: ArmResult) -> float:
    """Valid batch answers per hour of batch makespan, over every kept repetition."""
    reps = [r for r in result.repetitions if r.cold or not r.set_aside]
    valid = sum(1 for r in reps for rec in r.of("batch") if rec.valid)
    hours = sum(r.batch_done_s for r in reps) / 3600
    return valid / hours if hours else float("nan")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.compare.first_burst", description=__doc__
    )
    parser.add_argument("--repeats", type=int, default=2, help="bursts after the first, per arm")
    parser.add_argument("--out", type=Path, default=REPO / "artifacts" / "first-burst")
    parser.add_argument("--arms", default=",".join(a.key for a in ARMS))
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    arms = [a for a in ALL_ARMS if a.key in args.arms.split(",")]
    summary = report(run(args.repeats, args.out, arms), args.out)
    print(summary["text"])
    return 1 if summary.get("misses") else 0


if __name__ == "__main__":
    sys.exit(main())
