"""Settings of a simulated engine server, built from a profile and vLLM-style flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from loadtests.sim.kv_events import KVEventsConfig
from loadtests.sim.profile import Profile
from loadtests.sim.queues import SchedulingPolicy
from loadtests.sim.step_scheduler import SchedulerConfig


@dataclass(frozen=True, kw_only=True)
class SimSettings:
    profile: Profile
    scheduler: SchedulerConfig
    served_model_name: str
    host: str = "127.0.0.1"
    port: int = 8000
    time_scale: float = 1.0
    enable_prompt_tokens_details: bool = False
    """Report ``usage.prompt_tokens_details.cached_tokens`` (off by default, as in vLLM)."""
    request_log: Path | None = None
    """Append a JSON line for each generation request's start and end to this file
    (:mod:`loadtests.sim.server.requestlog`; off by default)."""
    kv_events: KVEventsConfig | None = None
    """``--kv-events-config``: publish vLLM's KV-cache events over ZMQ
    (:mod:`loadtests.sim.kv_events`; off by default, as in vLLM)."""

    def __post_init__(self) -> None:
        if self.time_scale <= 0:
            raise ValueError(f"time_scale must be positive, got {self.time_scale}")


def scheduler_config(
    profile: Profile,
    *,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    enable_chunked_prefill: bool = True,
    long_prefill_token_threshold: int = 0,
    scheduling_policy: str = "fcfs",
    block_size: int | None = None,
    num_gpu_blocks: int | None = None,
    enable_prefix_caching: bool = True,
    async_scheduling: bool | None = None,
) -> SchedulerConfig:
    """Engine flags over the profile's defaults.

    With chunked prefill off and no explicit token budget, the budget grows to
    ``max_model_len`` so that any prompt fits in one step (vLLM does the same).
    ``async_scheduling`` None takes the profile's, the choice vLLM makes on the
    platform the profile stands for.
    """
    d = profile.engine
    model_len = max_model_len or d.max_model_len
    budget = max_num_batched_tokens or d.max_num_batched_tokens
    if not enable_chunked_prefill and max_num_batched_tokens is None:
        budget = max(budget, model_len)
    return SchedulerConfig(
        max_num_batched_tokens=budget,
        max_num_seqs=max_num_seqs or d.max_num_seqs,
        max_model_len=model_len,
        enable_chunked_prefill=enable_chunked_prefill,
        long_prefill_token_threshold=long_prefill_token_threshold,
        scheduling_policy=SchedulingPolicy(scheduling_policy),
        block_size=block_size or d.block_size,
        num_gpu_blocks=num_gpu_blocks or d.num_gpu_blocks,
        enable_prefix_caching=enable_prefix_caching,
        async_scheduling=d.async_scheduling if async_scheduling is None else async_scheduling,
    )
