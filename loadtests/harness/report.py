"""A run's result directory: ``records.jsonl``, ``result.json``, ``report.md``.

The side-by-side table is the same text on the terminal and in ``report.md``: per
class, the latencies (TTFT, ITL, TPOT, completion; for a batch route TTFT p95 only)
and the proxy's queue wait, valid records per hour, and for a class whose prompts
carry a JSON schema its whole, schema-checked and schema-valid answers; one column per arm and, with
two arms, the change from the first to the second.
"""

from __future__ import annotations

import datetime as dt
import json
import math
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from loadtests.harness.buckets import LengthFigures
from loadtests.harness.corpus import SETS
from loadtests.harness.measures import ActivationSummary, ClassSummary
from loadtests.harness.report_sections import (
    activation_lines,
    disturbed_lines,
    engine_lines,
    length_lines,
    ms,
    stall_lines,
    tenant_lines,
)
from loadtests.harness.tenants import TenantSummary
from loadtests.harness.workload_file import Workload
from loadtests.support.markdown import markdown_table

DEMO_REASONING = (
    "Chat beside a saturating batch job on two simulated vLLM engines (cpu-tiny "
    "profile, chunked prefill, long-prefill threshold 256). Direct, each engine's "
    "FCFS queue holds batch prefills ahead of chat; through the proxy, batch waits in "
    "the proxy and is admitted within a prefill budget, so chat TTFT should fall while "
    "the engines stay busy with batch prefill, keeping batch valid records per hour."
)

RETEST_WHEN = [
    "the engine, its launch flags, its cost profile or step scheduler changes",
    "the proxy's scheduler, budget loop or their defaults change (proxy/scheduler, "
    "proxy/config.py)",
    "the workload's sizes, rates or duration change",
    "the machine changes (cores, load): wall-clock times include the proxy's overhead",
]

PACKAGES = ("whoseturn", "fastapi", "uvicorn", "httpx", "prometheus-client", "anyio")


@dataclass(frozen=True, kw_only=True)
class Findings:
    """What ``result.json`` and ``report.md`` say beside the figures, per arm: the
    answer check (``(compared, differing)``, None for one arm), the workload's bars
    judged, the machine's peaks, the servers the harness started, the machine's stops
    and the figures they disturbed, the warm TTFT by prompt length, and the engines'
    histograms beside the client's view; with more than one tenant, each tenant's
    row (arm: rows, warm runs); the activation phase (arm, and ``"<arm> (cold)"``
    for a cold run: summary)."""

    answers: tuple[int, int] | None
    verdicts: list[str]
    machine: dict[str, dict[str, Any]]
    started: dict[str, list[dict[str, Any]]]
    stalls: dict[str, dict[str, Any]]
    disturbed: dict[str, list[str]]
    by_prompt: dict[str, dict[str, list[LengthFigures]]]
    engines: dict[str, dict[str, Any]]
    tenants: dict[str, list[TenantSummary]] = field(default_factory=dict)
    activation: dict[str, ActivationSummary] = field(default_factory=dict)


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
    workload: Workload,
    findings: Findings,
    *,
    setup: dict[str, Any],
    summaries: dict[str, dict[str, ClassSummary]],
    reasoning: str,
) -> None:
    """``result.json``: the workload, the pinned ``setup`` (with the runtime's versions
    added), the figures per arm and class, each tenant's (more than one), the warm
    TTFT by prompt length, the
    engines' queue and prefill histograms per phase beside the client's view, the
    activation phase per arm (warm runs; cold run apart), the answer check, the
    machine's stops per arm and the figures they disturbed, the reasoning, the date."""
    result = {
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "workload": workload.to_json(),
        "setup": {**setup, "runtime": versions()},
        "summaries": {
            arm: {cls: _json_safe(asdict(s)) for cls, s in by_class.items()}
            for arm, by_class in summaries.items()
        },
        "ttft_by_prompt_length": {
            arm: {cls: [_json_safe(asdict(f)) for f in rows] for cls, rows in by_class.items()}
            for arm, by_class in findings.by_prompt.items()
        },
        "engine_histograms": findings.engines,
        "activation": {arm: _json_safe(asdict(a)) for arm, a in findings.activation.items()},
        "tenants": {
            arm: [_json_safe(asdict(t)) for t in rows] for arm, rows in findings.tenants.items()
        },
        "answer_check": None
        if findings.answers is None
        else {"compared": findings.answers[0], "differing": findings.answers[1]},
        "machine": findings.machine,
        "stalls": findings.stalls,
        "disturbed": findings.disturbed,
        "verdicts": findings.verdicts,
        "reasoning": reasoning,
        "retest_when": RETEST_WHEN,
    }
    (out / "result.json").write_text(json.dumps(result, indent=2) + "\n")


def _json_safe(row: dict[str, Any]) -> dict[str, Any]:
    return {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in row.items()}


def ratio(before: float, after: float) -> str:
    """How ``after`` compares with ``before``: "3.1x lower", "1.2x higher"."""
    if math.isnan(before) or math.isnan(after) or after == 0 or before == 0:
        return "-"
    return f"{before / after:.1f}x lower" if before >= after else f"{after / before:.1f}x higher"


LATENCY_ROWS = (
    ("TTFT p50", "ttft_p50"),
    ("TTFT p95", "ttft_p95"),
    ("TTFT p99", "ttft_p99"),
    ("ITL p50", "itl_p50"),
    ("ITL p95", "itl_p95"),
    ("TPOT p50", "tpot_p50"),
    ("completion p50", "done_p50"),
    ("completion p95", "done_p95"),
    ("queue wait in proxy p95", "queue_p95"),
)
BATCH_ROWS = (("TTFT p95", "ttft_p95"), ("queue wait in proxy p95", "queue_p95"))
JOB_ROWS = (("job completion p50", "done_p50"), ("job completion p95", "done_p95"))


def side_by_side(
    workload: Workload,
    arms: dict[str, dict[str, ClassSummary]],
    *,
    disturbed: dict[str, list[str]] | None = None,
) -> str:
    """The table: a row per figure of each class (valid records per hour for a batch
    route only), a column per arm, then the change from the first arm to the second
    when there are two. An arm in ``disturbed`` (arm: phases where the machine
    stopped for long) is headed "ARM (disturbed)"."""
    names = list(arms)
    rows: list[Sequence[str]] = []
    for cls in workload.classes:
        per_arm = [arms[a][cls.name] for a in names]
        latency = {"chat": LATENCY_ROWS, "batch": BATCH_ROWS, "batch-api": JOB_ROWS}
        for label, key in latency[cls.route]:
            values = [getattr(s, key) for s in per_arm]
            rows.append((f"{cls.name} {label}", *map(ms, values), *_change(values, ratio)))
        per_hour = [("valid records per hour", "valid_per_hour")]
        if cls.route == "batch-api":
            per_hour.insert(0, ("records per hour", "records_per_hour"))
        for label, key in per_hour if cls.route != "chat" else []:
            # an open chat loop's throughput is its arrival rate
            rates = [getattr(s, key) for s in per_arm]
            cells = ["-" if math.isnan(r) else f"{r:,.0f}" for r in rates]
            rows.append((f"{cls.name} {label}", *cells, *_change(rates, _percent)))
        counts = [f"{s.valid}/{s.requests}" for s in per_arm]
        blank = [""] if len(names) == 2 else []
        rows.append((f"{cls.name} valid / sent after warm-up", *counts, *blank))
        if SETS[cls.prompt_source][0] == "extraction" or any(s.schema_checked for s in per_arm):
            checked = [f"{s.whole} / {s.schema_checked} / {s.schema_valid}" for s in per_arm]
            rows.append((f"{cls.name} whole / schema-checked / schema-valid", *checked, *blank))
    marked = [f"{a} (disturbed)" if a in (disturbed or {}) else a for a in names]
    header = ("", *marked, *(["change"] if len(names) == 2 else []))
    return markdown_table(header, rows)


def _change(values: list[float], how: Callable[[float, float], str]) -> list[str]:
    return [how(values[0], values[1])] if len(values) == 2 else []


def _percent(before: float, after: float) -> str:
    if math.isnan(before) or math.isnan(after) or not before:
        return "-"
    return f"{(after / before - 1) * 100:+.1f}%"


def write_report(
    out: Path,
    workload: Workload,
    findings: Findings,
    *,
    intro: str,
    table: str,
    plots: Sequence[str],
) -> None:
    """``report.md``: what ran (``intro``), the table (disturbed figures said below
    it), the wait for models to wake (when a request waited for one), the tenants'
    rows (more than one tenant), TTFT by prompt length, the engines' view of queue and
    prefill beside the client's, the answer check, the machine's stops, the plots."""
    lines = [
        f"# {workload.name}",
        "",
        intro,
        "",
        "Times are wall-clock. TPOT = (E2E - TTFT)/(n - 1); ITL is every gap; queue wait "
        "is the proxy's `X-Whoseturn-Queue-Ms`; valid = a whole answer of `max_tokens` "
        "and, for a prompt that carries a JSON schema, one that follows it (the text read "
        "as JSON, a fenced block or one object amid prose allowed; "
        "`loadtests/harness/validity.py`). "
        f"Latencies are of requests sent after the first {workload.plan.warmup_s:g} s of a "
        "run; valid records per hour count what finished over the whole run (every arm "
        "starts empty; a closed loop's completions come in waves that a shorter window "
        "cuts unevenly).",
        "",
        table,
        "",
        *disturbed_lines(findings.disturbed, findings.stalls),
        *activation_lines(findings.activation),
        *tenant_lines(findings.tenants),
        *length_lines(findings.by_prompt),
        *engine_lines(findings.engines),
    ]
    if findings.answers is not None:
        compared, differing = findings.answers
        lines += [
            f"Answer check: {compared} requests answered whole in both arms, "
            f"{differing} answers differ.",
            "",
        ]
    if findings.verdicts:
        lines += ["The workload's bars, on the warm figures:", ""]
        lines += [*(f"- {v}" for v in findings.verdicts), ""]
    lines += stall_lines(findings.stalls)
    lines += startup_lines(findings.started)
    lines += machine_lines(findings.machine)
    lines += [*[f"![{name}]({name})" for name in plots], ""]
    (out / "report.md").write_text("\n".join(lines))


def startup_lines(started: dict[str, list[dict[str, Any]]]) -> list[str]:
    """The servers the harness started, per arm: time to ready (the engines' model
    load, the cold run's first phase) and the startup facts that change what is
    measured, each with where it was read."""
    if not started:
        return []
    rows: list[Sequence[str]] = []
    for arm, servers in started.items():
        for s in servers:
            facts = s.get("startup_facts") or {}
            said = "; ".join(
                f"{k} {v['value']} ({v['from']})"
                for k, v in facts.items()
                if v["value"] is not None
            )
            rows.append((arm, s["name"], f"{s['ready_s']:.1f} s", said or "-"))
    table = markdown_table(("arm", "server", "ready after (model load)", "startup facts"), rows)
    return ["## Servers started by the harness", "", table, ""]


def machine_lines(machine: dict[str, dict[str, Any]]) -> list[str]:
    """Each arm's servers' peaks as the OS saw them, and the GPUs' when there were any."""
    rows: list[Sequence[str]] = []
    for arm, view in machine.items():
        for name, p in view.get("servers", {}).items():
            rows.append(
                (
                    arm,
                    name,
                    f"{p['rss_peak_bytes'] / 2**20:,.0f} MiB",
                    f"{p['swap_peak_bytes'] / 2**20:,.0f} MiB",
                    f"{p['cpu_peak_percent']:.0f}%",
                )
            )
    if not rows:
        return []
    header = ("arm", "server", "peak RSS", "peak swap", "peak CPU (one core = 100%)")
    lines = ["## The machine's view (psutil, every second)", "", markdown_table(header, rows), ""]
    for arm, view in machine.items():
        gpu = view.get("gpu")
        if gpu:
            per = gpu.get("energy_per_valid_record_j")
            lines.append(
                f"{arm}: GPU memory peak {gpu['memory_peak_mib']:,.0f} MiB, power peak "
                f"{gpu['power_peak_w']:.0f} W, {gpu['energy_j'] / 3600:,.2f} Wh over "
                f"{gpu['seconds']:.0f} s, "
                + (f"{per:,.1f} J per valid record" if per is not None else "no valid record")
                + "."
            )
        else:
            lines.append(f"{arm}: no GPU seen (`nvidia-smi` absent): no power or energy figure.")
    return [*lines, ""]
