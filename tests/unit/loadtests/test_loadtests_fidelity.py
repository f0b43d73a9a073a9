"""The simulator's fidelity check (loadtests.compare.fidelity): each comparison arm's engine
flags, the replay of a run's warm repetitions, and the error of simulated against real
time to first token."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from loadtests.compare.fidelity import BAR, Row, arm_for, compare, read_records, table
from loadtests.sim.profile import load_profile
from loadtests.sim.queues import SchedulingPolicy
from loadtests.sim.replay import ScriptedRequest, replay
from proxy.scheduler import TrafficClass

Json = dict[str, Any]
INTERACTIVE, BATCH = TrafficClass.INTERACTIVE, TrafficClass.BATCH
PROFILE = load_profile("vllm-cpu-tiny")

# -- arm_for ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("key", "policy", "budget", "threshold", "through_proxy"),
    [
        ("fcfs", SchedulingPolicy.FCFS, 2048, 0, False),
        ("priority", SchedulingPolicy.PRIORITY, 2048, 0, False),
        ("budget512", SchedulingPolicy.FCFS, 512, 0, False),
        ("proxy", SchedulingPolicy.FCFS, 2048, 256, True),
    ],
)
def test_each_arm_has_its_engine_flags(
    key: str, policy: SchedulingPolicy, budget: int, threshold: int, through_proxy: bool
) -> None:
    arm = arm_for(key, PROFILE)
    assert arm.name == key
    assert arm.config.scheduling_policy is policy
    assert arm.config.max_num_batched_tokens == budget
    assert arm.config.long_prefill_token_threshold == threshold
    assert arm.through_proxy is through_proxy
    # everything else is the profile's (vLLM's defaults on the fitted machine)
    assert arm.config.enable_chunked_prefill
    assert arm.config.max_model_len == PROFILE.engine.max_model_len
    assert arm.config.block_size == PROFILE.engine.block_size


def test_the_profiles_default_budget_is_vllms_2048_tokens() -> None:
    # the table above relies on it: FCFS is vLLM's default, 2,048-token steps
    assert PROFILE.engine.max_num_batched_tokens == 2048


def test_an_unknown_arm_is_refused() -> None:
    with pytest.raises(ValueError, match="no arm 'fifo'"):
        arm_for("fifo", PROFILE)


# -- Row --------------------------------------------------------------------------------


def row(real_p50: float, sim_p50: float, real_p95: float, sim_p95: float) -> Row:
    return Row(
        "fcfs",
        INTERACTIVE,
        real_p50,
        sim_p50,
        real_p95,
        sim_p95,
        samples=4,
        raw_p50=real_p50,
        raw_p95=real_p95,
    )


def test_the_errors_are_simulated_over_real_less_one() -> None:
    r = row(2.0, 2.5, 4.0, 3.0)
    assert r.error_p50 == pytest.approx(0.25)
    assert r.error_p95 == pytest.approx(-0.25)
    assert r.met


@pytest.mark.parametrize(
    ("sim_p50", "sim_p95", "met"),
    [
        (1.2, 1.2, True),
        (0.8, 0.8, True),
        (1.35, 1.0, False),  # p50 too slow
        (0.65, 1.0, False),  # p50 too fast
        (1.0, 1.35, False),  # p95 too slow
        (1.0, 0.65, False),  # p95 too fast
    ],
)
def test_a_row_is_met_when_both_errors_are_within_the_bar(
    sim_p50: float, sim_p95: float, met: bool
) -> None:
    assert BAR == 0.30
    assert row(1.0, sim_p50, 1.0, sim_p95).met is met


# -- compare ----------------------------------------------------------------------------


def request(
    arm: str,
    repetition: int,
    kind: str,
    n: int,
    *,
    at: float,
    prompt: int,
    answer: int,
    ttft: float | None,
    cold: bool = False,
    set_aside: bool = False,
) -> Json:
    """A records.jsonl row, with the fields fidelity reads."""
    return {
        "arm": arm,
        "repetition": repetition,
        "cold": cold,
        "set_aside": set_aside,
        "id": f"{arm}-{repetition}-{kind}-{n}",
        "kind": kind,
        "sent_at": at,
        "prompt_tokens": prompt,
        "max_tokens": answer,
        "ttft": ttft,
    }


def repetition(
    arm: str, index: int, *, chat_ttft: float | None, batch_ttft: float, **flags: bool
) -> list[Json]:
    """A short chat alone, then a 1,000-token batch prompt a second later (after the
    chat has finished), sent at ``1000 * index`` s on the monotonic clock."""
    start = 1000.0 * index
    return [
        request(arm, index, "new", 0, at=start, prompt=60, answer=16, ttft=chat_ttft, **flags),
        request(
            arm, index, "batch", 0, at=start + 1.0, prompt=1000, answer=8, ttft=batch_ttft, **flags
        ),
    ]


def the_script() -> list[ScriptedRequest]:
    """What :func:`repetition` replays as, offsets from its first request."""
    return [
        ScriptedRequest(id="c", at_s=0.0, cls=INTERACTIVE, prompt_tokens=60, max_tokens=16),
        ScriptedRequest(id="b", at_s=1.0, cls=BATCH, prompt_tokens=1000, max_tokens=8),
    ]


def replayed_ttfts(arm: str) -> tuple[float, float]:
    chat, batch = replay(the_script(), arm_for(arm, PROFILE), PROFILE.step)
    assert chat.ttft_s is not None and batch.ttft_s is not None
    return chat.ttft_s, batch.ttft_s


def fcfs_run() -> list[Json]:
    return [
        *repetition("fcfs", 0, chat_ttft=9.0, batch_ttft=9.0, cold=True),
        *repetition("fcfs", 1, chat_ttft=0.020, batch_ttft=0.20),
        *repetition("fcfs", 2, chat_ttft=0.030, batch_ttft=0.25),
        *repetition("fcfs", 3, chat_ttft=7.0, batch_ttft=7.0, set_aside=True),
    ]


def test_compare_sets_the_real_ttft_beside_the_replayed_one_per_arm_and_class() -> None:
    rows = compare(fcfs_run(), PROFILE)
    assert [(r.arm, r.cls, r.samples) for r in rows] == [
        ("fcfs", INTERACTIVE, 2),
        ("fcfs", BATCH, 2),
    ]
    chat, batch = rows
    sim_chat, sim_batch = replayed_ttfts("fcfs")
    # real: nearest rank over the two warm repetitions (cold and set-aside left out)
    assert (chat.real_p50, chat.real_p95) == (0.020, 0.030)
    assert (batch.real_p50, batch.real_p95) == (0.20, 0.25)
    # simulated: both repetitions replay the same script, so one value each
    assert chat.sim_p50 == chat.sim_p95 == sim_chat
    assert batch.sim_p50 == batch.sim_p95 == sim_batch
    assert chat.error_p50 == pytest.approx(sim_chat / 0.020 - 1)
    assert chat.error_p95 == pytest.approx(sim_chat / 0.030 - 1)
    assert batch.error_p95 == pytest.approx(sim_batch / 0.25 - 1)


def test_a_lone_chats_simulated_ttft_is_its_short_prefill() -> None:
    sim_chat, sim_batch = replayed_ttfts("fcfs")
    # one step: 4.6 ms fixed + 60 tokens at 0.145 ms each, about 13 ms
    assert 0.005 < sim_chat < 0.05
    # a lone 1,000-token prompt: one step of about 0.25 s, far longer than the chat's
    assert 0.1 < sim_batch < 0.5
    assert sim_batch > 5 * sim_chat


def test_compare_offsets_each_repetition_from_its_own_first_request() -> None:
    early = compare(fcfs_run(), PROFILE)
    # the same repetitions, sent a day later on the monotonic clock
    later = [{**r, "sent_at": r["sent_at"] + 86_400.0} for r in fcfs_run()]
    assert compare(later, PROFILE) == early


def test_compare_gives_each_arm_its_own_replay() -> None:
    records = [
        *repetition("fcfs", 1, chat_ttft=0.02, batch_ttft=0.2),
        *repetition("proxy", 1, chat_ttft=0.03, batch_ttft=0.3),
    ]
    rows = compare(records, PROFILE)
    assert [(r.arm, r.cls) for r in rows] == [
        ("fcfs", INTERACTIVE),
        ("fcfs", BATCH),
        ("proxy", INTERACTIVE),
        ("proxy", BATCH),
    ]
    proxy_chat, proxy_batch = replayed_ttfts("proxy")
    assert (rows[2].real_p50, rows[2].sim_p50) == (0.03, proxy_chat)
    assert (rows[3].real_p50, rows[3].sim_p50) == (0.3, proxy_batch)
    assert proxy_chat > 0


def test_the_running_chat_counts_as_interactive() -> None:
    records = repetition("fcfs", 1, chat_ttft=0.02, batch_ttft=0.2)
    records[0] = {**records[0], "kind": "running"}
    assert [r.cls for r in compare(records, PROFILE)] == [INTERACTIVE, BATCH]


def test_a_request_with_no_real_first_token_is_left_out_of_both_sides() -> None:
    records = [
        *repetition("fcfs", 1, chat_ttft=0.02, batch_ttft=0.2),
        *repetition("fcfs", 2, chat_ttft=None, batch_ttft=0.3),
    ]
    chat, batch = compare(records, PROFILE)
    assert (chat.samples, chat.real_p95) == (1, 0.02)
    assert (batch.samples, batch.real_p95) == (2, 0.3)


def test_only_cold_or_set_aside_repetitions_give_no_rows() -> None:
    records = [
        *repetition("fcfs", 0, chat_ttft=0.02, batch_ttft=0.2, cold=True),
        *repetition("fcfs", 1, chat_ttft=0.02, batch_ttft=0.2, set_aside=True),
    ]
    assert compare(records, PROFILE) == []


def test_records_are_read_one_json_object_a_line(tmp_path: Path) -> None:
    path = tmp_path / "records.jsonl"
    path.write_text('{"a": 1}\n\n{"b": [2]}\n')
    assert read_records(path) == [{"a": 1}, {"b": [2]}]


def test_the_table_has_one_row_per_arm_and_class_and_says_if_it_is_met() -> None:
    lines = table([row(2.0, 2.5, 4.0, 3.0), row(0.5, 1.0, 1.0, 1.0)]).splitlines()
    assert len(lines) == 4
    assert lines[2] == (
        "| fcfs | interactive (4) | 2.00 s / 2.50 s | +25% | 4.00 s / 3.00 s | -25% | yes "
        "| 2.00 s / 4.00 s |"
    )
    assert lines[3].endswith("| +100% | 1.00 s / 1.00 s | +0% | NO | 500 ms / 1.00 s |")
