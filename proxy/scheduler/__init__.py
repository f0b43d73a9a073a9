"""The proxy's scheduler: pure, deterministic, over an injected clock.

Public names: :class:`Scheduler`, its settings, and the vocabulary in ``types``.
"""

from proxy.scheduler.budget import BudgetController, BudgetSettings
from proxy.scheduler.core import Scheduler, SchedulerSettings, UnknownModel
from proxy.scheduler.state import EngineLoad, EngineSettings, EngineState
from proxy.scheduler.types import (
    BATCH_PRIORITY,
    INTERACTIVE_PRIORITY,
    Decision,
    Dispatch,
    HeldReason,
    Job,
    Phase,
    TrafficClass,
    Turn,
)

__all__ = [
    "BATCH_PRIORITY",
    "INTERACTIVE_PRIORITY",
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
