"""The demo's result directory: ``records.jsonl``, ``result.json``, ``report.md``.

The side-by-side table is the same text on the terminal and in ``report.md``: chat
latencies (TTFT, ITL, TPOT, completion, proxy queue wait) and batch valid records per
hour, one column per arm and their ratio.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import platform
import sys
from collections.abc import Sequence
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from loadtests.demo.workload import DemoWorkload
from loadtests.markdown import markdown_table
from loadtests.measures import ClassSummary

REASONING = (
    "Chat beside a saturating batch job on two simulated vLLM engines (cpu-tiny "
    "profile, chunked prefill, long-prefill threshold 256). Direct, each engine's "
    "FCFS queue holds batch prefills ahead of chat; through the proxy, batch waits in "
    "the proxy and is admitted within a prefill budget, so chat TTFT should fall while "
    "the engines stay busy with batch prefill, keeping batch valid records per hour."
)

RETEST_WHEN = [
    "the simulated engine's cost profile or step scheduler changes (loadtests/sim)",
    "the proxy's scheduler, budget loop or their defaults change (proxy/scheduler, "
    "proxy/config.py)",
    "the workload's sizes, rates or duration change",
    "the machine changes (cores, load): wall-clock times include the proxy's overhead",
]

PACKAGES = ("whoseturn", "fastapi", "uvicorn", "httpx", "prometheus-client", "anyio")


def write_records(out: Path, arms: dict[str, list[dict[str, Any]]]) -> None:
    """Every request of every arm, one JSON object a line, with its arm and answer."""
    with (out / "records.jsonl").open("w") as f:
        for arm, rows in arms.items():
            for row in rows:
                f.write(json.dumps({"arm": arm, **row}) + "\n")


def versions() -> dict[str, str]:
    found = {"python": sys.version.split()[0], "platform": platform.platform()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


def write_result(
    out: Path,
    workload: DemoWorkload,
    *,
    time_scale: float,
    commands: dict[str, list[list[str]]],
    summaries: dict[str, dict[str, ClassSummary]],
    answers: tuple[int, int],
) -> None:
    """``result.json``: the workload, the pinned setup, the figures, the reasoning."""
    compared, differing = answers
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "workload": workload.to_json(),
        "setup": {
            "engine": "whoseturn sim (simulated vLLM V1 scheduler)",
            "profile": "cpu-tiny",
            "model": "tiny",
            "tokenizer": "loadtests.sim.tokenizer.SimTokenizer (word-level, CRC-32 ids)",
            "time_scale": time_scale,
            "sampling": {"temperature": 0},
            "launch_commands": commands,
            "runtime": versions(),
        },
        "summaries": {
            arm: {cls: _json_safe(asdict(s)) for cls, s in by_class.items()}
            for arm, by_class in summaries.items()
        },
        "answer_check": {"compared": compared, "differing": differing},
        "reasoning": REASONING,
        "retest_when": RETEST_WHEN,
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")


def _json_safe(row: dict[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:,.0f} ms"


def ratio(direct: float, proxy: float) -> str:
    if math.isnan(direct) or math.isnan(proxy) or proxy == 0:
        return "-"
    return f"{direct / proxy:.1f}x lower" if direct >= proxy else f"{proxy / direct:.1f}x higher"


def side_by_side(direct: dict[str, ClassSummary], proxy: dict[str, ClassSummary]) -> str:
    """The table: one row a figure, columns direct, through the proxy, and the change."""
    rows: list[Sequence[str]] = []
    for label, cls, field in (
        ("chat TTFT p50", "chat", "ttft_p50"),
        ("chat TTFT p95", "chat", "ttft_p95"),
        ("chat TTFT p99", "chat", "ttft_p99"),
        ("chat ITL p50", "chat", "itl_p50"),
        ("chat ITL p95", "chat", "itl_p95"),
        ("chat TPOT p50", "chat", "tpot_p50"),
        ("chat completion p50", "chat", "done_p50"),
        ("chat completion p95", "chat", "done_p95"),
        ("chat queue wait in proxy p95", "chat", "queue_p95"),
        ("batch queue wait in proxy p95", "batch", "queue_p95"),
    ):
        d, p = getattr(direct[cls], field), getattr(proxy[cls], field)
        rows.append((label, ms(d), ms(p), ratio(d, p)))
    d_rate, p_rate = direct["batch"].valid_per_hour, proxy["batch"].valid_per_hour
    change = f"{(p_rate / d_rate - 1) * 100:+.1f}%" if d_rate else "-"
    rows.append(("batch valid records per hour", f"{d_rate:,.0f}", f"{p_rate:,.0f}", change))
    chats = (f"{direct['chat'].valid}/{direct['chat'].requests}", "")
    rows.append(
        ("chat valid / sent", chats[0], f"{proxy['chat'].valid}/{proxy['chat'].requests}", "")
    )
    return markdown_table(("", "direct", "through the proxy", "change"), rows)


def write_report(
    out: Path,
    workload: DemoWorkload,
    *,
    time_scale: float,
    table: str,
    answers: tuple[int, int],
    plots: Sequence[str],
) -> None:
    """``report.md``: what ran, the table, the answer check, the plots."""
    compared, differing = answers
    lines = [
        "# whoseturn demo",
        "",
        f"Two simulated engines (`cpu-tiny`, `--long-prefill-token-threshold 256`, time "
        f"scale {time_scale:g}); {workload.duration_s:g} s per arm, the first "
        f"{workload.warmup_s:g} s not counted. Chat: Poisson at {workload.chat_rate_per_s:g}/s, "
        f"{workload.chat_answer_tokens}-token answers. Batch: {workload.batch_concurrency} "
        f"documents of {workload.batch_doc_chars:,} characters kept submitted, "
        f"{workload.batch_answer_tokens}-token answers. Greedy sampling. Direct: round robin "
        "over the engines' `/v1`; proxy: chat on `/v1`, batch on `/batch/v1`.",
        "",
        "Times are wall-clock. TPOT = (E2E - TTFT)/(n - 1); ITL is every gap; queue wait "
        "is the proxy's `X-Whoseturn-Queue-Ms`; valid = a whole answer of `max_tokens`.",
        "",
        table,
        "",
        f"Answer check: {compared} requests answered whole in both arms, "
        f"{differing} answers differ.",
        "",
        *[f"![{name}]({name})" for name in plots],
        "",
    ]
    (out / "report.md").write_text("\n".join(lines))
