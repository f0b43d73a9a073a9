"""``whoseturn probe`` against real simulated engines: chunked prefill on, then off.

The simulated engine runs the cpu-tiny cost model (5 ms decode steps, 0.2 ms per
prompt token) twice as fast as real time, with a 4,096-token context: the probe's
default sizes are 128 ... 2,048 and 4,032 tokens. With a 512-token step budget
(one decode beside a 511-token chunk) the stalls level off at ~54 ms past ~511
tokens; without chunked prefill they grow ~100 ms per 1k tokens all the way.
"""

from __future__ import annotations

import json

import pytest

from loadtests.probe import ProbeConfig, Verdict, run_probe
from loadtests.sim.profile import load_profile
from loadtests.sim.settings import SimSettings, scheduler_config
from proxy.cli import main

from .simserver import MODEL, run_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]

TIME_SCALE = 2.0
CONTEXT = 4096


def settings(*, max_num_batched_tokens: int | None = None, chunked: bool = True) -> SimSettings:
    profile = load_profile("cpu-tiny")
    config = scheduler_config(
        profile,
        max_model_len=CONTEXT,
        max_num_batched_tokens=max_num_batched_tokens,
        enable_chunked_prefill=chunked,
    )
    return SimSettings(
        profile=profile, scheduler=config, served_model_name=MODEL, time_scale=TIME_SCALE
    )


@pytest.mark.anyio
async def test_chunked_prefill_interleaves_with_a_chunk_near_the_budget() -> None:
    with run_server(settings(max_num_batched_tokens=512)) as sim:
        result = await run_probe(ProbeConfig(engine_url=sim.base_url))
    a = result.analysis
    assert a.verdict is Verdict.INTERLEAVES, a.reason
    assert a.chunk_tokens is not None and 400 <= a.chunk_tokens <= 640
    # One step of 511 prompt tokens and a decode: 4.5 + 0.5 + 102.2 ms, at 2x.
    assert a.stall_level_s == pytest.approx(0.1072 / TIME_SCALE, rel=0.2)
    assert a.prefill_s_per_token == pytest.approx(0.0002 / TIME_SCALE, rel=0.25)
    # The 4,032-token prompt took 8 steps of 511 tokens (the last one 455).
    assert a.top.prefill_steps == 8
    assert len(result.injections) >= 3 * 6


def test_whole_prefills_serialize(capsys: pytest.CaptureFixture[str]) -> None:
    with run_server(settings(chunked=False)) as sim:
        code = main(["--log-level", "warning", "probe", "--engine", sim.base_url, "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    assert report["verdict"] == "serializes", report["reason"]
    assert report["chunk_tokens"] is None
    assert report["prefill_ms_per_1k_tokens"] == pytest.approx(200 / TIME_SCALE, rel=0.25)
    assert report["table"][-1]["prompt_tokens"] == CONTEXT - 64
    assert report["table"][-1]["median_prefill_steps"] == 1
    assert report["summary"].startswith(f"engine at {sim.base_url} serializes")
