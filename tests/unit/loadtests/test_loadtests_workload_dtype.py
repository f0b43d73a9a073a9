"""Every workload file that starts real vLLM takes the model's dtype from the CPU
(``{dtype}``), none pins one: on a CPU without AVX-512 BF16 a pinned bfloat16 runs
the engine emulated, many times slower (loadtests.support.vllm.cpu_dtype)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from loadtests.harness.engines import engine_argv
from loadtests.harness.workload_file import load_workload
from loadtests.support import vllm

WORKLOADS = Path(__file__).parents[3] / "loadtests" / "workloads"
STARTING = [
    p for p in sorted(WORKLOADS.glob("*.yaml")) if "engines" in yaml.safe_load(p.read_text())
]


def _dtype(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "--dtype" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--dtype="):
            return arg.partition("=")[2]
    return None


def test_crosscheck_vllm_runs_in_float32_on_a_cpu_without_bf16(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(vllm, "cpu_dtype", lambda: "float32")
    workload = load_workload(WORKLOADS / "crosscheck-vllm.yaml")
    assert workload.engines is not None
    assert _dtype(engine_argv(workload.engines.command, 8123)) == "float32"


def test_the_workloads_that_start_engines_are_found() -> None:
    names = {p.name for p in STARTING}
    assert {"compare.yaml", "crosscheck-vllm.yaml"} <= names


@pytest.mark.parametrize("path", STARTING, ids=lambda p: p.name)
def test_no_workload_pins_a_dtype(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(vllm, "cpu_dtype", lambda: "from-the-cpu")
    workload = load_workload(path)
    assert workload.engines is not None
    for arm in workload.arms:
        dtype = _dtype(engine_argv(workload.engines.command, 8123, arm.engine_args))
        assert dtype in (None, "from-the-cpu"), f"{path.name}, arm {arm.name}: --dtype {dtype}"
