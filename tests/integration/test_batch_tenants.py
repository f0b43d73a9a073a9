"""Batch jobs of different tenants share the engines by weight, over HTTP with the
official ``openai`` client, through the proxy in front of a simulated engine.

Two configured keys, tenants ``a`` (weight 1) and ``b`` (weight 2). The engine takes
at most ``BATCH_MAX_INFLIGHT`` batch lines at once and each job keeps ``WINDOW``
lines in the proxy, so the proxy's queue holds both tenants' lines and its fair
share decides whose line goes next.

- Two jobs submitted together: over the middle of the run (both jobs still
  running, both tenants' lines queued at every sample) ``b`` completes lines at
  1.5..2.7 times ``a``'s rate (the weights say 2).
- A ten-line job of ``b`` submitted once a 10,000-line job of ``a`` runs with its
  lines queued finishes in under a minute of simulated time (wall time times the
  engine's ``time_scale``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

import openai
import pytest
from openai.types import Batch

from .proxyserver import ProxyServer, engine, run_proxy
from .simserver import MODEL, run_server, sim_settings

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]
CHAT: Final = "/v1/chat/completions"
TIME_SCALE = 10.0
BATCH_MAX_INFLIGHT = 4
WINDOW = 32
KEYS = {"a": "key-tenant-a", "b": "key-tenant-b"}
WEIGHTS = {"a": 1, "b": 2}
RATIO_BOUNDS = (1.5, 2.7)
SHORT_JOB_SIM_S = 60.0


@dataclass
class Tenants:
    proxy: ProxyServer
    clients: dict[str, openai.OpenAI]

    def queued(self, tenant: str) -> float:
        """The tenant's batch lines queued in the proxy now (its metrics; none while
        the tenant has not been active)."""
        try:
            return self.proxy.metric("whoseturn_tenant_queued", tenant=tenant, **{"class": "batch"})
        except KeyError:
            return 0.0


@pytest.fixture
def tenants(tmp_path: Path) -> Iterator[Tenants]:
    keys = [{"key": KEYS[t], "tenant": t, "weight": WEIGHTS[t]} for t in KEYS]
    with (
        run_server(sim_settings(time_scale=TIME_SCALE)) as sim,
        run_proxy(
            [engine(sim.base_url, "sim-0", batch_max_inflight=BATCH_MAX_INFLIGHT)],
            api_keys=keys,
            batch_store_path=str(tmp_path / "batch.db"),
            batch_window=WINDOW,
            batch_max_file_bytes=50_000_000,
        ) as proxy,
    ):
        proxy.http.headers["Authorization"] = f"Bearer {KEYS['a']}"  # /metrics needs a key
        clients = {
            t: openai.OpenAI(base_url=f"{proxy.base_url}/v1", api_key=k, max_retries=0)
            for t, k in KEYS.items()
        }
        try:
            yield Tenants(proxy, clients)
        finally:
            for c in clients.values():
                c.close()


def submit(client: openai.OpenAI, prefix: str, lines: int, max_tokens: int) -> Batch:
    """A job of ``lines`` short chats (``max_tokens`` each) from ``client``'s tenant."""
    rows = (
        {
            "custom_id": f"{prefix}-{i}",
            "method": "POST",
            "url": CHAT,
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"{prefix} question {i}"}],
                "max_tokens": max_tokens,
            },
        }
        for i in range(lines)
    )
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    uploaded = client.files.create(file=(f"{prefix}.jsonl", data), purpose="batch")
    return client.batches.create(
        input_file_id=uploaded.id,
        endpoint=CHAT,
        completion_window="24h",
    )


def done(batch: Batch) -> int:
    counts = batch.request_counts
    return 0 if counts is None else counts.completed + counts.failed


def span(values: Iterable[float]) -> str:
    seen = list(values)
    return f"{min(seen):.0f}..{max(seen):.0f}"


@dataclass(frozen=True)
class Sample:
    t: float
    done: dict[str, int]
    status: dict[str, str]
    queued: dict[str, float]


def test_two_tenants_jobs_progress_at_the_ratio_of_their_weights(tenants: Tenants) -> None:
    lines = 1200
    jobs = {t: submit(tenants.clients[t], t, lines, max_tokens=64) for t in ("a", "b")}
    rows = tenants.proxy.http.get("/status/batches").json()["jobs"]
    assert {r["id"]: r["tenant"] for r in rows} == {jobs[t].id: t for t in jobs}
    samples: list[Sample] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        now = {t: tenants.clients[t].batches.retrieve(jobs[t].id) for t in jobs}
        queued = {t: tenants.queued(t) for t in jobs}
        samples.append(
            Sample(
                time.monotonic(),
                {t: done(b) for t, b in now.items()},
                {t: b.status for t, b in now.items()},
                queued,
            )
        )
        if any(b.status != "in_progress" and done(b) > 0 for b in now.values()):
            break  # the first job ended: the contended run is over
        time.sleep(0.25)
    running = [s for s in samples if all(x > 0 for x in s.done.values())]
    assert len(running) >= 8, f"too few samples with both jobs running: {samples[-3:]}"
    ended = next(
        (i for i, s in enumerate(running) if any(v != "in_progress" for v in s.status.values())),
        len(running),
    )
    both = running[:ended]
    middle = both[len(both) // 4 : len(both) * 3 // 4 + 1]
    first, last = middle[0], middle[-1]
    rates = {t: (last.done[t] - first.done[t]) / (last.t - first.t) for t in jobs}
    ratio = rates["b"] / rates["a"] if rates["a"] else float("inf")
    print(
        f"\nmiddle window {last.t - first.t:.1f} s wall over {len(middle)} samples: "
        f"a {rates['a']:.1f} lines/s, b {rates['b']:.1f} lines/s, ratio b/a {ratio:.2f} "
        f"(weights 2); lines queued in the proxy: a {span(s.queued['a'] for s in middle)}, "
        f"b {span(s.queued['b'] for s in middle)}"
    )
    backlogged = all(s.queued["a"] > 0 and s.queued["b"] > 0 for s in middle)
    assert backlogged, (
        "no evidence: both tenants did not have lines queued in the proxy at every "
        "sample of the window measured, so the ratio says nothing of the fair share"
    )
    assert all(s.status == {"a": "in_progress", "b": "in_progress"} for s in middle)
    assert RATIO_BOUNDS[0] <= ratio <= RATIO_BOUNDS[1], ratio


def test_a_short_job_after_a_long_one_of_another_tenant_ends_within_a_simulated_minute(
    tenants: Tenants,
) -> None:
    long = submit(tenants.clients["a"], "a", 10_000, max_tokens=64)
    deadline = time.monotonic() + 60
    while True:  # a runs, its lines queued in the proxy beside the engine's
        running = tenants.clients["a"].batches.retrieve(long.id)
        if done(running) > 0 and tenants.queued("a") > 0:
            break
        assert time.monotonic() < deadline, f"the long job did not start: {running.status}"
        time.sleep(0.05)
    short = submit(tenants.clients["b"], "b", 10, max_tokens=64)
    submitted = time.monotonic()
    queued_a: list[float] = []
    while True:
        found = tenants.clients["b"].batches.retrieve(short.id)
        if found.status not in ("validating", "in_progress", "finalizing"):
            break
        queued_a.append(tenants.queued("a"))
        assert time.monotonic() - submitted < 120, f"the short job is still {found.status}"
        time.sleep(0.05)
    wall_s = time.monotonic() - submitted
    sim_s = wall_s * TIME_SCALE
    long_now = tenants.clients["a"].batches.retrieve(long.id)
    print(
        f"\nten-line job of b: {wall_s:.2f} s wall = {sim_s:.1f} s simulated "
        f"(time scale {TIME_SCALE:g}); the 10,000-line job of a meanwhile "
        f"{done(running)} -> {done(long_now)} lines, its lines queued in the proxy "
        f"{span(queued_a or [0])}"
    )
    assert found.status == "completed" and found.request_counts is not None
    assert found.request_counts.completed == 10
    assert long_now.status == "in_progress" and queued_a and min(queued_a) > 0, (
        "no evidence: the long job was not backlogged in the proxy while the short one ran"
    )
    assert sim_s < SHORT_JOB_SIM_S, f"{sim_s:.1f} s simulated"
    tenants.clients["a"].batches.cancel(long.id)
