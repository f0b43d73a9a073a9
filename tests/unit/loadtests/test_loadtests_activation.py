"""The activation phase in the harness: the wait for a model to wake on its card
(``X-Whoseturn-Activation-Ms``, kept per record), summarised per arm with the first
wake of each model in a run (the cold activation) apart from the later ones, and
shown in ``report.md`` and ``result.json`` only as far as a request waited for one."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from loadtests.harness.client import Record
from loadtests.harness.measures import ActivationSummary, Wake, summarize_activation
from loadtests.harness.report import Findings, write_report, write_result
from loadtests.harness.report_sections import activation_lines, activation_table
from loadtests.harness.runs import ArmResult, activation_view
from loadtests.harness.traffic import ArmRun
from loadtests.harness.workload_file import Workload, parse_workload
from tests.support.workloads import chat_class
from tests.unit.loadtests.records import record


def waited(n: int, model: str, sent_at: float, activation_ms: float | None) -> Record:
    return record(n, sent_at=sent_at, model=model, proxy_activation_ms=activation_ms)


def first_run() -> list[Record]:
    """Model a's first wake ends at 5.0 s: request 2, sent at 2.0 s, waited for it
    too; request 3 waited for a later one, request 4 for none. Model b: request 5
    waited for its first wake, request 6 for a later one. Not in the order sent."""
    return [
        waited(3, "a", 20.0, 1000.0),
        waited(2, "a", 2.0, 3000.0),
        waited(1, "a", 0.0, 5000.0),
        waited(4, "a", 30.0, None),
        waited(6, "b", 40.0, 2000.0),
        waited(5, "b", 10.0, 4000.0),
    ]


def second_run() -> list[Record]:
    """Model a waits again, for its first wake of this run."""
    return [waited(7, "a", 0.5, 1500.0), waited(8, "a", 3.0, None)]


def test_the_first_wake_of_each_model_in_a_run_is_apart_from_the_later_ones() -> None:
    s = summarize_activation([("warm-0", first_run()), ("warm-1", second_run())])
    assert (s.requests, s.waited, s.first, s.again) == (8, 6, 4, 2)
    # all: 1.0, 1.5, 2.0, 3.0, 4.0, 5.0 (nearest rank)
    assert (s.wait_p50, s.wait_p95, s.wait_max) == pytest.approx((2.0, 5.0, 5.0))
    # first wakes: 1.5 (a, warm-1), 3.0 and 5.0 (a, warm-0), 4.0 (b, warm-0)
    assert (s.first_p50, s.first_p95, s.first_max) == pytest.approx((3.0, 5.0, 5.0))
    # later wakes: 1.0 (a), 2.0 (b)
    assert (s.again_p50, s.again_p95, s.again_max) == pytest.approx((1.0, 2.0, 2.0))
    assert s.first_wakes == [
        Wake("warm-0", "a", "x-1", 5.0, 2),
        Wake("warm-0", "b", "x-5", 4.0, 1),
        Wake("warm-1", "a", "x-7", 1.5, 1),
    ]


def test_no_wake_waited_for_gives_counts_of_nothing_and_no_figures() -> None:
    s = summarize_activation([("warm-0", [record(1), record(2, sent_at=1.0)])])
    assert (s.requests, s.waited, s.first, s.again, s.first_wakes) == (2, 0, 0, 0, [])
    assert all(math.isnan(v) for v in (s.wait_p50, s.wait_max, s.first_p50, s.again_p95))
    assert summarize_activation([]).requests == 0


def test_an_arms_warm_runs_together_and_its_cold_run_apart() -> None:
    cold = ArmRun(0.0, {"chat": first_run(), "batch": [record(7)]})
    warm = [ArmRun(100.0, {"chat": second_run()}), ArmRun(200.0, {"chat": [record(9)]})]
    view = activation_view({"proxy": ArmResult(warm, cold), "direct": ArmResult(warm[1:])})
    assert list(view) == [
        "proxy, batch", "proxy, batch (cold)", "proxy, chat", "proxy, chat (cold)", "direct, chat"
    ]  # fmt: skip
    chat = view["proxy, chat"]
    assert (chat.requests, chat.waited) == (3, 1)
    assert chat.first_wakes == [Wake("warm-0", "a", "x-7", 1.5, 1)]
    assert (view["proxy, chat (cold)"].waited, view["proxy, chat (cold)"].first) == (5, 3)
    assert [w.run for w in view["proxy, chat (cold)"].first_wakes] == ["cold", "cold"]
    assert view["proxy, batch"].requests == 0 and view["proxy, batch (cold)"].requests == 1
    assert view["direct, chat"].waited == 0


def views() -> dict[str, ActivationSummary]:
    return {
        "proxy": summarize_activation([("warm-0", first_run()), ("warm-1", second_run())]),
        "direct": summarize_activation([("warm-0", [record(1)])]),
    }


def test_the_table_shows_each_arms_waits_first_and_later_wakes_apart() -> None:
    lines = activation_table(views()).splitlines()
    assert lines[0] == (
        "| arm | waited / sent | all | a model's first wake in the run | later wakes |"
    )
    assert lines[2:] == [
        "| proxy | 6 / 8 | 6: 2,000 ms / 5,000 ms / 5,000 ms "
        "| 4: 3,000 ms / 5,000 ms / 5,000 ms | 2: 1,000 ms / 2,000 ms / 2,000 ms |",
        "| direct | 0 / 1 | - | - | - |",
    ]


def test_the_section_names_the_header_and_lists_each_runs_first_wakes() -> None:
    lines = activation_lines(views())
    text = "\n".join(lines)
    assert lines[0] == "## Waiting for a model to wake"
    assert "`X-Whoseturn-Activation-Ms`" in text
    assert "- proxy, warm-0, model a: 5,000 ms (request x-1; 2 waited for it)" in lines
    assert "- proxy, warm-1, model a: 1,500 ms (request x-7; 1 waited for it)" in lines


def test_no_wake_waited_for_no_section() -> None:
    none = {"direct": summarize_activation([("warm-0", [record(1)])])}
    assert activation_table(none) == ""
    assert activation_lines(none) == activation_lines({}) == []


def workload() -> Workload:
    chat = chat_class({"process": "periodic", "rate": 1}, chars=100, max_tokens=2)
    return parse_workload({"name": "w", "classes": {"chat": chat}}, base=Path())


def findings(activation: dict[str, ActivationSummary]) -> Findings:
    return Findings(
        answers=None,
        verdicts=[],
        machine={},
        started={},
        stalls={},
        disturbed={},
        by_prompt={},
        engines={},
        activation=activation,
    )


def test_report_and_result_carry_the_activation_phase(tmp_path: Path) -> None:
    found = findings(views())
    write_report(tmp_path, workload(), found, intro="i", table="T", plots=[])
    report = (tmp_path / "report.md").read_text()
    assert "## Waiting for a model to wake" in report
    assert "| proxy | 6 / 8 |" in report
    write_result(tmp_path, workload(), found, setup={}, summaries={}, reasoning="r")
    result = json.loads((tmp_path / "result.json").read_text())["activation"]
    assert (result["proxy"]["waited"], result["proxy"]["first"]) == (6, 4)
    assert result["proxy"]["first_max"] == 5.0
    assert result["proxy"]["first_wakes"][0] == {
        "run": "warm-0",
        "model": "a",
        "id": "x-1",
        "wait_s": 5.0,
        "requests": 2,
    }
    assert result["direct"]["waited"] == 0
    assert result["direct"]["wait_p50"] is None  # no figure, not NaN


def test_no_wake_waited_for_leaves_the_report_without_the_section(tmp_path: Path) -> None:
    none = {"direct": summarize_activation([("warm-0", [record(1)])])}
    write_report(tmp_path, workload(), findings(none), intro="i", table="T", plots=[])
    report = (tmp_path / "report.md").read_text()
    assert "Activation-Ms" not in report and "wake" not in report
    write_result(tmp_path, workload(), findings(none), setup={}, summaries={}, reasoning="r")
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["activation"]["direct"]["requests"] == 1
