"""A step-level model of vLLM's V1 scheduler: continuous batching under a token budget.

Each call to :meth:`EngineScheduler.schedule` plans one engine step:

1. Running requests first, in order: each gets the tokens it still needs (one for a
   decode, a chunk for an unfinished prefill), capped by the long-prefill threshold
   and by what is left of the step's token budget. When the KV cache cannot hold
   them, the lowest-ranked running request is preempted (the last one under FCFS,
   the highest ``(priority, arrival)`` under the priority policy, the last admitted
   among equals) and goes back to the waiting queue to be recomputed later.
2. Then, if nothing was preempted, waiting requests in queue order while the budget,
   the sequence cap and the KV cache allow. A prefix-cache hit is taken as already
   computed. With chunked prefill off, a prompt whose first chunk (after the
   long-prefill threshold, applied first as in vLLM) does not fit in what is left of
   the budget stops admission for this step.

:meth:`update_from_output` applies a finished step: computed tokens advance, a
request whose tokens are all computed samples its next token, and finished requests
release their blocks. Nothing here does I/O or reads a clock.

The next step may be planned before the last one is applied (vLLM's async
scheduling, driven by :class:`loadtests.sim.step_loop.SimEngine`): tokens of a planned
step count as computed, and a token it will sample as a placeholder, so a request
whose prefill ends in the step in flight decodes in the next one, as in vLLM's
``AsyncScheduler``; a request whose in-flight step samples its last token is not
planned again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loadtests.sim.kv_cache import KVCacheManager
from loadtests.sim.queues import SchedulingPolicy, create_request_queue
from loadtests.sim.request import RequestStatus, SimRequest

TokenSampler = Callable[[SimRequest, int], int]
"""Picks the token a request generates at a given output position."""


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The engine flags that shape scheduling (vLLM's names)."""

    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 256
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    block_size: int = 16
    num_gpu_blocks: int = 8192
    enable_prefix_caching: bool = True
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                f"max_model_len ({self.max_model_len}) with chunked prefill disabled: a "
                "prompt could never be scheduled. Raise the one or lower the other."
            )
        if self.num_gpu_blocks * self.block_size < self.max_model_len:
            raise ValueError("the KV cache cannot hold one request of max_model_len tokens")


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens of one request computed in a step."""

    request_id: str
    num_tokens: int
    num_computed_before: int
    is_decode: bool
    # The request's preemption count when planned: a step planned before a
    # preemption is not applied to the recomputed request.
    num_preemptions: int = 0


@dataclass
class SchedulerOutput:
    """The plan of one step."""

    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    newly_scheduled: list[str] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_prefill_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks if not c.is_decode)

    @property
    def num_decode_tokens(self) -> int:
        return sum(1 for c in self.chunks if c.is_decode)

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True)
class TokenOutput:
    """A token sampled for a request at the end of a step."""

    request: SimRequest
    token_id: int
    finished: bool


class EngineScheduler:
    """Waiting and running requests of one engine, and the step plans over them."""

    def __init__(
        self, config: SchedulerConfig, sample: TokenSampler, *, kv_cache_events: bool = False
    ) -> None:
        """``kv_cache_events``: record vLLM's KV-cache events (``self.kv.take_events()``)."""
        self.config = config
        self.kv = KVCacheManager(
            config.num_gpu_blocks,
            config.block_size,
            config.enable_prefix_caching,
            enable_kv_cache_events=kv_cache_events,
        )
        self.waiting = create_request_queue(config.scheduling_policy)
        self.running: list[SimRequest] = []
        self.requests: dict[str, SimRequest] = {}
        self._sample = sample
        self.num_preemptions = 0

    # -- requests --------------------------------------------------------------

    def add_request(self, request: SimRequest) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.max_tokens < 1:
            raise ValueError("max_tokens must be at least 1")
        if request.num_prompt_tokens < 1:
            raise ValueError("a request needs at least one prompt token")
        if request.num_prompt_tokens >= self.config.max_model_len:
            raise ValueError("prompt does not leave room for one generated token")
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def abort_request(self, request_id: str) -> SimRequest | None:
        """Drop a request at once, wherever it is; returns it, or None if unknown."""
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv.free(request)
        request.status = RequestStatus.ABORTED
        request.finish_reason = "abort"
        return request

    @property
    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- planning --------------------------------------------------------------

    def _cap(self, num_new: int, budget: int) -> int:
        threshold = self.config.long_prefill_token_threshold
        if 0 < threshold < num_new:
            num_new = threshold
        return min(num_new, budget)

    def _preempt_victim(self) -> SimRequest:
        if self.config.scheduling_policy is SchedulingPolicy.PRIORITY:
            # Among equals the last admitted goes, as under FCFS (max keeps the first it
            # meets): taking the one furthest along can preempt back and forth forever.
            victim = max(reversed(self.running), key=lambda r: (r.priority, r.arrival_time))
            self.running.remove(victim)
            return victim
        return self.running.pop()

    def _preempt(self, request: SimRequest) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_inflight_tokens = 0
        request.num_output_placeholders = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    def schedule(self) -> SchedulerOutput:
        """Plan the next step (see the module docstring for the rules).

        The plan is empty only when there is nothing to do (planned ahead, nothing
        until the step in flight is applied). When every request tried
        preempted itself (possible under the priority policy), vLLM runs an empty
        step and plans again; here planning goes on at once, so that no driver takes
        the empty plan for an idle engine.
        """
        out = self._plan()
        while out.is_empty and out.preempted:
            again = self._plan()
            if again.is_empty and not again.preempted:
                # Planned ahead under async scheduling, a step may have nothing to
                # do until the one in flight is applied (its requests all finish).
                break
            again.preempted[:0] = out.preempted
            out = again
        for chunk in out.chunks:
            request = self.requests[chunk.request_id]
            request.num_inflight_tokens += chunk.num_tokens
            if self._computed(request) >= request.num_tokens + request.num_output_placeholders:
                request.num_output_placeholders += 1
        return out

    @staticmethod
    def _computed(request: SimRequest) -> int:
        return request.num_computed_tokens + request.num_inflight_tokens

    def _done_once_applied(self, request: SimRequest) -> bool:
        """Whether the steps in flight sample the request's last token."""
        placeholders = request.num_output_placeholders
        return placeholders > 0 and (
            len(request.output_token_ids) + placeholders >= request.max_tokens
            or request.num_tokens + placeholders >= self.config.max_model_len
        )

    def _plan(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        scheduled: dict[str, ScheduledChunk] = {}
        index = 0
        while index < len(self.running) and budget > 0:
            request = self.running[index]
            if self._done_once_applied(request):
                index += 1
                continue
            needed = request.num_tokens + request.num_output_placeholders
            num_new = self._cap(needed - self._computed(request), budget)
            if num_new <= 0:
                index += 1
                continue
            while not self.kv.allocate_slots(request, num_new):
                victim = self._preempt_victim()
                self._preempt(victim)
                out.preempted.append(victim.request_id)
                if victim is request:
                    break
                if victim.request_id in scheduled:
                    budget += scheduled.pop(victim.request_id).num_tokens
                    index -= 1
            else:
                chunk = self._chunk(request, num_new)
                scheduled[request.request_id] = chunk
                budget -= num_new
                index += 1
                continue
            break
        out.chunks.extend(c for c in scheduled.values())
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while len(self.waiting) and budget > 0:
            if len(self.running) >= self.config.max_num_seqs:
                break
            request = self.waiting.peek()
            hits, num_cached = self.kv.get_computed_blocks(request)
            # as vLLM does: the long-prefill threshold first, then, with chunked
            # prefill off, the (capped) chunk must fit in what is left of the step
            num_new = self._cap(request.num_tokens - num_cached, budget + 1)
            if not self.config.enable_chunked_prefill and num_new > budget:
                break
            num_new = min(num_new, budget)
            if not self.kv.allocate_slots(request, num_new, hits):
                break
            self.waiting.pop()
            request.num_computed_tokens = num_cached
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = num_cached
                out.newly_scheduled.append(request.request_id)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_new))
            budget -= num_new

    @classmethod
    def _chunk(cls, request: SimRequest, num_new: int) -> ScheduledChunk:
        computed = cls._computed(request)
        is_decode = num_new == 1 and computed >= request.num_prompt_tokens
        return ScheduledChunk(
            request.request_id, num_new, computed, is_decode, request.num_preemptions
        )

    # -- results ---------------------------------------------------------------

    def update_from_output(self, out: SchedulerOutput) -> list[TokenOutput]:
        """Apply a finished step; returns the tokens sampled in it, in plan order.

        Requests aborted, or preempted, since the step was planned are skipped.
        """
        tokens: list[TokenOutput] = []
        for chunk in out.chunks:
            request = self.requests.get(chunk.request_id)
            if (
                request is None
                or request.status is not RequestStatus.RUNNING
                or request.num_preemptions != chunk.num_preemptions
            ):
                continue
            request.num_inflight_tokens -= chunk.num_tokens
            request.num_computed_tokens += chunk.num_tokens
            if request.num_computed_tokens < request.num_tokens:
                continue
            request.num_output_placeholders -= 1
            token = self._sample(request, len(request.output_token_ids))
            request.output_token_ids.append(token)
            finished = self._check_finished(request)
            tokens.append(TokenOutput(request, token, finished))
        return tokens

    def _check_finished(self, request: SimRequest) -> bool:
        if len(request.output_token_ids) < request.max_tokens and (
            request.num_tokens < self.config.max_model_len
        ):
            return False
        request.status = RequestStatus.FINISHED
        request.finish_reason = "length"
        self.running.remove(request)
        self.kv.free(request)
        del self.requests[request.request_id]
        return True
