"""The harness against a peer's client: the same workload, the same engine, measured
by the harness and by GuideLLM (``.venv-guidellm``, not a dependency of this
project); their TTFT p50 and p95 set side by side (docs/crosscheck.md).

- ``python -m loadtests.compare.crosscheck_guidellm prompts WORKLOAD.yaml CLASS N OUT.jsonl``: the
  first ``N`` prompts of a class, as the harness would send them, in the JSONL form
  GuideLLM reads (``prompt``, ``output_tokens_count``);
- ``python -m loadtests.compare.crosscheck_guidellm compare RESULT_DIR GUIDELLM.json CLASS``: the
  harness's figures for ``CLASS`` (its ``result.json``) against GuideLLM's JSON
  report, both its own percentiles and nearest-rank ones over its per-request values
  (the harness's rule), with the difference in percent; exit status 1 when one
  differs by more than ``--tolerance`` (10%).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from loadtests.harness.measures import pct
from loadtests.harness.traffic import body
from loadtests.harness.workload_file import load_workload
from loadtests.support.markdown import markdown_table


def prompts(workload_path: Path, cls_name: str, n: int, out: Path) -> int:
    """Write the first ``n`` prompts of class ``cls_name``; how many were written."""
    workload = load_workload(workload_path)
    (cls,) = [c for c in workload.classes if c.name == cls_name]
    with out.open("w") as f:
        for i in range(n):
            b = body(workload, cls, i)
            text = b["prompt"] if "prompt" in b else b["messages"][-1]["content"]
            f.write(json.dumps({"prompt": text, "output_tokens_count": cls.max_tokens}) + "\n")
    return n


def guidellm_ttft(report: dict[str, Any]) -> dict[str, float]:
    """From a GuideLLM JSON report's first benchmark: its own TTFT median and p95,
    and nearest-rank p50 and p95 of its successful requests' TTFTs (seconds)."""
    bench = report["benchmarks"][0]
    own = bench["metrics"]["time_to_first_token_ms"]["successful"]
    values = [
        r["time_to_first_token_ms"] / 1000.0
        for r in bench["requests"]["successful"]
        if r.get("time_to_first_token_ms") is not None
    ]
    return {
        "requests": float(len(values)),
        "p50": own["median"] / 1000.0,
        "p95": own["percentiles"]["p95"] / 1000.0,
        "p50_nearest_rank": pct(values, 0.50),
        "p95_nearest_rank": pct(values, 0.95),
    }


def harness_ttft(result: dict[str, Any], cls_name: str, arm: str = "direct") -> dict[str, float]:
    """The harness's TTFT figures of ``cls_name`` in ``arm`` (seconds)."""
    s = result["summaries"][arm][cls_name]
    return {"requests": float(s["requests"]), "p50": s["ttft_p50"], "p95": s["ttft_p95"]}


def differences(harness: dict[str, float], peer: dict[str, float]) -> dict[str, float]:
    """The peer's figures against the harness's, in percent of the harness's."""
    out = {}
    for q in ("p50", "p95"):
        out[q] = (peer[q] / harness[q] - 1) * 100
        out[f"{q}_nearest_rank"] = (peer[f"{q}_nearest_rank"] / harness[q] - 1) * 100
    return out


def compare(result_dir: Path, report: Path, cls_name: str, tolerance: float) -> int:
    result = json.loads((result_dir / "result.json").read_text())
    ours = harness_ttft(result, cls_name)
    theirs = guidellm_ttft(json.loads(report.read_text()))
    diff = differences(ours, theirs)
    rows = [
        ("requests", f"{ours['requests']:.0f}", f"{theirs['requests']:.0f}", "", ""),
        *(
            (
                f"TTFT {q}",
                f"{ours[q] * 1000:,.1f} ms",
                f"{theirs[q] * 1000:,.1f} ms",
                f"{diff[q]:+.1f}%",
                f"{theirs[q + '_nearest_rank'] * 1000:,.1f} ms ({diff[q + '_nearest_rank']:+.1f}%)",
            )
            for q in ("p50", "p95")
        ),
    ]
    header = ("", "harness", "GuideLLM", "difference", "GuideLLM, nearest rank")
    print(markdown_table(header, rows))
    worst = max(abs(diff["p50"]), abs(diff["p95"]))
    print(f"\nWorst difference {worst:.1f}% (tolerance {tolerance:g}%).")
    return 0 if worst <= tolerance else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m loadtests.compare.crosscheck_guidellm")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("prompts", help="a class's prompts as GuideLLM's JSONL")
    p.add_argument("workload", type=Path)
    p.add_argument("cls")
    p.add_argument("n", type=int)
    p.add_argument("out", type=Path)
    c = sub.add_parser("compare", help="the harness's TTFT against GuideLLM's")
    c.add_argument("result_dir", type=Path)
    c.add_argument("report", type=Path)
    c.add_argument("cls")
    c.add_argument("--tolerance", type=float, default=10.0, help="percent")
    args = parser.parse_args(argv)
    if args.command == "prompts":
        prompts(args.workload, args.cls, args.n, args.out)
        return 0
    return compare(args.result_dir, args.report, args.cls, args.tolerance)


if __name__ == "__main__":
    sys.exit(main())
