"""Scripted replays on the simulated engine, in virtual time (loadtests.sim.replay).

The benchmark script is the real-vLLM one: a chat stream running, eight 5,300-token
batch prompts at once, three short chats over the next 1.5 s. With the profile
fitted to vLLM-CPU (vllm-cpu-tiny) one such prompt takes ~2.2 s to prefill, so a
chat queued behind all eight waits well over 5 s.
"""

from __future__ import annotations

import itertools

import pytest

from loadtests.sim.profile import load_profile
from loadtests.sim.replay import (
    ReplayArm,
    ReplayedRequest,
    ScriptedRequest,
    replay,
    ttft_percentiles,
)
from loadtests.sim.settings import scheduler_config
from proxy.config import EngineConfig
from proxy.scheduler import TrafficClass

INTERACTIVE, BATCH = TrafficClass.INTERACTIVE, TrafficClass.BATCH
PROFILE = load_profile("vllm-cpu-tiny")
COST = PROFILE.step

FCFS = ReplayArm(name="direct, FCFS", config=scheduler_config(PROFILE))
PRIORITY = ReplayArm(
    name="direct, priority", config=scheduler_config(PROFILE, scheduling_policy="priority")
)
SMALL_BUDGET = ReplayArm(
    name="direct, 512-token budget", config=scheduler_config(PROFILE, max_num_batched_tokens=512)
)
PROXY = ReplayArm(
    name="through the proxy",
    config=scheduler_config(PROFILE, long_prefill_token_threshold=256),
    through_proxy=True,
)
ARMS = [FCFS, PRIORITY, SMALL_BUDGET, PROXY]


def request(rid: str, at_s: float, cls: TrafficClass, prompt: int, answer: int) -> ScriptedRequest:
    return ScriptedRequest(id=rid, at_s=at_s, cls=cls, prompt_tokens=prompt, max_tokens=answer)


def benchmark_script() -> list[ScriptedRequest]:
    script = [request("stream", 0.0, INTERACTIVE, 50, 300)]
    script += [request(f"batch-{i}", 0.2, BATCH, 5300, 16) for i in range(8)]
    script += [request(f"chat-{i}", 0.3 + 0.5 * i, INTERACTIVE, 60, 32) for i in range(3)]
    return script


def new_chat_ttfts(results: list[ReplayedRequest]) -> list[float]:
    return [r.ttft_s for r in results if r.id.startswith("chat-") and r.ttft_s is not None]


@pytest.mark.parametrize("arm", [FCFS, PRIORITY, PROXY], ids=lambda a: a.name)
def test_a_lone_chat_gets_its_first_token_one_prefill_step_after_arrival(arm: ReplayArm) -> None:
    n = 40
    (result,) = replay([request("chat", 0.25, INTERACTIVE, n, 3)], arm, COST)

    prefill_step = (
        COST.fixed_s
        + COST.prefill_per_token_s * n
        + COST.prefill_attention_per_token_context_s * n * (n / 2)
    )
    decode_step = (
        COST.fixed_s
        + COST.decode_step_overhead_s
        + COST.decode_per_token_s
        + COST.decode_per_context_token_s * (n + 1)
    )
    assert result.first_token_s == pytest.approx(0.25 + prefill_step, rel=1e-12)
    assert result.ttft_s == pytest.approx(prefill_step, rel=1e-12)
    assert result.token_times[1] - result.token_times[0] == pytest.approx(decode_step, rel=1e-9)


def test_prompts_of_the_same_size_share_no_cached_blocks() -> None:
    n = 1000  # one step under the 2,048-token budget; 7 full blocks of 128 tokens
    script = [request("a", 0.0, BATCH, n, 1), request("b", 5.0, BATCH, n, 1)]
    first, second = replay(script, FCFS, COST)

    full_prefill = (
        COST.fixed_s
        + COST.prefill_per_token_s * n
        + COST.prefill_attention_per_token_context_s * n * (n / 2)
    )
    assert first.ttft_s == pytest.approx(full_prefill, rel=1e-12)
    assert second.ttft_s == pytest.approx(full_prefill, rel=1e-12)


def test_under_fcfs_a_new_chat_waits_behind_the_batch_prompts() -> None:
    fcfs = new_chat_ttfts(replay(benchmark_script(), FCFS, COST))
    assert len(fcfs) == 3
    assert min(fcfs) > 5.0


def test_engine_priority_lets_a_new_chat_in_much_sooner() -> None:
    fcfs_p50, _ = ttft_percentiles(replay(benchmark_script(), FCFS, COST), INTERACTIVE)
    prio = new_chat_ttfts(replay(benchmark_script(), PRIORITY, COST))
    # it still waits for the batch prompt in prefill when it arrives (~2.2 s here)
    assert max(prio) < 3.0
    assert max(prio) < min(new_chat_ttfts(replay(benchmark_script(), FCFS, COST))) / 4
    assert max(prio) < fcfs_p50


def test_through_the_proxy_a_new_chat_is_far_faster_than_direct_fcfs() -> None:
    fcfs = new_chat_ttfts(replay(benchmark_script(), FCFS, COST))
    proxied = new_chat_ttfts(replay(benchmark_script(), PROXY, COST))
    assert max(proxied) < min(fcfs) / 20


@pytest.mark.parametrize("arm", ARMS, ids=lambda a: a.name)
def test_every_request_gets_exactly_max_tokens_tokens(arm: ReplayArm) -> None:
    script = benchmark_script()
    results = replay(script, arm, COST)

    for s, r in zip(script, results, strict=True):
        assert len(r.token_times) == s.max_tokens
        assert r.token_times[0] == r.first_token_s
        assert r.token_times[-1] == r.finished_s
        assert all(a < b for a, b in itertools.pairwise(r.token_times))
        assert r.token_times[0] > s.at_s


@pytest.mark.parametrize("arm", [FCFS, PROXY], ids=lambda a: a.name)
def test_replays_are_deterministic(arm: ReplayArm) -> None:
    script = benchmark_script()
    first = replay(script, arm, COST)
    assert replay(script, arm, COST) == first
    # the prompts' content changes, not their timing: cost depends on counts only
    assert replay(script, arm, COST, seed=7) == first


@pytest.mark.parametrize("arm", [FCFS, PROXY], ids=lambda a: a.name)
def test_results_come_in_script_order(arm: ReplayArm) -> None:
    script = [
        request("late", 2.0, INTERACTIVE, 30, 2),
        request("early", 0.0, BATCH, 3000, 2),
        request("middle", 1.0, INTERACTIVE, 20, 2),
    ]
    results = replay(script, arm, COST)
    assert [(r.id, r.cls, r.at_s) for r in results] == [(s.id, s.cls, s.at_s) for s in script]


def test_a_class_may_be_given_by_name() -> None:
    assert request("a", 0.0, "batch", 10, 1).cls is BATCH  # type: ignore[arg-type]


def test_duplicate_ids_are_rejected() -> None:
    script = [request("same", 0.0, INTERACTIVE, 10, 1), request("same", 1.0, BATCH, 10, 1)]
    with pytest.raises(ValueError, match="duplicate"):
        replay(script, FCFS, COST)


@pytest.mark.parametrize(
    ("rid", "at_s", "cls", "prompt", "answer"),
    [
        ("", 0.0, "interactive", 10, 1),  # no id
        ("x", 0.0, "chat", 10, 1),  # unknown class
        ("x", -1.0, "batch", 10, 1),
        ("x", float("nan"), "batch", 10, 1),
        ("x", 0.0, "batch", 0, 1),
        ("x", 0.0, "batch", 10, 0),
    ],
)
def test_malformed_scripted_requests_are_rejected(
    rid: str, at_s: float, cls: str, prompt: int, answer: int
) -> None:
    with pytest.raises(ValueError):
        request(rid, at_s, cls, prompt, answer)  # type: ignore[arg-type]


def test_a_request_beyond_max_model_len_is_rejected() -> None:
    too_long = request("x", 0.0, BATCH, 8000, 193)  # 8,193 > 8,192
    with pytest.raises(ValueError, match="max_model_len"):
        replay([too_long], FCFS, COST)
    (fits,) = replay([request("x", 0.0, BATCH, 8000, 192)], FCFS, COST)
    assert len(fits.token_times) == 192


def test_a_proxy_engine_that_does_not_serve_the_model_is_rejected() -> None:
    other = EngineConfig(name="engine-0", models=frozenset({"other"}))
    arm = ReplayArm(name="proxy", config=PROXY.config, through_proxy=True, proxy_engine=other)
    with pytest.raises(ValueError, match="does not serve"):
        replay([request("x", 0.0, INTERACTIVE, 10, 1)], arm, COST, model="tiny")


def test_a_scrape_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="scrape_interval_s"):
        ReplayArm(name="proxy", config=PROXY.config, through_proxy=True, scrape_interval_s=0)


def test_ttft_percentiles_are_nearest_rank_over_one_class() -> None:
    results = [
        ReplayedRequest(f"i{k}", INTERACTIVE, 1.0, 1.0 + k / 10, 5.0, (1.0 + k / 10,))
        for k in range(1, 11)
    ]
    results.append(ReplayedRequest("b", BATCH, 0.0, 100.0, 200.0, (100.0,)))
    results.append(ReplayedRequest("never", INTERACTIVE, 0.0, None, None, ()))

    p50, p95 = ttft_percentiles(results, INTERACTIVE)
    assert p50 == pytest.approx(0.5)
    assert p95 == pytest.approx(1.0)
    assert ttft_percentiles(results, BATCH) == (100.0, 100.0)
    with pytest.raises(ValueError):
        ttft_percentiles(results[-1:], INTERACTIVE)
