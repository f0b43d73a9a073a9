"""A probe's result for people (a table and one plain sentence) and for machines (JSON).

Pure functions of a :class:`~loadtests.probe.result.ProbeResult`. The sentence is the
answer to the question the probe asks; everything else is the evidence for it.
"""

from __future__ import annotations

import statistics
from typing import Any

from loadtests.probe.analysis import Analysis, ChunkFrom, Verdict
from loadtests.probe.curve_fit import BrokenLine, Line
from loadtests.probe.measurements import SizeStalls
from loadtests.probe.result import ProbeResult

# Past the knee, growth below this share of the rate before it is not worth a clause.
_NOTABLE_AFTER = 0.05


def summary(analysis: Analysis, url: str) -> str:
    """The answer in plain words: whether the engine at ``url`` interleaves, serializes,
    or why the probe cannot tell; one sentence, then the figures behind it."""
    if analysis.verdict is Verdict.INTERLEAVES:
        return _interleaves(analysis, url)
    if analysis.verdict is Verdict.SERIALIZES:
        return _serializes(analysis, url)
    return f"probe of the engine at {url} is inconclusive: {analysis.reason}."


def _interleaves(a: Analysis, url: str) -> str:
    if a.chunk_from is ChunkFrom.STEPS or a.stall_level_s is None or a.broken is None:
        return _interleaves_by_steps(a, url)
    top = a.top
    sentence = (
        f"engine at {url} interleaves prefill with decode: decode stalls level off at "
        f"~{_approx_ms(a.stall_level_s)} ms once a prompt exceeds ~{a.chunk_tokens} tokens "
        "(its per-step chunk); a prompt larger than that is prefilled over several steps "
        f"while decode continues (the {top.prompt_tokens}-token one took ~{top.prefill_steps}"
        f"{_each(a)})."
    )
    details = f" Below the chunk, prefill costs ~{_per_1k(a.broken.slope_s_per_token)}"
    if a.broken.slope_ratio > _NOTABLE_AFTER:
        details += (
            f"; past it, stalls still grow ~{_per_1k(a.broken.slope_after_s_per_token)}, "
            "as a later chunk attends to a longer context"
        )
    return f"{sentence}{details}."


def _each(a: Analysis) -> str:
    return f", ~{a.steps_chunk_tokens} tokens each" if a.steps_chunk_tokens else ""


def _interleaves_by_steps(a: Analysis, url: str) -> str:
    top = a.top
    sentence = (
        f"engine at {url} interleaves prefill with decode: its largest prompt, "
        f"{top.prompt_tokens} tokens, was prefilled over ~{top.prefill_steps} steps while "
        f"decode continued (a per-step chunk of ~{a.chunk_tokens} tokens)."
    )
    if a.stalls_flat:
        typical = statistics.median(r.median_s for r in a.table)
        return (
            f"{sentence} Decode stalls stay near ~{_approx_ms(typical)} ms from "
            f"{a.table[0].prompt_tokens} tokens on."
        )
    return (
        f"{sentence} Decode stalls do not level off but keep growing with the prompt, to "
        f"{_approx_ms(top.median_s)} ms at {top.prompt_tokens} tokens, as a later chunk "
        "attends to a longer context."
    )


def _serializes(a: Analysis, url: str) -> str:
    assert a.line is not None
    top = a.table[-1]
    return (
        f"engine at {url} serializes: a decode stream stalls for the whole prefill of each "
        f"prompt (stall grows ~{_per_1k(a.line.slope_s_per_token)}, to {_approx_ms(top.median_s)} "
        f"ms at {top.prompt_tokens} tokens; no knee up to {top.prompt_tokens} tokens, so any "
        "chunk it has is larger than that)."
    )


def render_text(result: ProbeResult) -> str:
    """The human report: the engine, the quiet stream, the table, both fits, the verdict."""
    a, engine = result.analysis, result.engine
    lines = [
        f"whoseturn probe: {engine.url} (model {engine.model}, max_model_len "
        f"{engine.max_model_len})",
        f"decode stream alone: median gap {_ms(a.baseline_gap_s)} ms, worst "
        f"{_ms(a.quiet_worst_s)} ms",
        f"{len(result.injections)} prompts injected beside it in {result.elapsed_s:.1f} s",
        "",
        *_table(a.table),
        "",
    ]
    if a.line is not None:
        lines.append(f"line:        {_line_text(a.line)}")
    if a.broken is not None and a.line is not None:
        lines.append(f"broken line: {_broken_text(a.broken, a.line)}")
    lines += ["", f"verdict: {a.verdict.value} ({a.reason})", summary(a, engine.url)]
    return "\n".join(lines) + "\n"


def _table(table: tuple[SizeStalls, ...]) -> list[str]:
    width = max(len(row.stalls_s) for row in table) * 8
    header = f"{'prompt tokens':>13}  {'decode stalls (ms)':<{width}}  {'median':>7}  "
    header += f"{'prompt took':>11}  {'stall/prompt':>12}  {'steps':>5}"
    rows = [header]
    for row in table:
        stalls = "".join(f"{_ms(s):>8}" for s in row.stalls_s)
        rows.append(
            f"{row.prompt_tokens:>13}  {stalls:<{width}}  {_ms(row.median_s):>7}  "
            f"{_ms(row.median_latency_s):>8} ms  {row.stall_share:>12.0%}  "
            f"{row.prefill_steps:>5}"
        )
    return rows


def _line_text(line: Line) -> str:
    return f"stall = {_ms(line.intercept_s)} ms + {_per_1k(line.slope_s_per_token)}"


def _broken_text(broken: BrokenLine, line: Line) -> str:
    share = broken.sse / line.sse if line.sse > 0 else 1.0
    return (
        f"stall = {_ms(broken.intercept_s)} ms + {_per_1k(broken.slope_s_per_token)} up to "
        f"{round(broken.knee_tokens)} tokens, then {_signed_per_1k(broken.slope_after_s_per_token)}"
        f" ({share:.0%} of the line's squared error)"
    )


def to_json(result: ProbeResult) -> dict[str, Any]:
    """The machine report; times in milliseconds, fields named with their unit."""
    a, engine = result.analysis, result.engine
    return {
        "engine": engine.url,
        "model": engine.model,
        "max_model_len": engine.max_model_len,
        "verdict": a.verdict.value,
        "reason": a.reason,
        "summary": summary(a, engine.url),
        "chunk_tokens": a.chunk_tokens,
        "chunk_from": None if a.chunk_from is None else a.chunk_from.value,
        "chunk_tokens_from_steps": a.steps_chunk_tokens,
        "stall_level_ms": _ms_or_none(a.stall_level_s),
        "prefill_ms_per_1k_tokens": (
            None if a.prefill_s_per_token is None else _round(a.prefill_s_per_token * 1e6)
        ),
        "baseline_gap_ms": _round(a.baseline_gap_s * 1000),
        "quiet_worst_gap_ms": _round(a.quiet_worst_s * 1000),
        "repeat_deviation": _round(a.spread, 3),
        "fits": {"line": _line_json(a.line), "broken_line": _broken_json(a.broken)},
        "table": [_row_json(row) for row in a.table],
        "elapsed_s": _round(result.elapsed_s),
    }


def _row_json(row: SizeStalls) -> dict[str, Any]:
    return {
        "prompt_tokens": row.prompt_tokens,
        "stalls_ms": [_round(s * 1000) for s in row.stalls_s],
        "median_stall_ms": _round(row.median_s * 1000),
        "prompt_latencies_ms": [_round(s * 1000) for s in row.latencies_s],
        "median_prompt_latency_ms": _round(row.median_latency_s * 1000),
        "stall_share": _round(row.stall_share, 3),
        "prefill_steps": list(row.steps),
        "median_prefill_steps": row.prefill_steps,
    }


def _line_json(line: Line | BrokenLine | None) -> dict[str, Any] | None:
    """A fitted line's (or a broken line's first segment's) figures, in ms."""
    if line is None:
        return None
    return {
        "intercept_ms": _round(line.intercept_s * 1000),
        "ms_per_1k_tokens": _round(line.slope_s_per_token * 1e6),
        "sse_ms2": _round(line.sse * 1e6),
    }


def _broken_json(broken: BrokenLine | None) -> dict[str, Any] | None:
    if broken is None:
        return None
    return {
        **(_line_json(broken) or {}),
        "knee_tokens": round(broken.knee_tokens),
        "ms_per_1k_tokens_after": _round(broken.slope_after_s_per_token * 1e6),
    }


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.1f}"


def _approx_ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f}" if seconds >= 0.01 else f"{seconds * 1000:.1f}"


def _per_1k(s_per_token: float) -> str:
    return f"{_approx_ms(s_per_token * 1000)} ms per 1k prompt tokens"


def _signed_per_1k(s_per_token: float) -> str:
    ms = s_per_token * 1e6
    return f"{0.0 if abs(ms) < 0.05 else ms:+.1f} ms per 1k prompt tokens"


def _ms_or_none(seconds: float | None) -> float | None:
    return None if seconds is None else _round(seconds * 1000)


def _round(value: float, digits: int = 2) -> float:
    return round(value, digits)
