"""The simulated vLLM engine: a model of vLLM's V1 scheduler with a step cost model."""

from proxy.clock import Clock, VirtualClock, WallClock
from proxy.sim.engine import SimEngine, StepPlan, StepResult, TokenEvent
from proxy.sim.profile import Profile, StepCost, load_profile
from proxy.sim.queues import SchedulingPolicy
from proxy.sim.request import RequestStatus, SimRequest
from proxy.sim.scheduler import SchedulerConfig
from proxy.sim.tokenizer import SimTokenizer
from proxy.sim.virtual import VirtualRunner

__all__ = [
    "Clock",
    "Profile",
    "RequestStatus",
    "SchedulerConfig",
    "SchedulingPolicy",
    "SimEngine",
    "SimRequest",
    "SimTokenizer",
    "StepCost",
    "StepPlan",
    "StepResult",
    "TokenEvent",
    "VirtualClock",
    "VirtualRunner",
    "WallClock",
    "load_profile",
]
