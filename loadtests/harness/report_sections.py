"""The report's sections on what the side-by-side table does not show: the wait for
models to wake on their cards (:func:`loadtests.harness.measures.summarize_activation`), each
tenant's requests, TTFT and share of tokens (:mod:`loadtests.harness.tenants`), TTFT by
prompt length (:mod:`loadtests.harness.buckets`), the engines' queue and prefill histograms
beside the client's view (:mod:`loadtests.harness.engine_histograms`), and the machine's
stops with the figures they disturbed (:func:`loadtests.harness.stalls.attribute`). Each
function gives the section's markdown lines, none when it has nothing to say.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from loadtests.harness.buckets import BUCKETS, UNKNOWN, LengthFigures
from loadtests.harness.measures import ActivationSummary
from loadtests.harness.tenants import TenantSummary
from loadtests.support.markdown import markdown_table


def ms(seconds: float) -> str:
    return "-" if math.isnan(seconds) else f"{seconds * 1000:,.0f} ms"


def _spread(count: int, p50: float, p95: float, top: float) -> str:
    return "-" if not count else f"{count:,}: {ms(p50)} / {ms(p95)} / {ms(top)}"


def activation_table(activation: dict[str, ActivationSummary]) -> str:
    """A row per arm (and cold run): the requests that waited for their model to wake,
    of those sent, and their wait, all of them, the first wakes' and the later ones'
    (count: p50 / p95 / max); "" when no request waited for a wake."""
    if not any(a.waited for a in activation.values()):
        return ""
    rows: list[Sequence[str]] = [
        (
            arm,
            f"{a.waited:,} / {a.requests:,}",
            _spread(a.waited, a.wait_p50, a.wait_p95, a.wait_max),
            _spread(a.first, a.first_p50, a.first_p95, a.first_max),
            _spread(a.again, a.again_p50, a.again_p95, a.again_max),
        )
        for arm, a in activation.items()
    ]
    header = ("arm", "waited / sent", "all", "a model's first wake in the run", "later wakes")
    return markdown_table(header, rows)


def activation_lines(activation: dict[str, ActivationSummary]) -> list[str]:
    """The activation section (:func:`activation_table`) and each run's first wake
    per model; none when no request waited for a wake."""
    table = activation_table(activation)
    if not table:
        return []
    wakes = [
        f"- {arm}, {w.run}, model {w.model or '-'}: {ms(w.wait_s)} (request {w.id}; "
        f"{w.requests:,} waited for it)"
        for arm, a in activation.items()
        for w in a.first_wakes
    ]
    return [
        "## Waiting for a model to wake",
        "",
        "A request that came while its model was asleep on its card waited for the model "
        "to wake: that wait is the proxy's `X-Whoseturn-Activation-Ms`, part of its queue "
        "wait (`X-Whoseturn-Queue-Ms`). Every request of the runs counts here, the "
        "warm-up's too (a model's first wake comes at a run's start). The cold run's row "
        "(`(cold)`) holds the first activations after the servers started; the other "
        "rows, the warm runs'. First wake in the run: the requests that waited for their "
        "model's first wake of a run; later wakes: the others. Each cell: requests: "
        "wait p50 / p95 / max. Per arm in `result.json` (`activation`).",
        "",
        table,
        "",
        "Each run's first wake per model: the wait of the first request that waited "
        "for it (the wake, as near as the client can tell), and how many waited for it:",
        "",
        *wakes,
        "",
    ]


def tenant_table(tenants: dict[str, list[TenantSummary]]) -> str:
    """A row per arm and tenant: requests, TTFT p50 / p95, tokens and share of
    tokens; "" when no arm has more than one tenant (the class table says it all)."""
    if all(len(rows) < 2 for rows in tenants.values()):
        return ""
    rows: list[Sequence[str]] = [
        (
            arm,
            t.label,
            f"{t.requests:,}",
            ms(t.ttft_p50),
            ms(t.ttft_p95),
            f"{t.tokens:,}",
            "-" if math.isnan(t.share) else f"{t.share:.1%}",
        )
        for arm, summaries in tenants.items()
        for t in summaries
    ]
    header = ("arm", "tenant", "requests", "TTFT p50", "TTFT p95", "tokens", "share of tokens")
    return markdown_table(header, rows)


def tenant_lines(tenants: dict[str, list[TenantSummary]]) -> list[str]:
    """The tenants' section (:func:`tenant_table`), none with one tenant."""
    table = tenant_table(tenants)
    if not table:
        return []
    return [
        "## Tenants",
        "",
        "Each tenant's requests sent after the warm-up (a Batch API job's lines counted), "
        "their TTFT, and their answers' tokens as the usage counts them (prompt + "
        "completion); the share is of all tenants' tokens in the arm (warm runs).",
        "",
        table,
        "",
    ]


def length_lines(by_prompt: dict[str, dict[str, list[LengthFigures]]]) -> list[str]:
    """The warm TTFT p50/p95 and request count per prompt-length bucket
    (:mod:`loadtests.harness.buckets`), a row per class and bucket, columns per arm."""
    names = list(by_prompt)
    classes = list(dict.fromkeys(c for by_class in by_prompt.values() for c in by_class))
    rows: list[Sequence[str]] = []
    for cls in classes:
        per_arm = {a: {f.bucket: f for f in by_prompt[a].get(cls, [])} for a in names}
        for name in (*BUCKETS, UNKNOWN):
            found = [per_arm[a].get(name) for a in names]
            if not any(found):
                continue
            cells = [
                "-" if f is None else f"{f.requests}: {ms(f.ttft_p50)} / {ms(f.ttft_p95)}"
                for f in found
            ]
            rows.append((cls, name, *cells))
    if not rows:
        return []
    return [
        "## TTFT by prompt length",
        "",
        "Requests sent after the warm-up, by their prompt's tokens (`usage.prompt_tokens`); "
        "each cell: requests: TTFT p50 / p95.",
        "",
        markdown_table(("class", "prompt tokens", *names), rows),
        "",
    ]


def _three(f: dict[str, Any]) -> str:
    return " / ".join("-" if f.get(k) is None else ms(f[k]) for k in ("mean", "p50", "p95"))


def engine_lines(engines: dict[str, dict[str, Any]]) -> list[str]:
    """Per arm, each engine's queue, prefill and TTFT from its histograms over the
    warm measured windows (:mod:`loadtests.harness.engine_histograms`), and beside them what
    the client saw: TTFT and the proxy's queue wait."""
    rows: list[Sequence[str]] = []
    for arm, view in engines.items():
        for name, phases in view.get("engines", {}).items():
            warm = phases.get("warm measured") or {}
            if not warm:
                continue
            requests = next((f["requests"] for f in warm.values() if f["requests"]), 0)
            cells = [_three(warm.get(k) or {}) for k in ("queue", "prefill", "ttft")]
            rows.append((arm, f"engine {name}", f"{requests:,.0f}", *cells))
        c = view.get("client")
        if c:
            queue = _three({"p50": c["queue_p50"], "p95": c["queue_p95"]})
            ttft = _three({"p50": c["ttft_p50"], "p95": c["ttft_p95"]})
            rows.append((arm, "client, all classes", f"{c['requests']:,.0f}", queue, "-", ttft))
    if not rows:
        return []
    header = ("arm", "seen by", "requests", "queue mean / p50 / p95", "prefill", "TTFT")
    return [
        "## Queue and prefill as the engines saw them",
        "",
        "From each engine's histograms (`vllm:request_queue_time_seconds`, "
        "`vllm:request_prefill_time_seconds`, `vllm:time_to_first_token_seconds`), the "
        "difference between the scrapes around the warm runs' measured windows: mean, "
        "and p50 / p95 interpolated in the buckets; requests are those the engine "
        "recorded then. The client's row: its TTFT, and in the queue column the proxy's "
        "queue wait (`X-Whoseturn-Queue-Ms`, none direct). Per phase in `result.json` "
        "(`engine_histograms`).",
        "",
        markdown_table(header, rows),
        "",
    ]


def disturbed_lines(
    disturbed: dict[str, list[str]], stalls: dict[str, dict[str, Any]]
) -> list[str]:
    """Under the table: each set of figures a long stop of the machine disturbed."""
    lines = []
    for figures, phases in disturbed.items():
        view = stalls[figures.removesuffix(" (cold)")]
        longest = max(view["phases"][p]["longest_s"] for p in phases)
        lines.append(
            f"**Disturbed**: the {figures} figures include {', '.join(phases)}, where the "
            f"machine stopped for up to {longest:.2f} s (over {view['disturbing_s']:g} s). "
            "They are kept as measured: read them with that in mind, or run again."
        )
    return [*lines, ""] if lines else []


def stall_lines(stalls: dict[str, dict[str, Any]]) -> list[str]:
    """The machine's stops per arm (:func:`loadtests.harness.stalls.attribute`): count,
    longest, total, and the phases they fell in."""
    if not stalls:
        return []
    rows: list[Sequence[str]] = []
    for arm, view in stalls.items():
        where = "; ".join(
            f"{name}: {p['count']} ({p['total_s']:.2f} s){' DISTURBED' if p['disturbed'] else ''}"
            for name, p in view["phases"].items()
        )
        rows.append(
            (
                arm,
                str(view["count"]),
                f"{view['longest_s']:.2f} s",
                f"{view['total_s']:.2f} s",
                where or "-",
            )
        )
    threshold = next(iter(stalls.values()))
    header = ("arm", "stops", "longest", "total", "phases (stops, total)")
    return [
        "## The machine's stops",
        "",
        f"A process that asks to wake every 10 ms (`loadtests/harness/stalls.py`) ran beside each "
        f"arm; a stop is a wake-up later by over {threshold['threshold_s']:g} s. A phase "
        f"with a stop over {threshold['disturbing_s']:g} s is marked DISTURBED.",
        "",
        markdown_table(header, rows),
        "",
    ]
