"""The baseline comparison on real vLLM (``loadtests.compare.arms``), run once, in CI.

Four arms, each on its own fresh vLLM server: direct FCFS, direct with engine
priority, direct with 512-token steps, and through the proxy (``whoseturn serve`` in
its own process) with the engine flag the README recommends. The measured table and
the verdict on the bar of issue #5 go to the terminal summary and to
``artifacts/e2e/compare/``.

The assertions compare arms of the same run with margins wider than the bar (the
benchmark's own verdict reports the bar itself): two shared cores that now and then
stop for a second make a tail statistic of three repetitions noisy, while a proxy
that does not do its job misses these margins by an order of magnitude.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from loadtests.compare.arms import ARMS, render_verdict, run, table
from loadtests.support.vllm import READY_TIMEOUT_S, REPO

from .vllmserver import VllmFleet

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(len(ARMS) * (READY_TIMEOUT_S + 480))]

REPEATS = 2
# Warm repetitions run again, per arm, at most, when one's evidence is missing.
EXTRA_TRIES = 2
OUT = REPO / "artifacts" / "e2e" / "compare"


def test_the_proxy_beats_every_direct_arm_on_new_chat_latency(
    vllm_fleet: VllmFleet, measured: Callable[[str], None]
) -> None:
    # The fleet's servers would compete for the two cores: stop them first.
    vllm_fleet.stop_all()
    summaries, checks = run(REPEATS, OUT, extra_tries=EXTRA_TRIES)
    for line in (table(summaries) + "\n" + render_verdict(checks)).splitlines():
        measured(line)
    by = {s["arm"]: s for s in summaries}
    proxy = by["proxy"]
    assert all(s["valid"] == s["requests"] for s in summaries), "every answer whole"
    # The evidence must be there before it is compared: each arm's kept repetitions
    # ran the stream beside the whole of the batch's prefill (one that did not was
    # run again, up to the extra tries).
    for s in summaries:
        kept, overlapped = s["warm_repetitions"], s["running_overlapped"]
        assert overlapped == kept, (
            f"{s['arm']}: the running stream overlapped the batch's prefill in"
            f" {overlapped} of {kept} repetitions: no gap to compare"
        )
    # Net of the machine's own stops, as the harness's verdict (loadtests.compare.arms).
    for column in ("new_chat_ttft_net_p95", "new_chat_done_net_p95"):
        assert by["fcfs"][column] > 5 * proxy[column], column
        assert by["budget512"][column] > 2 * proxy[column], column
        assert by["priority"][column] > 1.5 * proxy[column], column
    gap = "running_worst_gap_net_median"
    assert proxy[gap] < 2 * by["budget512"][gap]
    # The batch's own cost of the proxy: the bar is 1.2x FCFS's makespan (the verdict
    # above reports it). Where the engine is slow enough that chat misses its TTFT
    # target whatever the budget (the AVX-only machine, float32: 1.51x on 2026-12-01
    # with other work on the cores), the budget sits at its floor; the margin still
    # catches a proxy that starves the batch. (Fewer documents there would shorten
    # the tier, but the new chats' done time through the proxy is set by the
    # engine's step, so FCFS's lead on it shrinks with the batch: 3.8x with four.)
    done = "batch_done_net_median"
    assert proxy[done] < 2.0 * by["fcfs"][done]
