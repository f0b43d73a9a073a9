"""The plain sentence, the table and the JSON of a probe's result."""

from __future__ import annotations

import json

import pytest

from loadtests.engine_io import EngineInfo
from loadtests.probe.analysis import Analysis, ChunkFrom, Verdict, analyze
from loadtests.probe.result import ProbeResult
from loadtests.probe.verdict_text import render_text, summary, to_json

from .curves import SIZES, Engine, injections

URL = "http://engine.test:8000"
ENGINE = EngineInfo(url=URL, model="tiny", max_model_len=8192)


def result(analysis: Analysis) -> ProbeResult:
    measured = injections(Engine(chunk=511))
    return ProbeResult(engine=ENGINE, injections=tuple(measured), analysis=analysis, elapsed_s=12.3)


INTERLEAVING = analyze(injections(Engine(chunk=511, per_token_s=0.0002)))
GROWING = analyze(injections(Engine(chunk=511, attention_s=2.4e-8)))
SERIALIZING = analyze(injections(Engine(chunk=None, per_token_s=0.0002)))
UNCLEAR = analyze(injections(Engine(chunk=None), sizes=(128, 256, 512)))


def test_interleaving_sentence() -> None:
    assert summary(INTERLEAVING, URL) == (
        f"engine at {URL} interleaves prefill with decode: decode stalls level off at "
        "~107 ms once a prompt exceeds ~511 tokens (its per-step chunk); a prompt larger "
        "than that is prefilled over several steps while decode continues (the "
        "8128-token one took ~16, ~508 tokens each). Below the chunk, prefill costs "
        "~200 ms per 1k prompt tokens."
    )


def test_interleaving_sentence_names_growth_past_the_chunk() -> None:
    assert "; past it, stalls still grow ~" in summary(GROWING, URL)


def test_interleaving_seen_in_the_steps_with_stalls_still_growing() -> None:
    a = analyze(injections(Engine(chunk=2048, per_token_s=0.000138, attention_s=1.1e-7)))
    assert a.chunk_from is ChunkFrom.STEPS
    assert summary(a, URL) == (
        f"engine at {URL} interleaves prefill with decode: its largest prompt, 8128 "
        "tokens, was prefilled over ~4 steps while decode continued (a per-step chunk of "
        "~2032 tokens). Decode stalls do not level off but keep growing with the prompt, "
        "to 1836 ms at 8128 tokens, as a later chunk attends to a longer context."
    )


def test_interleaving_seen_in_the_steps_with_flat_stalls() -> None:
    a = analyze(injections(Engine(chunk=64)))
    assert summary(a, URL).endswith(
        "(a per-step chunk of ~64 tokens). Decode stalls stay near ~15 ms from 128 tokens on."
    )


def test_serializing_sentence() -> None:
    assert summary(SERIALIZING, URL) == (
        f"engine at {URL} serializes: a decode stream stalls for the whole prefill of each "
        "prompt (stall grows ~200 ms per 1k prompt tokens, to 1631 ms at 8128 tokens; no "
        "knee up to 8128 tokens, so any chunk it has is larger than that)."
    )


def test_inconclusive_sentence_gives_the_reason() -> None:
    assert UNCLEAR.verdict is Verdict.INCONCLUSIVE
    assert summary(UNCLEAR, URL) == (
        f"probe of the engine at {URL} is inconclusive: {UNCLEAR.reason}."
    )


@pytest.mark.parametrize("analysis", [INTERLEAVING, SERIALIZING, UNCLEAR])
def test_text_report_has_the_table_and_the_verdict(analysis: Analysis) -> None:
    text = render_text(result(analysis))
    assert f"{URL} (model tiny, max_model_len 8192)" in text
    assert f"verdict: {analysis.verdict.value}" in text
    assert text.rstrip().endswith(summary(analysis, URL))
    for row in analysis.table:
        assert f"\n{row.prompt_tokens:>13}  " in text


def test_text_report_shows_both_fits() -> None:
    text = render_text(result(INTERLEAVING))
    assert "line:        stall = " in text
    assert "broken line: stall = " in text
    assert "up to 511 tokens" in text


def test_json_report_is_json_with_the_table() -> None:
    report = json.loads(json.dumps(to_json(result(INTERLEAVING))))
    assert report["verdict"] == "interleaves"
    assert report["chunk_tokens"] == 511
    assert report["stall_level_ms"] == pytest.approx(107.2, abs=0.1)
    assert report["prefill_ms_per_1k_tokens"] == pytest.approx(200, rel=0.01)
    assert report["baseline_gap_ms"] == pytest.approx(5.0)
    assert [row["prompt_tokens"] for row in report["table"]] == list(SIZES)
    first = report["table"][0]
    assert len(first["stalls_ms"]) == 3
    assert first["median_stall_ms"] == pytest.approx(30.6)
    assert set(report["fits"]) == {"line", "broken_line"}
    assert report["fits"]["broken_line"]["knee_tokens"] == 511
    assert report["summary"] == summary(INTERLEAVING, URL)


def test_json_report_of_an_inconclusive_probe_has_no_fits() -> None:
    report = to_json(result(UNCLEAR))
    assert report["verdict"] == "inconclusive"
    assert report["chunk_tokens"] is None
    assert report["fits"] == {"line": None, "broken_line": None}
    assert report["reason"] == UNCLEAR.reason
