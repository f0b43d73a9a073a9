"""What a probe run produces: the engine it asked, every measurement, and the verdict."""

from __future__ import annotations

from dataclasses import dataclass

from loadtests.engine_io import EngineInfo
from loadtests.probe.analysis import Analysis
from loadtests.probe.measurements import Injection


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    engine: EngineInfo
    injections: tuple[Injection, ...]
    analysis: Analysis
    elapsed_s: float
