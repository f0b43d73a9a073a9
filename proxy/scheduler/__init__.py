"""The proxy's scheduler: pure, deterministic, over an injected clock.

Public names: :class:`Scheduler`, its settings, and the vocabulary in ``types``.
The scheduler takes the engines' settings as the config loader makes them
(:class:`proxy.config.EngineConfig`, :class:`proxy.config.BudgetConfig`).
"""

from proxy.scheduler.budget import BudgetController
from proxy.scheduler.core import Scheduler, SchedulerSettings, UnknownModel
from proxy.scheduler.state import EngineLoad, EngineState, HoldRules, ReplicaLoad
from proxy.scheduler.types import (
    BATCH_PRIORITY,
    INTERACTIVE_PRIORITY,
    Abort,
    Decision,
    Dispatch,
    HeldReason,
    Job,
    Phase,
    Reservation,
    TrafficClass,
    Turn,
)

__all__ = [
    "BATCH_PRIORITY",
    "INTERACTIVE_PRIORITY",
    "Abort",
    "BudgetController",
    "Decision",
    "Dispatch",
    "EngineLoad",
    "EngineState",
    "HeldReason",
    "HoldRules",
    "Job",
    "Phase",
    "ReplicaLoad",
    "Reservation",
    "Scheduler",
    "SchedulerSettings",
    "TrafficClass",
    "Turn",
    "UnknownModel",
]
