"""The machine's stops set against a repetition (loadtests.harness.stalls.StallWatch.between
and spans_between) and against one interval (loadtests.harness.stalls.overlaps and
stopped_within), and an arm's stops against its phases (loadtests.harness.stalls.attribute,
loadtests.harness.runs), on hand-filled lists: no child process is started."""

from __future__ import annotations

from pathlib import Path

import pytest

from loadtests.harness.report_sections import disturbed_lines, stall_lines
from loadtests.harness.runs import ArmResult, disturbed_figures
from loadtests.harness.stalls import OUTSIDE, Phase, StallWatch, attribute, overlaps, stopped_within
from loadtests.harness.traffic import ArmRun
from loadtests.harness.workload_file import load_workload


def watch(*stalls: tuple[float, float]) -> StallWatch:
    return StallWatch(stalls=list(stalls))


WINDOW = [
    (1.0, 2.0, False),  # over before the window opens
    (8.0, 2.0, False),  # ends exactly as the window opens
    (9.0, 2.0, True),  # runs into the window
    (12.0, 0.5, True),  # inside it
    (19.0, 3.0, True),  # runs past its end
    (5.0, 30.0, True),  # covers all of it
    (10.0, 0.25, True),  # starts as it opens
    (20.0, 1.0, False),  # starts exactly as it closes
    (25.0, 1.0, False),  # after it
]
# How much of the window (10.0, 20.0) each of WINDOW's stops covers, in order.
COVERED = [0.0, 0.0, 1.0, 0.5, 1.0, 10.0, 0.25, 0.0, 0.0]


@pytest.mark.parametrize(("at", "seconds", "overlapping"), WINDOW)
def test_a_stop_counts_when_it_overlaps_the_window(
    at: float, seconds: float, overlapping: bool
) -> None:
    assert watch((at, seconds)).between(10.0, 20.0) == ([seconds] if overlapping else [])
    spans = watch((at, seconds)).spans_between(10.0, 20.0)
    assert spans == ([(at, seconds)] if overlapping else [])


@pytest.mark.parametrize(("at", "seconds", "overlapping"), WINDOW)
def test_overlaps_agrees_with_the_window(at: float, seconds: float, overlapping: bool) -> None:
    assert overlaps(10.0, 20.0, [(at, seconds)]) is overlapping


def test_between_gives_the_lengths_of_the_overlapping_stops_in_order() -> None:
    w = watch((1.0, 0.5), (9.5, 1.0), (12.0, 0.3), (15.0, 2.0), (30.0, 4.0))
    assert w.between(10.0, 20.0) == [1.0, 0.3, 2.0]
    assert w.between(0.0, 100.0) == [0.5, 1.0, 0.3, 2.0, 4.0]
    assert w.between(40.0, 50.0) == []


def test_spans_between_gives_the_overlapping_stops_with_their_starts_in_order() -> None:
    w = watch((1.0, 0.5), (9.5, 1.0), (12.0, 0.3), (15.0, 2.0), (30.0, 4.0))
    assert w.spans_between(10.0, 20.0) == [(9.5, 1.0), (12.0, 0.3), (15.0, 2.0)]
    assert w.spans_between(0.0, 100.0) == list(w.stalls)
    assert w.spans_between(40.0, 50.0) == []
    for start, end in ((10.0, 20.0), (0.0, 100.0), (40.0, 50.0)):
        assert w.between(start, end) == [s for _, s in w.spans_between(start, end)]


def test_overlaps_any_of_several_spans() -> None:
    spans = [(1.0, 0.5), (9.5, 1.0), (30.0, 4.0)]
    assert overlaps(9.0, 9.75, spans)  # the second
    assert overlaps(33.0, 40.0, spans)  # the third
    assert not overlaps(1.5, 9.5, spans)  # between the first and the second, touching both
    assert not overlaps(0.0, 100.0, [])


def test_no_stops_none_between() -> None:
    assert StallWatch().between(0.0, 1e9) == []
    assert StallWatch().spans_between(0.0, 1e9) == []


# -- stopped_within: how much of an interval the stops cover ----------------------------
# Times are exact in binary, so that the sums and differences are exact too.


@pytest.mark.parametrize(
    ("at", "seconds", "covered"),
    [(at, seconds, c) for (at, seconds, _), c in zip(WINDOW, COVERED, strict=True)],
)
def test_stopped_within_one_stop_is_its_overlap_with_the_interval(
    at: float, seconds: float, covered: float
) -> None:
    assert stopped_within(10.0, 20.0, [(at, seconds)]) == covered


@pytest.mark.parametrize(("at", "seconds", "overlapping"), WINDOW)
def test_stopped_within_agrees_with_overlaps(at: float, seconds: float, overlapping: bool) -> None:
    assert (stopped_within(10.0, 20.0, [(at, seconds)]) > 0) is overlapping


def test_stopped_within_no_stops_is_nothing() -> None:
    assert stopped_within(10.0, 20.0, []) == 0.0


@pytest.mark.parametrize(
    ("spans", "covered"),
    [
        pytest.param([(11.0, 1.0), (13.0, 2.0), (17.0, 0.5)], 3.5, id="disjoint"),
        pytest.param([(11.0, 4.0), (12.0, 1.0)], 4.0, id="nested"),
        pytest.param([(11.0, 4.0), (11.0, 1.0), (14.0, 1.0)], 4.0, id="nested-at-both-ends"),
        pytest.param([(9.0, 4.0), (10.5, 1.0)], 3.0, id="nested-in-one-that-runs-in"),
        pytest.param([(11.0, 2.0), (12.0, 2.0)], 3.0, id="overlapping"),
        pytest.param([(11.0, 2.0), (12.0, 2.0), (13.5, 1.0)], 3.5, id="a-chain-overlapping"),
        pytest.param([(12.0, 1.0), (12.0, 1.0)], 1.0, id="the-same-twice"),
        pytest.param([(11.0, 1.0), (12.0, 1.0)], 2.0, id="touching-each-other"),
        pytest.param([(5.0, 5.0), (20.0, 5.0)], 0.0, id="touching-the-edges-from-outside"),
        pytest.param([(10.0, 1.0), (19.0, 1.0)], 2.0, id="touching-the-edges-from-inside"),
        pytest.param([(0.0, 100.0)], 10.0, id="larger-than-the-interval"),
        pytest.param([(0.0, 100.0), (12.0, 1.0), (5.0, 8.0)], 10.0, id="larger-with-others"),
        pytest.param([(8.0, 3.0), (18.0, 3.0)], 3.0, id="over-both-edges"),
        pytest.param([(12.0, 0.0)], 0.0, id="of-no-length"),
        pytest.param([(1.0, 2.0), (30.0, 2.0)], 0.0, id="all-outside"),
    ],
)
def test_stopped_within_merges_the_stops_before_adding_them_up(
    spans: list[tuple[float, float]], covered: float
) -> None:
    assert stopped_within(10.0, 20.0, spans) == covered
    # the order the stops come in does not matter
    assert stopped_within(10.0, 20.0, list(reversed(spans))) == covered
    assert stopped_within(10.0, 20.0, sorted(spans, key=lambda s: -s[1])) == covered


def test_stopped_within_unsorted_stops_give_the_sorted_result() -> None:
    spans = [(17.0, 0.5), (9.0, 2.5), (13.0, 2.0), (10.5, 0.25), (14.0, 2.0)]
    # (10.0, 11.5), (13.0, 16.0) and (17.0, 17.5): 1.5 + 3.0 + 0.5
    assert stopped_within(10.0, 20.0, spans) == 5.0
    assert stopped_within(10.0, 20.0, sorted(spans)) == 5.0


def test_stopped_within_is_never_more_than_the_interval() -> None:
    spans = [(9.0 + 0.5 * i, 1.5) for i in range(25)]  # overlapping, past both edges
    assert stopped_within(10.0, 20.0, spans) == 10.0
    assert stopped_within(12.0, 12.5, spans) == 0.5


def test_stopped_within_an_empty_interval_is_nothing() -> None:
    assert stopped_within(12.0, 12.0, [(10.0, 5.0)]) == 0.0


PHASES = [
    Phase("warm-0 warm-up", 100.0, 102.0),
    Phase("warm-0 measured", 102.0, 110.0),
    Phase("warm-0 drain", 110.0, 111.0),
]


def test_stops_are_set_against_the_phases_they_overlap() -> None:
    stops = [(103.0, 0.2), (109.8, 0.6), (100.5, 0.15), (120.0, 2.0)]
    view = attribute(stops, PHASES, origin=100.0, disturbing_s=0.5)
    assert (view["count"], view["longest_s"]) == (4, 2.0)
    assert view["total_s"] == pytest.approx(2.95)
    assert [s["phases"] for s in view["stops"]] == [
        ["warm-0 warm-up"],
        ["warm-0 measured"],
        ["warm-0 measured", "warm-0 drain"],  # runs over the window's end
        [OUTSIDE],
    ]
    assert [s["at"] for s in view["stops"]] == [0.5, 3.0, 9.8, 20.0]
    measured = view["phases"]["warm-0 measured"]
    assert (measured["count"], measured["longest_s"]) == (2, 0.6)
    assert measured["total_s"] == pytest.approx(0.8)
    # the 0.6 s stop disturbs both phases it overlaps; a long stop outside every run
    # disturbs none, and the short stop of the warm-up none
    assert view["disturbed"] == ["warm-0 measured", "warm-0 drain"]
    assert not view["phases"][OUTSIDE]["disturbed"]
    assert not view["phases"]["warm-0 warm-up"]["disturbed"]


def test_no_stop_no_disturbance() -> None:
    view = attribute([], PHASES, origin=100.0)
    assert (view["count"], view["longest_s"], view["total_s"]) == (0, 0.0, 0.0)
    assert view["disturbed"] == [] and view["phases"] == {}


def test_an_arms_phases_and_the_figures_a_stop_disturbs() -> None:
    workload = load_workload(Path("loadtests/workloads/awkward.yaml"))  # cold + 2 warm, 40 s
    cold = ArmRun(1000.0, ended_at=1041.0)
    warm = [ArmRun(1041.0, ended_at=1082.0), ArmRun(1082.0)]  # the last: not drained
    result = ArmResult(warm, cold, stalls=[(1050.0, 1.5), (1005.0, 0.7)])
    phases = result.phases(workload)
    assert [p.name for p in phases[:3]] == ["cold warm-up", "cold measured", "cold drain"]
    assert (phases[4].start, phases[4].end) == (1049.0, 1081.0)  # warm-0 measured
    assert phases[-1].start == phases[-1].end == 1122.0  # no drain seen
    view = result.stall_view(workload)
    assert view["disturbed"] == ["cold warm-up", "warm-0 measured"]
    assert disturbed_figures({"proxy": view}) == {
        "proxy (cold)": ["cold warm-up"],
        "proxy": ["warm-0 measured"],
    }
    said = disturbed_lines({"proxy": ["warm-0 measured"]}, {"proxy": view})
    lines = "\n".join(stall_lines({"proxy": view}) + said)
    assert "warm-0 measured: 1 (1.50 s) DISTURBED" in lines
    assert "**Disturbed**: the proxy figures include warm-0 measured" in lines
