"""The proxy's scheduler: pure, deterministic, over an injected clock.

Public names: :class:`Scheduler`, its settings, and the vocabulary in ``types``.
The scheduler takes the engines' settings as the config loader makes them
(:class:`proxy.config.EngineConfig`, :class:`proxy.config.BudgetConfig`).
"""

from proxy.config import BudgetConfig, EngineConfig
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

# The names the test bench and older callers use for the same two classes.
EngineSettings = EngineConfig
BudgetSettings = BudgetConfig

__all__ = [
    "BATCH_PRIORITY",
    "INTERACTIVE_PRIORITY",
    "Abort",
    "BudgetController",
    "BudgetSettings",
    "Decision",
    "Dispatch",
    "EngineLoad",
    "EngineSettings",
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
