"""The fleet benchmark's figures and tables (:mod:`loadtests.bench.fleet`). Pure.

- **hit rate**: the fleet's, from the engines' own counters: every engine's
  ``/metrics`` is read before and after a phase, and the rate is the sum over
  engines of the change in ``vllm:prefix_cache_hits_total`` over the sum of the
  change in ``vllm:prefix_cache_queries_total`` (prompt tokens found in the cache
  over prompt tokens looked up);
- **prefilled**: prompt tokens the engines computed (queries - hits) per prompt
  token of the answers the client got (their ``usage.prompt_tokens``). Without
  extra engine requests it is 1 - hit rate; it differs where a router sends more
  than the client did: whoseturn sends a long batch prompt in pieces (each piece a
  request that finds the one before in the cache, which the counters count as
  hits though nothing was saved), so for its arms this is the fairer figure;
- **TTFT** p50 and p95 (nearest rank) of the chat requests, measured by the client
  from sending to the first streamed token;
- **valid records per hour**: batch lines answered whole (status 200, ended by
  length at exactly ``max_tokens``: :func:`loadtests.harness.validity.assess`) per
  hour of the batch's own time, from its submission to its last line;
- **makespan**: from the first request sent to the end of the last one; with a
  batch (``documents``), the batch's own, from its submission to its last line
  (the chats beside it are sent on a schedule; only those sent while the batch ran
  count in the TTFT figures);
- **CPU**: cores used by the bench's processes (client, engines, router or proxy).

A row's figures can be given as ratios to another arm's (round robin's) in the same
phase: cold (the first run on fresh engines) or warm (``--repeat``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from loadtests.engine_io.metrics import samples
from loadtests.harness.measures import pct
from loadtests.support.markdown import markdown_table

HITS = "vllm:prefix_cache_hits_total"
QUERIES = "vllm:prefix_cache_queries_total"
BEGIN = "<!-- fleet-results:begin (written by python -m loadtests.bench.fleet) -->"
END = "<!-- fleet-results:end -->"


@dataclass(frozen=True)
class CacheCounts:
    """An engine's prefix-cache counters (prompt tokens), or their change."""

    hits: float = 0.0
    queries: float = 0.0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries > 0 else None


def cache_counts(exposition: str) -> CacheCounts:
    """The counters in one engine's ``/metrics`` text (0 where missing)."""
    values = samples(exposition)
    return CacheCounts(values.get(HITS, 0.0), values.get(QUERIES, 0.0))


def fleet_delta(before: Sequence[CacheCounts], after: Sequence[CacheCounts]) -> CacheCounts:
    """The fleet's change between two scrapes: the sum over engines of each one's
    change (the lists hold the same engines in the same order)."""
    if len(before) != len(after):
        raise ValueError(f"{len(before)} engines before, {len(after)} after")
    return CacheCounts(
        sum(a.hits - b.hits for b, a in zip(before, after, strict=True)),
        sum(a.queries - b.queries for b, a in zip(before, after, strict=True)),
    )


@dataclass(frozen=True)
class Outcome:
    """What the client saw in one phase (one run of a workload)."""

    ttfts_s: tuple[float, ...]
    chat_requests: int
    chat_failed: int
    prompt_tokens: int  # usage.prompt_tokens summed over every answer received
    makespan_s: float
    lines: int = 0  # batch lines in the workload
    valid_lines: int = 0
    batch_s: float | None = None  # submitted -> last line done
    first_error: str | None = None


@dataclass(frozen=True)
class Phase:
    """One phase measured: the engines' counters' change, the client's outcome, and
    the cores the bench's processes used (None if not measured)."""

    cache: CacheCounts
    outcome: Outcome
    cpu_cores: float | None = None
    machine_cores: float | None = None  # the whole machine's, others' work included


@dataclass(frozen=True)
class Figures:
    """The figures of a row's phase (pooled over the phases given)."""

    hit_rate: float | None
    prefilled: float | None
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    valid_per_hour: float | None
    makespan_s: float
    cpu_cores: float | None
    failed: int  # chat requests without an answer + batch lines not valid
    runs: int = 1
    machine_cores: float | None = None


def figures(phases: Sequence[Phase]) -> Figures:
    """The figures of one or more phases of the same arm, pooled: counters and
    tokens summed, TTFTs put together, batch lines over the batches' summed time,
    makespan and CPU averaged."""
    if not phases:
        raise ValueError("no phase to figure")
    cache = CacheCounts(sum(p.cache.hits for p in phases), sum(p.cache.queries for p in phases))
    outcomes = [p.outcome for p in phases]
    ttfts = sorted(t for o in outcomes for t in o.ttfts_s)
    tokens = sum(o.prompt_tokens for o in outcomes)
    batch_s = [o.batch_s for o in outcomes if o.batch_s is not None]
    valid = sum(o.valid_lines for o in outcomes)
    cpus = [p.cpu_cores for p in phases if p.cpu_cores is not None]
    machine = [p.machine_cores for p in phases if p.machine_cores is not None]
    return Figures(
        hit_rate=cache.hit_rate,
        prefilled=(cache.queries - cache.hits) / tokens if tokens > 0 else None,
        ttft_p50_s=_or_none(pct(ttfts, 0.50)),
        ttft_p95_s=_or_none(pct(ttfts, 0.95)),
        valid_per_hour=valid * 3600 / sum(batch_s) if batch_s and sum(batch_s) > 0 else None,
        makespan_s=sum(o.makespan_s for o in outcomes) / len(outcomes),
        cpu_cores=sum(cpus) / len(cpus) if cpus else None,
        failed=sum(o.chat_failed + o.lines - o.valid_lines for o in outcomes),
        runs=len(phases),
        machine_cores=sum(machine) / len(machine) if machine else None,
    )


def _or_none(value: float) -> float | None:
    return None if math.isnan(value) else value


@dataclass(frozen=True)
class Row:
    """One arm in a table: its cold figures, its warm ones (``--repeat``), or why
    it has none (``note``: it did not start, or cannot run here)."""

    arm: str
    cold: Figures | None = None
    warm: Figures | None = None
    note: str = ""


def ratio(value: float | None, base: float | None) -> float | None:
    """``value / base``; None when either is missing or the base is 0."""
    if value is None or base is None or base == 0:
        return None
    return value / base


def table(rows: Sequence[Row], *, batch: bool, warm: bool, base: str = "round-robin") -> str:
    """The Markdown table of one fleet size and workload: a row per arm, its cold
    figures then (``warm``) its warm ones, each with its ratio to ``base``'s figure
    in the same phase; valid records per hour only where there is a batch."""
    head = ["arm", *_phase_head("", batch)]
    if warm:
        head += _phase_head("warm ", batch)
    head += ["CPU cores", "failed"]
    by_arm = {r.arm: r for r in rows}
    base_row = by_arm.get(base)
    body = []
    for row in rows:
        if row.cold is None:
            blanks = len(head) - 2
            body.append([row.arm, f"— ({row.note})" if row.note else "—", *["—"] * blanks])
            continue
        cells = [row.arm, *_phase_cells(row.cold, base_row.cold if base_row else None, batch)]
        if warm:
            base_warm = base_row.warm if base_row else None
            cells += _phase_cells(row.warm, base_warm, batch)
        phases = [f for f in (row.cold, row.warm if warm else None) if f is not None]
        cells.append(" / ".join(_num(f.cpu_cores, "{:.2f}") for f in phases))
        cells.append(" / ".join(str(f.failed) for f in phases))
        body.append(cells)
    return markdown_table(head, body)


def _phase_head(prefix: str, batch: bool) -> list[str]:
    head = [f"{prefix}hit rate", f"{prefix}prefilled", f"{prefix}chat TTFT p50 / p95 ms"]
    if batch:
        head.append(f"{prefix}valid records/h")
    return [*head, f"{prefix}makespan s"]


def _phase_cells(f: Figures | None, base: Figures | None, batch: bool) -> list[str]:
    if f is None:
        return ["—"] * (5 if batch else 4)

    def with_ratio(value: float | None, base_value: float | None, fmt: str) -> str:
        r = ratio(value, base_value)
        return _num(value, fmt) + (f" ({r:.2f}x)" if r is not None else "")

    def b(name: str) -> float | None:
        return getattr(base, name) if base is not None else None

    p50 = _num(_ms(f.ttft_p50_s), "{:,.0f}")
    p95 = _num(_ms(f.ttft_p95_s), "{:,.0f}")
    r50, r95 = ratio(f.ttft_p50_s, b("ttft_p50_s")), ratio(f.ttft_p95_s, b("ttft_p95_s"))
    ttft = f"{p50} / {p95}"
    if r50 is not None and r95 is not None:
        ttft += f" ({r50:.2f}x / {r95:.2f}x)"
    cells = [
        with_ratio(f.hit_rate, b("hit_rate"), "{:.1%}"),
        with_ratio(f.prefilled, b("prefilled"), "{:.2f}"),
        ttft,
    ]
    if batch:
        cells.append(with_ratio(f.valid_per_hour, b("valid_per_hour"), "{:,.0f}"))
    return [*cells, with_ratio(f.makespan_s, b("makespan_s"), "{:.1f}")]


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _num(value: float | None, fmt: str) -> str:
    return "—" if value is None else fmt.format(value)


def with_results(doc: str, results: str) -> str:
    """``doc`` with its results section (between :data:`BEGIN` and :data:`END`)
    replaced by ``results``; the section is added at the end if there is none."""
    section = f"{BEGIN}\n{results.strip()}\n{END}"
    start, end = doc.find(BEGIN), doc.find(END)
    if start < 0 or end < start:
        return doc.rstrip("\n") + "\n\n" + section + "\n"
    return doc[:start] + section + doc[end + len(END) :]
