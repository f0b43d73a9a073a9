"""Two proxy replicas in front of the same two simulated engines, as real processes.

With the shared ledger (a real PostgreSQL), each engine's batch prompt tokens in
prefill, as the engine itself counts them, never exceed its budget; without it, two
replicas break the budget (the reason the ledger exists). A replica killed in the
middle of the work leaves no budget behind: once its lease runs out, the survivor
counts none of its tokens. Timing claims live in ``python -m loadtests.bench.replicas``.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

import httpx
import pytest

from loadtests.bench.replicas import Plan, Server, engine_peaks, engines, proxies, run_load
from tests.support.polling import wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

# Two prompts fill the budget; 12 workers keep every replica's queue full.
PLAN = Plan(budget=400, batch_prompt=200, duration_s=5.0, lease_s=1.0)
OTHERS = "whoseturn_replicas_batch_prefill_tokens"


def others_tokens(replica: Server) -> float:
    text = httpx.get(replica.url + "/metrics", timeout=5).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(OTHERS)
    )


def test_with_the_ledger_the_budget_holds_across_replicas(postgres_db: str, tmp_path: Path) -> None:
    with (
        engines(PLAN) as sims,
        proxies(PLAN, [s.url for s in sims], 2, postgres_db, tmp_path) as reps,
    ):
        tally, _, _ = asyncio.run(run_load(PLAN, reps))
        peaks = engine_peaks(sims)
    assert len(tally.batch_done) > 10 and tally.errors == 0
    assert {r for _, r in tally.batch_done} == {0, 1}, "both replicas sent batch work"
    assert max(peaks) <= PLAN.budget, f"engines held {peaks} batch tokens in prefill"


def test_without_the_ledger_two_replicas_break_the_budget(tmp_path: Path) -> None:
    with engines(PLAN) as sims, proxies(PLAN, [s.url for s in sims], 2, None, tmp_path) as reps:
        asyncio.run(run_load(PLAN, reps))
        peaks = engine_peaks(sims)
    assert max(peaks) > PLAN.budget, f"uncoordinated replicas stayed within it: {peaks}"


def test_a_killed_replica_leaves_no_budget_stuck(postgres_db: str, tmp_path: Path) -> None:
    plan = Plan(budget=400, batch_prompt=200, duration_s=8.0, lease_s=1.0)
    with (
        engines(plan) as sims,
        proxies(plan, [s.url for s in sims], 2, postgres_db, tmp_path) as reps,
    ):
        survivor = reps[0]
        result: list[object] = []
        load = threading.Thread(
            target=lambda: result.append(asyncio.run(run_load(plan, reps, kill_at_s=4.0)))
        )
        load.start()
        seen_before = 0.0
        while reps[1].process.poll() is None and load.is_alive():
            seen_before = max(seen_before, others_tokens(survivor))
            time.sleep(0.05)
        wait_for(lambda: others_tokens(survivor) == 0, timeout=plan.lease_s * 5)
        time.sleep(plan.lease_s)
        after_lease = [others_tokens(survivor) for _ in range(5)]
        load.join()
        peaks = engine_peaks(sims)
    assert seen_before > 0, "the survivor never counted the other replica's tokens"
    assert after_lease == [0] * 5, "the dead replica's tokens still count"
    assert max(peaks) <= plan.budget
