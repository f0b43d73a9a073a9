"""The simulated vLLM engine: a model of vLLM's V1 scheduler with a step cost model."""

from loadtests.sim.profile import Profile, StepCost, load_profile
from loadtests.sim.queues import SchedulingPolicy
from loadtests.sim.request import RequestStatus, SimRequest
from loadtests.sim.step_loop import SimEngine, StepPlan, StepResult, TokenEvent
from loadtests.sim.step_scheduler import SchedulerConfig
from loadtests.sim.tokenizer import SimTokenizer
from loadtests.sim.virtual import VirtualRunner
from proxy.clock import Clock, VirtualClock, WallClock

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
