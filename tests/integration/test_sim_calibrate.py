"""``whoseturn sim calibrate`` against a real simulated engine recovers its profile.

The engine runs the ``cpu-tiny`` profile with a 512-token step budget, so that prompts
span several steps. Calibration measures wall time, so against a simulator running at
time scale X the coefficients it fits are the profile's divided by X; the test
multiplies them back. It runs at X = 1: the fixed step cost (4.5 ms) shows only in
differences of a few milliseconds, and at X = 2 the request overhead's jitter on a
loaded 2-core machine was already as large. With ``--clock engine`` it
reads the engine's histograms, which the simulator keeps in model time: no scaling.
The engine and calibration run as processes of their own, so that neither shares an
interpreter lock (or garbage-collection pauses) with the other or with pytest.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtests.sim.profile import StepCost, load_profile
from proxy.cli import main
from tests.support import MODEL
from tests.support.processes import whoseturn_command

from .proxyserver import spawn_sim

pytestmark = pytest.mark.integration

TIME_SCALE = 1.0
BUDGET = 512


@pytest.fixture(scope="module")
def sim_url() -> Iterator[str]:
    """``whoseturn sim`` in a process of its own: a test process that has run many
    tests pauses for garbage collection long enough to blur a 2 ms step."""
    flags = ("--max-num-batched-tokens", str(BUDGET), "--max-model-len", "4096")
    with spawn_sim(*flags, time_scale=TIME_SCALE) as sim:
        yield sim.base_url


def calibrate(url: str, out: Path, *options: str) -> subprocess.CompletedProcess[str]:
    command = whoseturn_command("sim", "calibrate")
    command += ["--engine", url, "--out", str(out), "--name", "fitted"]
    command += ["--max-num-batched-tokens", str(BUDGET)]
    done = subprocess.run(
        [*command, *options], capture_output=True, text=True, timeout=80, check=False
    )
    print(done.stdout)
    assert done.returncode == 0, done.stderr
    assert "residuals" in done.stdout and "fixed_s" in done.stdout
    return done


def assert_near(fitted: StepCost, true: StepCost, scale: float) -> None:
    """Fitted x scale against the true coefficients, as the calibration issue asks."""
    assert fitted.fixed_s * scale == pytest.approx(true.fixed_s, rel=0.25)
    assert fitted.prefill_per_token_s * scale == pytest.approx(true.prefill_per_token_s, rel=0.15)
    assert fitted.decode_per_token_s * scale == pytest.approx(true.decode_per_token_s, rel=0.15)
    # What a decode step pays besides its sequences, however the fit splits it.
    decode_fixed = (fitted.fixed_s + fitted.decode_step_overhead_s) * scale
    assert decode_fixed == pytest.approx(true.fixed_s + true.decode_step_overhead_s, rel=0.1)


@pytest.mark.timeout(90)
def test_calibrate_recovers_the_profile_of_a_simulated_engine(sim_url: str, tmp_path: Path) -> None:
    out = tmp_path / "fitted.yaml"
    # Five runs of each: a median of three still moved with the load of a shared
    # 2-core machine (the fixed part shows only as ~4 ms steps at prompt boundaries).
    calibrate(sim_url, out, "--repeats", "5", "--max-prompt-tokens", "1100")
    fitted = load_profile(str(out))
    true = load_profile("cpu-tiny")
    assert_near(fitted.step, true.step, TIME_SCALE)

    assert fitted.name == "fitted" and fitted.model == MODEL
    engine = fitted.engine
    assert (engine.max_num_batched_tokens, engine.max_model_len) == (BUDGET, 4096)
    assert (engine.block_size, engine.num_gpu_blocks) == (
        true.engine.block_size,
        true.engine.num_gpu_blocks,
    )
    head = f"# Fitted by `whoseturn sim calibrate --engine {sim_url} --max-num-batched"
    assert out.read_text().startswith(head)


@pytest.mark.timeout(90)
def test_calibrate_on_the_engine_clock_reads_model_time(sim_url: str, tmp_path: Path) -> None:
    # The simulator keeps vLLM's histograms in model time: no scaling.
    out = tmp_path / "fitted.yaml"
    done = calibrate(
        sim_url, out, "--clock", "engine", "--repeats", "1", "--max-prompt-tokens", "1100"
    )
    assert "the engine's own clock" in done.stdout
    assert_near(load_profile(str(out)).step, load_profile("cpu-tiny").step, 1.0)
    assert "--clock engine" in out.read_text().splitlines()[0]


def test_calibrate_reports_an_engine_it_cannot_reach(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["sim", "calibrate", "--engine", "http://127.0.0.1:9"]) == 1
    assert "calibration against http://127.0.0.1:9 failed" in capsys.readouterr().err


def test_calibrate_wants_a_yaml_file_name(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["sim", "calibrate", "--engine", "http://127.0.0.1:9", "--out", "fitted.txt"]
    assert main(argv) == 2
    assert ".yaml" in capsys.readouterr().err
