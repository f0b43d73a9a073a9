"""Calibration's pure parts: the fit recovers a cost model from measurements that the
simulated engine itself produced (in virtual time), with and without noise; the plan;
the report and the profile file. (Token-time reductions: ``test_sim_calibrate_token_times``;
the engine's clock: ``test_sim_calibrate_wire``.)"""

from __future__ import annotations

import random
from collections import defaultdict
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml

from loadtests.engine_io import EngineInfo
from loadtests.probe.calibrate import Kind, Measurement
from loadtests.probe.calibrate.cost_fit import OVERHEAD, fit, lstsq
from loadtests.probe.calibrate.measure import Plan
from loadtests.probe.calibrate.profile_report import profile_file, report, residual_summary
from loadtests.probe.calibrate.token_times import (
    median_of,
    prefill_steps,
    stall_step,
    steady_gap,
)
from loadtests.sim.profile import StepCost, load_profile
from loadtests.sim.step_loop import SimEngine, StepResult
from loadtests.sim.step_scheduler import SchedulerConfig
from loadtests.sim.virtual import VirtualRunner
from proxy.clock import VirtualClock

from .helpers import unique_prompt

BUDGET = 512
REQUEST_OVERHEAD = 0.003
CONFIG = SchedulerConfig(max_num_batched_tokens=BUDGET, max_model_len=8192, num_gpu_blocks=16384)
FULL = StepCost(
    fixed_s=0.0045,
    prefill_per_token_s=0.0002,
    decode_per_token_s=0.0005,
    prefill_attention_per_token_context_s=2e-9,
    decode_per_context_token_s=4e-8,
    decode_step_overhead_s=0.0007,
)
PLAN = Plan(budget=BUDGET).within(CONFIG.max_model_len)


# -- synthetic measurements: the simulated engine in virtual time ----------------------


def _runner(cost: StepCost, config: SchedulerConfig) -> VirtualRunner:
    clock = VirtualClock()
    return VirtualRunner(SimEngine(config, cost, clock), clock)


def _token_times(runner: VirtualRunner) -> dict[str, list[float]]:
    times: dict[str, list[float]] = defaultdict(list)

    def record(_: SimEngine, result: StepResult) -> None:
        for event in result.tokens:
            times[event.request.request_id].append(event.time)

    runner.listeners.append(record)
    return times


def sim_prefill(cost: StepCost, config: SchedulerConfig, prompt: int) -> Measurement:
    """TTFT of a prompt alone on an idle engine, plus a request overhead."""
    runner = _runner(cost, config)
    box = runner.submit_at(0.0, unique_prompt(prompt), 1)
    runner.run()
    first = box[0].first_token_time
    assert first is not None
    return Measurement(
        kind=Kind.PREFILL,
        seconds=first + REQUEST_OVERHEAD,
        prompt_tokens=prompt,
        prefill_steps=prefill_steps(prompt, config.max_num_batched_tokens),
    )


def sim_decode(cost: StepCost, config: SchedulerConfig, batch: int, prompt: int) -> Measurement:
    """``batch`` streams started together, as ``measure`` starts them."""
    runner = _runner(cost, config)
    times = _token_times(runner)
    ramp = -(-batch * prompt // config.max_num_batched_tokens) + 1
    max_tokens = PLAN.skip_tokens + PLAN.decode_window + ramp + 1
    for i in range(batch):
        runner.submit_at(0.0, unique_prompt(prompt), max_tokens, request_id=f"d{i}")
    runner.run()
    gap, context = steady_gap(list(times.values()), [prompt] * batch, skip=PLAN.skip_tokens)
    return Measurement(
        kind=Kind.DECODE, seconds=gap, prompt_tokens=prompt, batch=batch, context_tokens=context
    )


def sim_mixed(cost: StepCost, config: SchedulerConfig, prompt: int) -> Measurement:
    """A prefill arriving mid-step beside one decode stream; the stall it causes."""
    runner = _runner(cost, config)
    times = _token_times(runner)
    runner.submit_at(0.0, unique_prompt(16), 40, request_id="decode")
    box = runner.submit_at(0.0601, unique_prompt(prompt), 1, request_id="prefill")
    runner.run()
    first = box[0].first_token_time
    assert first is not None
    j, stall = stall_step(times["decode"], first)
    return Measurement(
        kind=Kind.MIXED, seconds=stall, prompt_tokens=prompt, batch=1, context_tokens=16 + j
    )


def simulated(cost: StepCost, config: SchedulerConfig = CONFIG) -> list[Measurement]:
    """Every measurement of the default plan, taken from the simulator in virtual time."""
    plan = replace(PLAN, budget=config.max_num_batched_tokens).within(config.max_model_len)
    found = [sim_prefill(cost, config, p) for p in plan.prefill_sizes]
    shapes = [(n, plan.short_prompt_tokens) for n in plan.decode_batches]
    shapes += [(n, plan.long_context_tokens) for n in plan.long_context_batches]
    found += [sim_decode(cost, config, n, p) for n, p in shapes]
    found += [sim_mixed(cost, config, p) for p in plan.mixed_sizes]
    return found


def noisy(measurements: list[Measurement], seed: int, sd: float) -> list[Measurement]:
    """Each time off by a relative error drawn from N(0, sd); medians of 3 such draws."""
    rng = random.Random(seed)
    out = []
    for m in measurements:
        draws = [replace(m, seconds=m.seconds * (1 + rng.gauss(0, sd))) for _ in range(3)]
        out.append(median_of(draws))
    return out


def assert_close(cost: StepCost, expected: StepCost, rel: float, names: tuple[str, ...]) -> None:
    for name in names:
        got, want = getattr(cost, name), getattr(expected, name)
        assert got == pytest.approx(want, rel=rel), f"{name}: {got:.4g} vs {want:.4g}"


ALL = (
    "fixed_s",
    "prefill_per_token_s",
    "decode_per_token_s",
    "decode_step_overhead_s",
    "prefill_attention_per_token_context_s",
    "decode_per_context_token_s",
)
MAIN = ("fixed_s", "prefill_per_token_s", "decode_per_token_s")


# -- the fit ------------------------------------------------------------------------


def test_lstsq_solves_exactly_and_flags_dependent_columns() -> None:
    # b = 2·x0 - 3·x1; x2 = x0 + x1 adds nothing; x3 is all zero.
    x0, x1 = [1.0, 2.0, 3.0, 4.0], [1.0, -1.0, 0.5, 2.0]
    x2 = [a + b for a, b in zip(x0, x1, strict=True)]
    b = [2 * a - 3 * c for a, c in zip(x0, x1, strict=True)]
    solution = lstsq([x0, x1, x2, [0.0] * 4], b)
    assert solution[0] == pytest.approx(2.0)
    assert solution[1] == pytest.approx(-3.0)
    assert solution[2:] == [None, None]


def test_lstsq_is_least_squares_on_an_overdetermined_system() -> None:
    # Fitting a constant: the mean.
    assert lstsq([[1.0, 1.0, 1.0]], [1.0, 2.0, 6.0]) == [pytest.approx(3.0)]


def test_fit_recovers_every_coefficient_from_the_simulator() -> None:
    # Not exact to the last digit: a stall is read against the steps before it, whose
    # decode context was a few tokens shorter.
    result = fit(simulated(FULL))
    assert_close(result.cost, FULL, 1e-2, ALL)
    assert result.request_overhead_s == pytest.approx(REQUEST_OVERHEAD, rel=1e-2)
    assert result.notes == ()
    assert all(worst < 1e-3 for _, worst in residual_summary(result).values())


def test_fit_recovers_the_cpu_tiny_profile() -> None:
    tiny = load_profile("cpu-tiny").step
    result = fit(simulated(tiny))
    assert_close(result.cost, tiny, 1e-3, MAIN)
    assert result.cost.decode_step_overhead_s < 1e-6
    assert result.cost.decode_per_context_token_s < 1e-10


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fit_with_noise_stays_near_the_true_coefficients(seed: int) -> None:
    # 0.5% is about the spread of one TTFT against the simulator on a loaded 2-core
    # machine. The fixed part is the least determined: only the step boundaries show it
    # (worst of 40 seeds: 15%).
    result = fit(noisy(simulated(FULL), seed, sd=0.005))
    assert_close(result.cost, FULL, 0.25, ("fixed_s",))
    assert_close(result.cost, FULL, 0.05, ("prefill_per_token_s", "decode_per_token_s"))
    # Fixed + decode overhead (what every decode step pays) is pinned much tighter.
    both = result.cost.fixed_s + result.cost.decode_step_overhead_s
    assert both == pytest.approx(FULL.fixed_s + FULL.decode_step_overhead_s, rel=0.03)
    assert all(worst < 0.03 for _, worst in residual_summary(result).values())


def test_request_overhead_folds_into_fixed_when_no_prompt_spans_two_steps() -> None:
    config = replace(CONFIG, max_num_batched_tokens=8192)
    result = fit(simulated(FULL, config))
    assert any("no prompt took more than one step" in note for note in result.notes)
    assert any(note.startswith("decode_step_overhead_s: not separable") for note in result.notes)
    # Decode steps keep their whole fixed part; the request overhead takes the rest.
    fixed = FULL.fixed_s + FULL.decode_step_overhead_s
    assert result.cost.fixed_s == pytest.approx(fixed, rel=1e-2)
    assert result.cost.decode_step_overhead_s == 0.0
    assert result.request_overhead_s == pytest.approx(
        REQUEST_OVERHEAD - FULL.decode_step_overhead_s, rel=1e-2
    )
    assert_close(result.cost, FULL, 1e-2, ("prefill_per_token_s", "decode_per_token_s"))
    assert all(worst < 1e-3 for _, worst in residual_summary(result).values())


def test_negative_coefficients_are_set_to_zero_and_noted() -> None:
    # Decode steps faster than the fixed part the prefills show: the decode
    # overhead would be negative.
    cost = replace(FULL, decode_step_overhead_s=0.0)
    measurements = [m for m in simulated(cost) if m.kind is Kind.PREFILL]
    measurements += [
        Measurement(kind=Kind.DECODE, seconds=0.003 + 0.0005 * n, batch=n, context_tokens=20.0 * n)
        for n in (1, 2, 4, 8)
    ]
    result = fit(measurements)
    assert result.cost.decode_step_overhead_s == 0.0
    assert any("negative" in note for note in result.notes)
    assert all(e >= 0 for e in vars(result.cost).values())


def test_engine_clock_prefills_carry_no_request_overhead() -> None:
    measurements = [
        replace(m, seconds=m.seconds - REQUEST_OVERHEAD, engine_clock=True)
        if m.kind is Kind.PREFILL
        else m
        for m in simulated(FULL)
    ]
    result = fit(measurements)
    assert_close(result.cost, FULL, 1e-2, ALL)
    assert result.request_overhead_s == 0.0
    assert result.notes == (f"{OVERHEAD}: not measured, set to 0",)


def test_fit_refuses_nothing() -> None:
    with pytest.raises(ValueError, match="nothing"):
        fit([])


# -- the plan ----------------------------------------------------------------------


def test_engine_clock_plan_keeps_only_decode_shapes_that_start_together() -> None:
    plan = Plan(budget=512, long_context_tokens=1024, long_context_batches=(1, 4))
    assert plan.within(8192).long_context_batches == (1, 4)
    engine = replace(plan, engine_clock=True).within(8192)
    assert engine.long_context_batches == (1,)
    assert engine.ramp_free(16, 16) and not engine.ramp_free(2, 300)


def test_plan_adds_prompts_on_both_sides_of_step_boundaries_and_fits_the_engine() -> None:
    plan = Plan(budget=512, prefill_sizes=(32, 4096), mixed_sizes=(64, 1024))
    assert plan.within(8192).prefill_sizes == (32, 512, 520, 1024, 1032, 4096)
    assert plan.within(8192).mixed_sizes == (64, 510)
    small = plan.within(600)
    assert max(small.prefill_sizes) == 598
    assert small.long_context_tokens < 300


# -- report and profile file --------------------------------------------------------


INFO = EngineInfo(
    url="http://engine:8000", model="tiny", max_model_len=8192, block_size=16, num_gpu_blocks=4096
)


def test_profile_file_loads_back_with_its_provenance(tmp_path: Path) -> None:
    result = fit(simulated(FULL))
    text = profile_file(
        result, INFO, PLAN, name="fitted", now=datetime(2026, 11, 29, tzinfo=UTC), seconds=12.0
    )
    header = text.split("\nname:")[0]
    assert all(line.startswith("# ") for line in header.splitlines())
    assert "http://engine:8000" in header and "2026-11-29" in header
    path = tmp_path / "fitted.yaml"
    path.write_text(text)
    profile = load_profile(str(path))
    assert profile.step == result.cost
    assert (profile.name, profile.model) == ("fitted", "tiny")
    engine = profile.engine
    assert (engine.max_num_batched_tokens, engine.max_model_len) == (BUDGET, 8192)
    assert (engine.block_size, engine.num_gpu_blocks) == (16, 4096)
    assert yaml.safe_load(text)["step"]["fixed_s"] == pytest.approx(FULL.fixed_s, rel=1e-3)


def test_report_has_every_coefficient_measurement_and_kind() -> None:
    result = fit(simulated(FULL))
    text = report(result)
    assert "fixed_s" in text and OVERHEAD in text
    assert text.count("prefill ") >= len(PLAN.prefill_sizes)
    for kind in Kind:
        assert f"\n{kind.value} " in text
