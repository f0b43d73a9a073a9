"""A request as the simulated engine sees it: token ids, progress and timestamps."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestStatus(enum.Enum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    FINISHED = enum.auto()
    ABORTED = enum.auto()


@dataclass(eq=False, kw_only=True)
class SimRequest:
    """One generation request.

    ``max_tokens`` tokens are generated (the model never stops early, like vLLM
    with ``ignore_eos``), fewer only if the context reaches ``max_model_len``.
    Times are model-clock seconds; ``None`` until the event happens.
    """

    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    arrival_time: float
    priority: int = 0
    seed: int = 0
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Tokens in a planned step that has not finished yet, and the tokens that step
    # will sample: both are non-zero between planning and applying a step, which
    # under async scheduling overlaps the planning of the next step (vLLM's
    # ``num_output_placeholders``).
    num_inflight_tokens: int = 0
    num_output_placeholders: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    # Prefix-cache hit found when the request was first scheduled (-1: not yet).
    num_cached_tokens: int = -1
    num_preemptions: int = 0
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    finish_reason: str | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: what the KV cache must eventually hold."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def is_finished(self) -> bool:
        return self.status in (RequestStatus.FINISHED, RequestStatus.ABORTED)
