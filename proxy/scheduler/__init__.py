"""The proxy's scheduler: pure, deterministic, over an injected clock.

Public names: :class:`Scheduler`, its settings, and the vocabulary in ``types``
(its ``__all__``).
The scheduler takes the engines' settings as the config loader makes them
(:class:`proxy.config.EngineConfig`, :class:`proxy.config.BudgetConfig`).
"""

from proxy.scheduler import types
from proxy.scheduler.budget import BudgetController
from proxy.scheduler.core import Scheduler, SchedulerSettings, UnknownModel
from proxy.scheduler.state import EngineLoad, EngineState, HoldRules, ReplicaLoad
from proxy.scheduler.types import *  # noqa: F403 - the vocabulary, as types.__all__ names it

__all__ = [
    "BudgetController",
    "EngineLoad",
    "EngineState",
    "HoldRules",
    "ReplicaLoad",
    "Scheduler",
    "SchedulerSettings",
    "UnknownModel",
    *types.__all__,
]
