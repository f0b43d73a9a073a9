"""From a validated request body to what the engine runs, with vLLM's checks.

Chat messages go through the tokenizer's chat template, then ``encode``; a
completion prompt is a string or a list of token ids. ``max_tokens`` (for chat,
``max_completion_tokens`` first) defaults to what is left of ``max_model_len``.
Every refusal is an :class:`~loadtests.sim.server.errors.APIError` (400) whose ``param``
names the offending field and whose message is worded as vLLM words it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from loadtests.sim.queues import SchedulingPolicy
from loadtests.sim.server.errors import bad_request
from loadtests.sim.server.protocol import ChatCompletionRequest, ChatMessage, GenerationRequest
from loadtests.sim.step_scheduler import SchedulerConfig
from loadtests.sim.tokenizer import SimTokenizer


@dataclass(frozen=True, kw_only=True)
class EngineInput:
    prompt_token_ids: list[int]
    max_tokens: int
    priority: int
    seed: int | None


def chat_prompt_ids(tokenizer: SimTokenizer, messages: Sequence[ChatMessage]) -> list[int]:
    """Token ids of chat messages rendered through the chat template."""
    dumped = [m.model_dump() for m in messages]
    try:
        return tokenizer.encode(tokenizer.apply_chat_template(dumped))
    except TypeError as exc:
        raise bad_request(str(exc), param="messages") from exc


def completion_prompt_ids(tokenizer: SimTokenizer, prompt: str | list[int]) -> list[int]:
    """Token ids of a completion prompt; given ids must lie in the vocabulary."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    for token_id in prompt:
        if not 0 <= token_id < tokenizer.vocab_size:
            raise bad_request(f"Token id {token_id} is out of vocabulary", param="prompt")
    return list(prompt)


def engine_input(
    body: GenerationRequest, prompt_ids: list[int], config: SchedulerConfig
) -> EngineInput:
    """Check a request against the engine's settings and resolve ``max_tokens``."""
    prompt_field = "messages" if isinstance(body, ChatCompletionRequest) else "prompt"
    _check_options(body, config)
    if not prompt_ids:
        raise bad_request("The prompt cannot be empty.", param=prompt_field)
    tokens_field, requested = _requested_max_tokens(body)
    max_tokens = _check_length(
        len(prompt_ids), requested, config.max_model_len, prompt_field, tokens_field
    )
    return EngineInput(
        prompt_token_ids=prompt_ids, max_tokens=max_tokens, priority=body.priority, seed=body.seed
    )


def _check_options(body: GenerationRequest, config: SchedulerConfig) -> None:
    if body.n != 1:
        raise bad_request(f"n must be 1 on this engine, got {body.n}.", param="n")
    if body.stream_options is not None and not body.stream:
        raise bad_request(
            "Stream options can only be defined when `stream=True`.", param="stream_options"
        )
    if body.priority != 0 and config.scheduling_policy is not SchedulingPolicy.PRIORITY:
        raise bad_request(
            f"Got priority {body.priority} but Priority scheduling is not enabled.",
            param="priority",
        )


def _requested_max_tokens(body: GenerationRequest) -> tuple[str, int | None]:
    """The field that sets the output length, and its value (None: not given)."""
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        return "max_completion_tokens", body.max_completion_tokens
    return "max_tokens", body.max_tokens


def _check_length(
    prompt_len: int,
    max_tokens: int | None,
    max_model_len: int,
    prompt_field: str,
    tokens_field: str,
) -> int:
    """``max_tokens`` to run with; vLLM's context-length rules and messages."""
    if prompt_len >= max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len} tokens in the messages, Please reduce the length of the "
            "messages.",
            param=prompt_field,
        )
    if max_tokens is None:
        return max_model_len - prompt_len
    if max_tokens < 1:
        raise bad_request(f"{tokens_field} must be at least 1, got {max_tokens}.", tokens_field)
    if prompt_len + max_tokens > max_model_len:
        raise bad_request(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the messages, "
            f"{max_tokens} in the completion). Please reduce the length of the messages or "
            "completion.",
            param=tokens_field,
        )
    return max_tokens
