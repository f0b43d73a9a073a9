"""The real-vLLM tier's dtype follows what the CPU computes in."""

from __future__ import annotations

from pathlib import Path

from loadtests.harness.engines import engine_argv
from loadtests.support.vllm import cpu_dtype


def _cpuinfo(tmp_path: Path, flags: str) -> Path:
    path = tmp_path / "cpuinfo"
    path.write_text(f"processor\t: 0\nflags\t\t: fpu sse2 {flags}\n\nprocessor\t: 1\n")
    return path


def test_bfloat16_only_where_the_cpu_computes_in_it(tmp_path: Path) -> None:
    assert cpu_dtype(_cpuinfo(tmp_path, "avx avx2 avx512f avx512_bf16")) == "bfloat16"
    assert cpu_dtype(_cpuinfo(tmp_path, "avx avx2 amx_bf16 amx_tile")) == "bfloat16"
    assert cpu_dtype(_cpuinfo(tmp_path, "avx f16c fma")) == "float32"  # emulated bf16
    assert cpu_dtype(_cpuinfo(tmp_path, "avx avx2 avx512f")) == "float32"
    assert cpu_dtype(tmp_path / "missing") == "bfloat16"  # not Linux: vLLM's own choice


def test_a_workload_command_gets_the_dtype_filled_in() -> None:
    argv = engine_argv("serve --dtype {dtype} --port {port}", 8123)
    assert argv == ["serve", "--dtype", cpu_dtype(), "--port", "8123"]
