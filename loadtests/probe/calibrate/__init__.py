"""Fit a simulator profile to a real engine: measure over HTTP, fit, write YAML.

``wire`` talks to the engine and ``measure`` says what to ask it; ``token_times`` and
``cost_fit`` are pure; ``profile_report`` renders tables and the profile file;
``command`` is ``whoseturn sim calibrate``.
"""

from loadtests.probe.calibrate.cost_fit import FitResult, fit
from loadtests.probe.calibrate.measure import Plan, measure_engine
from loadtests.probe.calibrate.token_times import Kind, Measurement
from loadtests.probe.calibrate.wire import MeasurementError

__all__ = [
    "FitResult",
    "Kind",
    "Measurement",
    "MeasurementError",
    "Plan",
    "fit",
    "measure_engine",
]
