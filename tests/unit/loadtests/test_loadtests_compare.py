"""The comparison's reporting (loadtests.compare.arms): nearest-rank quantiles, one arm's
summary from its warm repetitions only (with the running stream's gaps net of the
machine's stops), the bar of issue #5, the table, and a run written out and read back."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from loadtests.compare.arms import (
    ARMS,
    ArmResult,
    Check,
    Repetition,
    load,
    pct,
    report,
    summarize,
    table,
    verdict,
    write_records,
)
from loadtests.harness.client import Record

Json = dict[str, Any]
ARM = {a.key: a for a in ARMS}

# -- pct ------------------------------------------------------------------------------


def test_pct_of_nothing_is_nan() -> None:
    assert math.isnan(pct([], 0.5))


@pytest.mark.parametrize(
    ("q", "expected"),
    [(0.0, 1.0), (0.1, 1.0), (0.11, 2.0), (0.5, 5.0), (0.51, 6.0), (0.95, 10.0), (1.0, 10.0)],
)
def test_pct_is_the_nearest_rank(q: float, expected: float) -> None:
    values = [float(v) for v in (7, 3, 10, 1, 9, 5, 2, 8, 4, 6)]  # order does not matter
    assert pct(values, q) == expected


def test_pct_rounds_off_float_error_before_taking_the_rank() -> None:
    # 0.07 * 100 is 7.000000000000001: rank 7 is meant, not 8
    assert pct([float(v) for v in range(1, 101)], 0.07) == 7.0
    assert pct([float(v) for v in range(1, 21)], 0.95) == 19.0


def test_pct_of_one_value_is_that_value() -> None:
    assert pct([0.25], 0.5) == pct([0.25], 0.95) == 0.25


# -- building results -------------------------------------------------------------------


def rec(
    kind: str,
    n: int,
    *,
    at: float,
    ttft: float,
    gap: float = 0.01,
    tokens: int | None = None,
    queue_ms: float | None = None,
    ok: bool = True,
) -> Record:
    """A request of ``kind`` sent ``at``, its ``tokens`` tokens ``gap`` apart from
    ``ttft`` on; whole (valid) unless not ``ok``."""
    tokens = tokens or {"running": 20, "batch": 4, "new": 3}[kind]
    times = [at + ttft + i * gap for i in range(tokens)]
    return Record(
        id=f"{kind}-{n}",
        kind=kind,
        url="http://engine/v1",
        prompt_tokens_sent=100 if kind == "batch" else 0,
        max_tokens=tokens,
        sent_at=at,
        headers_at=at + 0.001,
        token_times=times,
        finished_at=times[-1] + 0.001,
        status=200,
        finish_reason="length" if ok else "stop",
        prompt_tokens=120,
        completion_tokens=tokens,
        proxy_queue_ms=queue_ms,
        engine="vllm-0",
        text="x" * tokens,
    )


def rep(
    arm: str,
    index: int,
    *,
    new_ttft: float,
    running_gap: float,
    batch_ttft: float,
    set_aside: bool = False,
    stops: Sequence[tuple[float, float]] = (),
    engine_queue_s: float | None = 0.05,
    queue_ms: float | None = None,
    invalid: int = 0,
    overlap: bool = True,
) -> Repetition:
    """A repetition: a running chat with one long gap, two batch requests at ``batch_at``
    (100 s per repetition), two new chats; the first ``invalid`` new chats stop early;
    the machine stopped for ``stops`` (see ``in_gap`` and ``away``). If
    ``overlap``, the running stream goes on (0.01 s a token after its gap) until just
    past the last first batch token, so that it ``overlapped`` the batch; else it has
    its 20 tokens only, and ends before ``batch_at``."""
    batch_at = 100.0 * index
    # its last token: batch_at - 0.9 + (tokens - 1) * 0.01 + running_gap
    tokens = 20
    if overlap:
        tokens = max(tokens, int((batch_ttft + 0.5 + 0.9 - running_gap) / 0.01) + 3)
    records = [
        rec("running", 0, at=batch_at - 1.0, ttft=0.1, tokens=tokens),
        rec("batch", 0, at=batch_at, ttft=batch_ttft),
        rec("batch", 1, at=batch_at, ttft=batch_ttft + 0.5),
        rec("new", 0, at=batch_at + 0.5, ttft=new_ttft, queue_ms=queue_ms, ok=invalid < 1),
        rec("new", 1, at=batch_at + 1.0, ttft=2 * new_ttft, queue_ms=queue_ms, ok=invalid < 2),
    ]
    # the running stream stops once for ``running_gap`` seconds, mid-answer
    running = records[0]
    running.token_times = [
        t + (running_gap if i >= 10 else 0.0) for i, t in enumerate(running.token_times)
    ]
    running.finished_at = running.token_times[-1] + 0.001
    return Repetition(
        arm=arm,
        index=index,
        batch_at=batch_at,
        records=records,
        stall_spans=list(stops),
        engine_queue_s=engine_queue_s,
        engine_prefill_s=0.5,
        set_aside=set_aside,
    )


def in_gap(index: int, seconds: float) -> tuple[float, float]:
    """A stop of the machine inside the running stream's long gap in repetition
    ``index``: the gap runs from ``batch_at - 0.81`` for ``running_gap + 0.01`` s, so a
    stop no longer than ``running_gap`` lies wholly inside that gap and no other, which
    it leaves ``running_gap + 0.01 - seconds`` long net of the stop."""
    return (100.0 * index - 0.805, seconds)


def away(index: int, seconds: float) -> tuple[float, float]:
    """A stop of the machine in repetition ``index`` after the running stream ended
    (its last token comes just after the first batch token, a few seconds after
    ``batch_at`` at most): it overlaps none of its gaps."""
    return (100.0 * index + 10.0, seconds)


def fcfs_result() -> ArmResult:
    """A cold repetition, two kept warm ones and one set aside; the cold and the
    set-aside ones are far off every warm value, so any leak shows."""
    repetitions = [
        rep("fcfs", 0, new_ttft=50.0, running_gap=90.0, batch_ttft=70.0, stops=[in_gap(0, 9.0)]),
        rep("fcfs", 1, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0, stops=[away(1, 0.2)]),
        rep(
            "fcfs",
            2,
            new_ttft=40.0,
            running_gap=80.0,
            batch_ttft=60.0,
            set_aside=True,
            stops=[in_gap(2, 3.0)],
            engine_queue_s=99.0,
            invalid=2,
        ),
        rep("fcfs", 3, new_ttft=2.0, running_gap=0.8, batch_ttft=3.0, engine_queue_s=None),
    ]
    return ArmResult(
        ARM["fcfs"], "vllm serve tiny", 12.5, peak_rss_bytes=3 * 2**29, repetitions=repetitions
    )


def fcfs_arm(repetitions: Iterable[Repetition] = ()) -> ArmResult:
    """The FCFS arm's result of just ``repetitions``."""
    return ArmResult(ARM["fcfs"], "c", 1.0, repetitions=list(repetitions))


def with_long_gap(*stops: tuple[float, float]) -> tuple[ArmResult, dict[str, Any]]:
    """:func:`fcfs_result` with a repetition 4 whose running stream has a 5 s gap, the
    machine stopped for ``stops`` during it; the result and its summary."""
    result = fcfs_result()
    result.repetitions.append(
        rep("fcfs", 4, new_ttft=1.0, running_gap=5.0, batch_ttft=2.0, stops=stops)
    )
    return result, summarize(result)


# -- the records' views -----------------------------------------------------------------


def test_a_repetition_splits_records_by_kind_and_times_the_batch_from_its_submission() -> None:
    r = rep("fcfs", 1, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0)
    assert [x.id for x in r.of("batch")] == ["batch-0", "batch-1"]
    assert [x.id for x in r.of("new")] == ["new-0", "new-1"]
    # the second batch request: first token 2.5 s in, 4 tokens 0.01 s apart, +0.001
    assert r.batch_done_s == pytest.approx(2.5 + 0.03 + 0.001)
    assert not r.cold and rep("fcfs", 0, new_ttft=1, running_gap=1, batch_ttft=1).cold


def test_a_repetition_without_a_finished_batch_has_no_batch_time() -> None:
    r = rep("fcfs", 1, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0)
    for x in r.of("batch"):
        x.finished_at = None
    assert math.isnan(r.batch_done_s)


def test_a_repetitions_stalls_are_the_lengths_of_its_stops() -> None:
    r = rep("fcfs", 1, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0)
    assert r.stalls == []
    r.stall_spans = [(99.0, 0.25), (110.0, 1.5)]
    assert r.stalls == [0.25, 1.5]


def test_a_records_times_net_of_stops_take_off_only_the_stops_within_them() -> None:
    r = rec("new", 0, at=10.0, ttft=1.0)  # first token at 11, finished at 11.021
    # before it was sent, 0.25 s of its wait, 0.011 s of its answer, and after it
    stops = [(9.0, 0.5), (10.5, 0.25), (11.01, 0.5), (20.0, 1.0)]
    assert r.ttft_net(stops) == pytest.approx(1.0 - 0.25)
    assert r.done_net(stops) == pytest.approx(1.021 - 0.25 - 0.011)
    assert r.done_net([]) == pytest.approx(r.done)
    r.finished_at = None
    assert r.done_net(stops) is None


def test_a_repetition_overlapped_the_batch_if_the_stream_ran_past_every_first_batch_token() -> None:
    r = rep("fcfs", 1, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0)
    running = r.of("running")[0]
    assert running.token_times[-1] > 100.0 + 2.5
    assert r.overlapped
    # the last first batch token counts: a prompt still in prefill after the stream
    # ended leaves part of the batch's prefill unmeasured
    r.of("batch")[1].token_times = [t + 50.0 for t in r.of("batch")[1].token_times]
    assert not r.overlapped


def test_a_stream_that_ended_before_the_last_first_batch_token_did_not_overlap() -> None:
    r = rep("fcfs", 1, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0, overlap=False)
    assert r.of("running")[0].token_times[-1] < 100.0
    assert not r.overlapped
    running = r.of("running")[0]
    running.token_times.append(r.of("batch")[0].token_times[0] + 0.001)
    assert not r.overlapped
    # just after the last first batch token is enough
    running.token_times.append(r.of("batch")[1].token_times[0] + 0.001)
    assert r.overlapped


def test_a_stream_the_client_closed_after_the_batch_was_prefilled_overlapped() -> None:
    r = rep("fcfs", 1, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0, overlap=False)
    running = r.of("running")[0]
    last_first = r.of("batch")[1].token_times[0]
    running.closed_at = last_first - 0.001
    assert not r.overlapped
    running.closed_at = last_first
    assert r.overlapped


def test_a_batch_prompt_without_a_first_token_is_no_overlap() -> None:
    r = rep("fcfs", 1, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0)
    r.of("batch")[0].token_times = []
    assert not r.overlapped


def test_no_batch_tokens_or_no_stream_tokens_is_no_overlap() -> None:
    r = rep("fcfs", 1, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0)
    for x in r.of("batch"):
        x.token_times = []
    assert not r.overlapped
    r = rep("fcfs", 1, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0)
    r.of("running")[0].token_times = []
    assert not r.overlapped


def test_the_batch_time_net_of_stops_takes_off_only_the_stops_while_it_ran() -> None:
    r = rep("fcfs", 1, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0)
    done = 2.5 + 0.031
    assert r.batch_done_net_s == pytest.approx(done)
    # one before the batch came, one within it, one over its end (0.531 s of it within)
    r.stall_spans = [(99.0, 0.5), (100.5, 1.0), (102.0, 5.0)]
    assert r.batch_done_s == pytest.approx(done)
    assert r.batch_done_net_s == pytest.approx(done - 1.0 - 0.531)
    for x in r.of("batch"):
        x.finished_at = None
    assert math.isnan(r.batch_done_net_s)


def test_warm_leaves_out_the_cold_and_the_set_aside_repetitions() -> None:
    result = fcfs_result()
    assert [r.index for r in result.warm] == [1, 3]
    assert sorted(result.values("new", "ttft")) == pytest.approx([1.0, 2.0, 2.0, 4.0])


# -- summarize --------------------------------------------------------------------------


def test_summarize_counts_only_the_warm_repetitions() -> None:
    s = summarize(fcfs_result())
    assert (s["arm"], s["name"], s["command"]) == ("fcfs", ARM["fcfs"].name, "vllm serve tiny")
    assert (s["warm_repetitions"], s["set_aside"]) == (2, 1)
    # new chats' TTFT: 1, 2 (repetition 1) and 2, 4 (repetition 3); nearest rank
    assert s["new_chat_ttft_p50"] == pytest.approx(2.0)
    assert s["new_chat_ttft_p95"] == pytest.approx(4.0)
    # done: TTFT + 2 gaps + 0.001
    assert s["new_chat_done_p50"] == pytest.approx(2.021)
    assert s["new_chat_done_p95"] == pytest.approx(4.021)
    # batch TTFT: 2, 2.5, 3, 3.5
    assert s["batch_ttft_p50"] == pytest.approx(2.5)
    assert s["batch_ttft_p95"] == pytest.approx(3.5)
    assert s["running_ttft_p50"] == pytest.approx(0.1)
    assert s["valid"] == s["requests"] == 10
    assert s["worst_stall_s"] == 0.2
    assert s["peak_rss_gib"] == 1.5
    assert s["ready_after_s"] == 12.5


def test_the_running_streams_worst_gap_has_its_max_and_its_median_over_repetitions() -> None:
    result = fcfs_result()
    result.repetitions.append(
        rep("fcfs", 4, new_ttft=1.0, running_gap=5.0, batch_ttft=2.0)  # one stop of the machine
    )
    s = summarize(result)
    gaps = [0.4 + 0.01, 0.8 + 0.01, 5.0 + 0.01]
    assert s["running_worst_gap"] == pytest.approx(max(gaps))
    assert s["running_worst_gap_median"] == pytest.approx(0.81)
    # no warm repetition saw a stop over a gap: net of the stops, the same
    assert s["running_worst_gap_net"] == pytest.approx(max(gaps))
    assert s["running_worst_gap_net_median"] == pytest.approx(0.81)


def test_a_gap_over_a_stop_of_the_machine_counts_net_of_the_stop() -> None:
    # the 5 s gap of repetition 4 spans a 4.9 s stop of the machine
    _, s = with_long_gap(in_gap(4, 4.9))
    assert s["running_worst_gap"] == pytest.approx(5.01)
    assert s["running_worst_gap_median"] == pytest.approx(0.81)
    # repetition 4's 5.01 s gap counts 5.01 - 4.9 = 0.11 s, still its worst
    net = [0.41, 0.81, 0.11]
    assert s["running_worst_gap_net"] == pytest.approx(max(net))
    assert s["running_worst_gap_net_median"] == pytest.approx(0.41)
    assert s["running_worst_gap_net"] < s["running_worst_gap"]
    assert s["running_worst_gap_net_median"] < s["running_worst_gap_median"]
    assert s["worst_stall_s"] == pytest.approx(4.9)


@pytest.mark.parametrize(
    ("stop", "net", "net_median"),
    [
        # a 0.5 s stop inside the 5 s gap of repetition 4: 4.51 s of it is left
        pytest.param(in_gap(4, 0.5), 4.51, 0.81, id="a_short_stop_takes_off_its_own_length"),
        # a stop at the time of repetition 1's gap, recorded against repetition 4
        pytest.param(in_gap(1, 4.9), 5.01, 0.81, id="a_stop_counts_only_against_its_own_gaps"),
        pytest.param(away(4, 4.9), 5.01, 0.81, id="a_stop_after_the_stream_ended_changes_nothing"),
    ],
)
def test_a_stop_takes_off_only_what_it_covers_of_its_own_repetitions_gaps(
    stop: tuple[float, float], net: float, net_median: float
) -> None:
    _, s = with_long_gap(stop)
    assert s["running_worst_gap_net"] == pytest.approx(net)
    assert s["running_worst_gap_net_median"] == pytest.approx(net_median)


def test_a_stop_over_the_whole_gap_leaves_the_streams_even_gaps() -> None:
    # a stop from before the 5 s gap of repetition 4 opens to after it closes, over
    # the 0.01 s gaps either side of it too: they all net to nothing; the stream's
    # other even 0.01 s gaps are left
    long_gap = (400.0 - 0.81, 5.01)
    stop = (long_gap[0] - 0.015, long_gap[1] + 0.03)
    result, s = with_long_gap(stop)
    assert s["running_worst_gap_net"] == pytest.approx(0.81)
    assert s["running_worst_gap_net_median"] == pytest.approx(0.41)
    record = result.repetitions[-1].of("running")[0]
    assert record.worst_gap_net([stop]) == pytest.approx(0.01)


def test_overlapping_stops_in_one_gap_are_not_counted_twice() -> None:
    # two 3 s stops in the 5.01 s gap of repetition 4, overlapping by 1 s: 5 s stopped
    first = in_gap(4, 3.0)
    second = (first[0] + 2.0, 3.0)
    result, s = with_long_gap(first, second)
    # 5.01 - 5 = 0.01, not 5.01 - 6 (below nothing) nor 5.01 - 3
    assert s["running_worst_gap_net"] == pytest.approx(0.81)
    record = result.repetitions[-1].of("running")[0]
    assert record.worst_gap_net([first, second]) == pytest.approx(0.01)
    assert s["worst_stall_s"] == pytest.approx(3.0)


def test_the_cold_and_set_aside_repetitions_stops_do_not_count() -> None:
    # both have a stop over their running gap (90 s and 80 s); neither is warm, so
    # neither their raw gaps nor their net ones leak in
    s = summarize(fcfs_result())
    assert s["running_worst_gap_net"] == pytest.approx(0.81)
    assert s["running_worst_gap_net_median"] == pytest.approx((0.41 + 0.81) / 2)


def test_batch_done_median_and_max_are_over_the_warm_repetitions() -> None:
    s = summarize(fcfs_result())
    done = [2.5 + 0.031, 3.5 + 0.031]
    assert s["batch_done_median"] == pytest.approx(sum(done) / 2)
    assert s["batch_done_max"] == pytest.approx(max(done))


def test_a_repetition_whose_stream_did_not_overlap_the_batch_has_no_net_gap() -> None:
    result = fcfs_result()
    # its 0.91 s gap ended before the batch's first token: it says nothing of the batch
    result.repetitions.append(
        rep("fcfs", 4, new_ttft=1.0, running_gap=0.9, batch_ttft=2.0, overlap=False)
    )
    s = summarize(result)
    assert (s["warm_repetitions"], s["running_overlapped"]) == (3, 2)
    # the raw gaps keep it
    assert s["running_worst_gap"] == pytest.approx(0.91)
    assert s["running_worst_gap_median"] == pytest.approx(0.81)
    # the net ones do not
    assert s["running_worst_gap_net"] == pytest.approx(0.81)
    assert s["running_worst_gap_net_median"] == pytest.approx((0.41 + 0.81) / 2)


def test_with_no_repetition_overlapping_the_batch_the_net_gap_is_nan() -> None:
    result = fcfs_arm(
        rep("fcfs", i, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0, overlap=False) for i in (1, 2)
    )
    s = summarize(result)
    assert (s["warm_repetitions"], s["running_overlapped"]) == (2, 0)
    assert s["running_worst_gap_median"] == pytest.approx(0.41)
    assert math.isnan(s["running_worst_gap_net"])
    assert math.isnan(s["running_worst_gap_net_median"])


def test_the_new_chats_and_the_batch_are_summarized_net_of_stops_too() -> None:
    # repetition 2: the machine stopped from 201 s to 202.5 s, over both new chats'
    # waits (sent at 200.5 and 201, first tokens at 201.5 and 203) and the batch's
    # (200 s to 202.531 s)
    result = fcfs_arm(
        [
            rep("fcfs", 1, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0),
            rep("fcfs", 2, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0, stops=[(201.0, 1.5)]),
        ]
    )
    assert sorted(result.net("new", "ttft")) == pytest.approx([0.5, 0.5, 1.0, 2.0])
    assert sorted(result.net("new", "done")) == pytest.approx([0.5, 0.521, 1.021, 2.021])
    s = summarize(result)
    assert (s["new_chat_ttft_p50"], s["new_chat_ttft_p95"]) == pytest.approx((1.0, 2.0))
    assert (s["new_chat_ttft_net_p50"], s["new_chat_ttft_net_p95"]) == pytest.approx((0.5, 2.0))
    assert (s["new_chat_done_net_p50"], s["new_chat_done_net_p95"]) == pytest.approx((0.521, 2.021))
    assert s["batch_done_median"] == pytest.approx(2.531)
    assert s["batch_done_net_median"] == pytest.approx((2.531 + 1.031) / 2)
    assert s["running_overlapped"] == 2


def test_the_engine_queue_mean_skips_repetitions_without_one() -> None:
    s = summarize(fcfs_result())
    assert s["engine_queue_mean_s"] == pytest.approx(0.05)
    assert s["engine_prefill_mean_s"] == pytest.approx(0.5)


def test_the_cold_repetition_is_reported_apart() -> None:
    assert summarize(fcfs_result())["cold"] == {
        "new_chat_ttft_max": pytest.approx(100.0),
        "batch_done": pytest.approx(70.5 + 0.031),
    }
    result = fcfs_result()
    result.repetitions.pop(0)
    assert summarize(result)["cold"] is None


def test_invalid_answers_in_a_warm_repetition_are_counted() -> None:
    result = fcfs_result()
    result.repetitions.append(
        rep("fcfs", 4, new_ttft=1.0, running_gap=0.4, batch_ttft=2.0, invalid=1)
    )
    s = summarize(result)
    assert (s["valid"], s["requests"]) == (14, 15)


def test_the_proxy_queue_wait_is_reported_only_when_the_proxy_gave_one() -> None:
    assert summarize(fcfs_result())["new_chat_proxy_queue_ms_p95"] is None
    proxy = ArmResult(
        ARM["proxy"],
        "whoseturn serve",
        3.0,
        repetitions=[
            rep("proxy", 1, new_ttft=0.1, running_gap=0.1, batch_ttft=2.0, queue_ms=4.0),
            rep("proxy", 2, new_ttft=0.1, running_gap=0.1, batch_ttft=2.0, queue_ms=9.0),
        ],
    )
    assert summarize(proxy)["new_chat_proxy_queue_ms_p95"] == 9.0


def test_an_arm_without_warm_repetitions_has_nan_statistics() -> None:
    result = fcfs_arm()
    s = summarize(result)
    assert math.isnan(s["new_chat_ttft_p95"])
    assert math.isnan(s["running_worst_gap_median"])
    assert math.isnan(s["running_worst_gap_net"])
    assert math.isnan(s["running_worst_gap_net_median"])
    assert math.isnan(s["batch_done_median"])
    assert math.isnan(s["batch_done_net_median"])
    assert math.isnan(s["new_chat_ttft_net_p95"])
    assert math.isnan(s["new_chat_done_net_p95"])
    assert s["running_overlapped"] == 0
    assert (s["valid"], s["requests"], s["engine_queue_mean_s"]) == (0, 0, None)


# -- verdict ----------------------------------------------------------------------------


def summary(arm: str, **values: Any) -> Json:
    base: Json = {
        "arm": arm,
        "name": ARM[arm].name,
        "new_chat_ttft_p50": 1.0,
        "new_chat_ttft_p95": 1.0,
        "new_chat_done_p50": 1.0,
        "new_chat_done_p95": 1.0,
        "new_chat_ttft_net_p50": 1.0,
        "new_chat_ttft_net_p95": 1.0,
        "new_chat_done_net_p50": 1.0,
        "new_chat_done_net_p95": 1.0,
        "running_worst_gap": 0.5,
        "running_worst_gap_median": 0.2,
        "running_worst_gap_net": 0.4,
        "running_worst_gap_net_median": 0.15,
        "running_overlapped": 3,
        "warm_repetitions": 3,
        "batch_ttft_p50": 2.0,
        "batch_ttft_p95": 3.0,
        "batch_done_median": 10.0,
        "batch_done_net_median": 10.0,
        "valid": 20,
        "requests": 20,
    }
    return {**base, **values}


def passing(**changes: Json) -> list[Json]:
    """Four arms on which every check is met, with some arms' values changed."""
    p95 = {"fcfs": (8.0, 9.0), "priority": (2.0, 2.0), "budget512": (1.5, 1.5), "proxy": (1, 1)}
    arms = {
        key: summary(
            key,
            new_chat_ttft_p95=ttft,
            new_chat_done_p95=done,
            new_chat_ttft_net_p95=ttft,
            new_chat_done_net_p95=done,
        )
        for key, (ttft, done) in p95.items()
    }
    return [{**s, **changes.get(key, {})} for key, s in arms.items()]


def by_what(checks: list[Check]) -> dict[str, Check]:
    return {c.what: c for c in checks}


def test_every_check_is_met_when_the_proxy_clears_each_bar() -> None:
    checks = verdict(passing())
    assert len(checks) == 9
    assert all(c.met for c in checks), [c for c in checks if not c.met]
    got = by_what(checks)
    assert got["new chat TTFT p95: fcfs / proxy"] == Check(
        "new chat TTFT p95: fcfs / proxy", 8.0, 5.0, True
    )
    assert got["new chat done p95: priority / proxy"].bar == 1.0
    assert got["valid answers, all arms"] == Check("valid answers, all arms", 80, 80, True)


def test_the_order_of_the_summaries_does_not_matter() -> None:
    assert verdict(passing()) == verdict(list(reversed(passing())))


@pytest.mark.parametrize("column", ["TTFT", "done"])
def test_fcfs_must_be_more_than_five_times_slower_than_the_proxy(column: str) -> None:
    key = {"TTFT": "new_chat_ttft_net_p95", "done": "new_chat_done_net_p95"}[column]
    what = f"new chat {column} p95: fcfs / proxy"
    exactly = by_what(verdict(passing(fcfs={key: 5.0})))[what]
    assert (exactly.value, exactly.met) == (5.0, False)
    assert by_what(verdict(passing(fcfs={key: 5.5})))[what].met


@pytest.mark.parametrize("arm", ["priority", "budget512"])
@pytest.mark.parametrize("column", ["TTFT", "done"])
def test_the_proxy_must_beat_engine_priority_and_small_steps(arm: str, column: str) -> None:
    key = {"TTFT": "new_chat_ttft_net_p95", "done": "new_chat_done_net_p95"}[column]
    what = f"new chat {column} p95: {arm} / proxy"
    tie = by_what(verdict(passing(**{arm: {key: 1.0}})))
    assert (tie[what].value, tie[what].met) == (1.0, False)
    assert [c.what for c in tie.values() if not c.met] == [what]
    assert by_what(verdict(passing(**{arm: {key: 1.01}})))[what].met


@pytest.mark.parametrize("column", ["ttft", "done"])
def test_the_new_chat_checks_take_the_times_net_of_machine_stops(column: str) -> None:
    label = {"ttft": "TTFT", "done": "done"}[column]
    what = f"new chat {label} p95: fcfs / proxy"
    # the proxy's raw p95 is huge (a stop of the machine), net of the stops it is not
    stopped = passing(proxy={f"new_chat_{column}_p95": 50.0})
    assert by_what(verdict(stopped))[what].met
    # and the other way: the check reads the net p95, not the raw one
    slow = passing(proxy={f"new_chat_{column}_net_p95": 4.0})
    check = by_what(verdict(slow))[what]
    assert check.value == pytest.approx(p95_of_fcfs(column) / 4.0)
    assert not check.met


def p95_of_fcfs(column: str) -> float:
    return next(s for s in passing() if s["arm"] == "fcfs")[f"new_chat_{column}_net_p95"]


GAP = "running worst gap: proxy / 512-token steps"


NET = "running_worst_gap_net"
NET_MEDIAN = "running_worst_gap_net_median"


def test_the_running_gap_may_be_up_to_a_quarter_longer_than_with_small_steps() -> None:
    small = {NET_MEDIAN: 1.0}
    at_bar = passing(proxy={NET_MEDIAN: 1.25}, budget512=small)
    assert by_what(verdict(at_bar))[GAP] == Check(GAP, 1.25, 1.25, True)
    over = passing(proxy={NET_MEDIAN: 1.26}, budget512=small)
    assert not by_what(verdict(over))[GAP].met


def test_the_running_gap_check_uses_the_median_not_the_max() -> None:
    one_gap = passing(proxy={NET: 9.0}, budget512={NET: 0.1})
    assert by_what(verdict(one_gap))[GAP].met
    slow = passing(proxy={NET_MEDIAN: 1.0, NET: 1.0})
    assert not by_what(verdict(slow))[GAP].met


def test_the_running_gap_check_takes_the_gaps_net_of_machine_stops() -> None:
    # the proxy's raw worst gaps are huge (they spanned stops of the machine), net of
    # the stops they are not: the bar is met
    stopped = {"running_worst_gap": 9.0, "running_worst_gap_median": 8.0, NET_MEDIAN: 0.15}
    check = by_what(verdict(passing(proxy=stopped)))[GAP]
    assert (check.value, check.met) == (1.0, True)
    # and the other way: the check reads the net median, not the raw one
    slow = {"running_worst_gap": 0.1, "running_worst_gap_median": 0.1, NET_MEDIAN: 0.3}
    check = by_what(verdict(passing(proxy=slow)))[GAP]
    assert check.value == pytest.approx(2.0)
    assert not check.met


BATCH = "batch done: proxy / FCFS"


def test_the_batch_check_takes_the_time_net_of_machine_stops() -> None:
    raw = by_what(verdict(passing(proxy={"batch_done_median": 50.0})))[BATCH]
    assert (raw.value, raw.met) == (1.0, True)
    net = by_what(verdict(passing(proxy={"batch_done_net_median": 50.0})))[BATCH]
    assert (net.value, net.met) == (5.0, False)


def test_the_batch_may_finish_up_to_a_fifth_later_than_under_fcfs() -> None:
    at_bar = by_what(verdict(passing(proxy={"batch_done_net_median": 12.0})))[BATCH]
    assert (at_bar.value, at_bar.bar, at_bar.met) == (1.2, 1.2, True)
    assert not by_what(verdict(passing(proxy={"batch_done_net_median": 12.1})))[BATCH].met
    faster = by_what(verdict(passing(proxy={"batch_done_net_median": 5.0})))[BATCH]
    assert (faster.value, faster.met) == (0.5, True)


def test_every_answer_of_every_arm_must_be_valid() -> None:
    checks = by_what(verdict(passing(priority={"valid": 19})))
    valid = checks["valid answers, all arms"]
    assert (valid.value, valid.bar, valid.met) == (79, 80, False)
    assert all(c.met for w, c in checks.items() if w != valid.what)


def test_a_missing_measurement_misses_its_check() -> None:
    nan = float("nan")
    checks = by_what(verdict(passing(proxy={"batch_done_net_median": nan})))
    assert not checks[BATCH].met


# -- table ------------------------------------------------------------------------------


def test_the_table_has_one_row_per_arm_in_order() -> None:
    summaries = [summarize(fcfs_result()), {**summarize(fcfs_result()), "name": "second"}]
    lines = table(summaries).splitlines()
    assert len(lines) == 2 + 2
    assert lines[0].startswith("| arm |") and lines[1].startswith("|---")
    assert lines[2].startswith(f"| {ARM['fcfs'].name} | 2.00 s / 4.00 s |")
    assert lines[3].startswith("| second |")
    assert lines[2].endswith("| 10/10 |")
    assert all(line.count("|") == 11 for line in lines)
    assert lines[0].count("| same, net of stops") == 3
    assert "repetitions it overlapped the batch |" in lines[0]
    assert "| batch done, median (net of stops) |" in lines[0]


def proxy_row(**values: Any) -> str:
    """The table's row of the proxy arm's :func:`summary` with ``values``."""
    return table([summary("proxy", **values)]).splitlines()[2]


def test_the_table_writes_short_times_in_milliseconds() -> None:
    row = proxy_row(
        running_worst_gap=2.5,
        running_worst_gap_median=0.0125,
        running_worst_gap_net=0.25,
        running_worst_gap_net_median=0.0075,
    )
    assert "| 12 ms (2.50 s) | 8 ms (250 ms; 3 of 3) |" in row
    assert "| 10.00 s (10.00 s) |" in row


def test_the_table_shows_the_raw_and_net_times_side_by_side() -> None:
    values = {
        "new_chat_ttft_p50": 0.5,
        "new_chat_ttft_p95": 3.0,
        "new_chat_ttft_net_p50": 0.25,
        "new_chat_ttft_net_p95": 0.75,
        "new_chat_done_p50": 4.0,
        "new_chat_done_p95": 5.0,
        "new_chat_done_net_p50": 2.0,
        "new_chat_done_net_p95": 2.5,
        "running_worst_gap_net_median": 0.327,
        "running_worst_gap_net": 0.327,
        "running_overlapped": 1,
        "batch_done_median": 20.0,
        "batch_done_net_median": 18.2,
    }
    row = proxy_row(**values)
    cells = [c.strip() for c in row.split("|")[1:-1]]
    assert cells == [
        ARM["proxy"].name,
        "500 ms / 3.00 s",
        "250 ms / 750 ms",
        "4.00 s / 5.00 s",
        "2.00 s / 2.50 s",
        "200 ms (500 ms)",
        "327 ms (327 ms; 1 of 3)",
        "20.00 s (18.20 s)",
        "2.00 s / 3.00 s",
        "20/20",
    ]


# -- report and load --------------------------------------------------------------------


def four_arms() -> list[ArmResult]:
    results = []
    for key, factor, queue_ms in (
        ("fcfs", 6.0, None),
        ("priority", 2.0, None),
        ("budget512", 1.5, None),
        ("proxy", 1.0, 3.5),
    ):
        reps = [
            rep(
                key,
                i,
                new_ttft=0.2 * factor * (1 + i / 10),
                running_gap=0.3,
                batch_ttft=2.0,
                queue_ms=queue_ms,
                # a stop over the running gap in repetition 1, after it in the others
                stops=[(in_gap if i == 1 else away)(i, 0.1 * (i + 1))],
                set_aside=(i == 2),
            )
            for i in range(4)
        ]
        results.append(ArmResult(ARM[key], f"serve {key}", 10.0 + factor, 2**31, reps))
    return results


def test_a_report_and_its_records_read_back_to_the_same_summaries(tmp_path: Path) -> None:
    results = four_arms()
    write_records(results, tmp_path)
    summaries, checks = report(results, {"repeats": 3}, tmp_path)
    assert [s["arm"] for s in summaries] == ["fcfs", "priority", "budget512", "proxy"]
    assert len(checks) == 9
    assert all(c.met for c in checks), [c for c in checks if not c.met]

    # the stops matter to the summaries: warm repetition 1's 0.31 s gap is over a 0.2 s
    # stop (0.11 s net), 3's is not (its stop comes after the stream)
    assert summaries[0]["running_worst_gap"] == pytest.approx(0.31)
    assert summaries[0]["running_worst_gap_median"] == pytest.approx(0.31)
    assert summaries[0]["running_worst_gap_net"] == pytest.approx(0.31)
    assert summaries[0]["running_worst_gap_net_median"] == pytest.approx((0.11 + 0.31) / 2)

    loaded, meta = load(tmp_path)
    assert meta["repeats"] == 3
    assert meta["checks"] == [c.__dict__ for c in checks]
    assert [summarize(r) for r in loaded] == summaries
    for before, after in zip(results, loaded, strict=True):
        assert after.arm == before.arm
        assert after.peak_rss_bytes == before.peak_rss_bytes
        assert [(r.index, r.set_aside, r.stall_spans) for r in after.repetitions] == [
            (r.index, r.set_aside, r.stall_spans) for r in before.repetitions
        ]
        assert [r.records for r in after.repetitions] == [r.records for r in before.repetitions]


def test_records_without_stall_spans_load_with_no_stops(tmp_path: Path) -> None:
    results = four_arms()
    write_records(results, tmp_path)
    report(results, {"repeats": 3}, tmp_path)
    records = tmp_path / "records.jsonl"
    rows = [json.loads(line) for line in records.read_text().splitlines()]
    for row in rows:
        del row["stall_spans"]
    records.write_text("".join(json.dumps(row) + "\n" for row in rows))
    loaded, _ = load(tmp_path)
    assert all(r.stall_spans == [] for result in loaded for r in result.repetitions)
    s = summarize(loaded[0])
    # with no stops known, the net values are the raw ones
    assert s["running_worst_gap_net"] == s["running_worst_gap"]
    assert s["running_worst_gap_net_median"] == s["running_worst_gap_median"]


def test_a_report_of_a_report_only_run_writes_the_same_files(tmp_path: Path) -> None:
    results = four_arms()
    write_records(results, tmp_path)
    report(results, {"repeats": 3}, tmp_path)
    first = ((tmp_path / "summary.json").read_text(), (tmp_path / "table.md").read_text())
    report(*load(tmp_path), tmp_path)
    assert ((tmp_path / "summary.json").read_text(), (tmp_path / "table.md").read_text()) == first


def test_the_report_files_hold_the_summaries_the_table_and_the_verdict(tmp_path: Path) -> None:
    results = four_arms()
    summaries, _ = report(results, {"repeats": 3}, tmp_path)
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["arms"] == summaries
    text = (tmp_path / "table.md").read_text()
    assert text.startswith(table(summaries) + "\n\n")
    assert "- new chat TTFT p95: fcfs / proxy = 6.0x (bar > 5x): met" in text
    assert "- valid answers, all arms: 40 of 40: met" in text


def test_a_report_of_some_arms_has_no_verdict(tmp_path: Path) -> None:
    summaries, checks = report(four_arms()[:2], {}, tmp_path)
    assert len(summaries) == 2
    assert checks == []
    assert json.loads((tmp_path / "summary.json").read_text())["meta"]["checks"] == []
