"""The proxy's scheduler: pure, deterministic, over an injected clock.

Public names: :class:`Scheduler`, its settings, and the vocabulary in ``types``.
"""

from proxy.scheduler.budget import BudgetController, BudgetSettings
from proxy.scheduler.core import Scheduler, SchedulerSettings, UnknownModel
from proxy.scheduler.engine import EngineLoad, EngineSettings, EngineState
from proxy.scheduler.types import (
    Decision,
    Dispatch,
    HeldReason,
    Job,
    Phase,
    TrafficClass,
    Turn,
)

__all__ = [
    "BudgetController",
    "BudgetSettings",
    "Decision",
    "Dispatch",
    "EngineLoad",
    "EngineSettings",
    "EngineState",
    "HeldReason",
    "Job",
    "Phase",
    "Scheduler",
    "SchedulerSettings",
    "TrafficClass",
    "Turn",
    "UnknownModel",
]
