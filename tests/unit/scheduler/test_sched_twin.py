"""The scheduler in front of the simulated engine, in virtual time (the twin).

One short mixed run, direct FCFS and through the proxy, on the same workload: the
proxy must cut chat TTFT p95 by a wide margin and keep most of the batch throughput.
The margins are wide on purpose (measured: ~25x lower TTFT p95, ~99% of the batch
docs); they catch a scheduler that stops protecting chat or stops admitting batch.
"""

from __future__ import annotations

from loadtests.sim.profile import load_profile
from loadtests.sim.settings import scheduler_config
from loadtests.sim.twin import MixedWorkload, run_direct, run_proxy
from proxy.config import EngineConfig
from proxy.scheduler import TrafficClass, Turn

WORKLOAD = MixedWorkload(duration_s=60, warmup_s=10, batch_concurrency=64)


def test_the_proxy_protects_chat_ttft_and_keeps_batch_throughput() -> None:
    profile = load_profile("h100-llama3-8b")
    config = scheduler_config(profile)
    settings = EngineConfig(name="engine-0", models=frozenset({profile.model}))

    direct = run_direct("direct", WORKLOAD, config, profile.step)
    proxied, scheduler = run_proxy("proxy", WORKLOAD, config, profile.step, settings)

    assert direct.chats == proxied.chats > 50
    assert proxied.ttft_p95 < direct.ttft_p95 / 5
    assert proxied.ttft_p50 < direct.ttft_p50 / 5
    assert proxied.batch_docs_per_hour >= 0.7 * direct.batch_docs_per_hour
    assert proxied.gap_p95 <= 1.5 * direct.gap_p95

    engine = scheduler.engines["engine-0"]
    # every chat finished (batch docs submitted near the end may still be held on the
    # last KV reading: the twin stops scraping the engine at the end of the workload)
    assert all(j.cls is TrafficClass.BATCH for j in scheduler.jobs.values())
    assert engine.turn_seconds[Turn.INTERACTIVE] > 0 and engine.turn_seconds[Turn.BATCH] > 0
    assert abs(sum(engine.turn_seconds.values()) - scheduler.clock.now()) < 1e-6
