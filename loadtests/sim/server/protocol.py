"""Request bodies of the OpenAI-compatible API, as vLLM accepts them.

Fields the simulated engine has no use for (``temperature``, ``top_p``, ``stop`` ...)
are accepted and ignored, as vLLM accepts parameters it does not know. ``priority``
and ``request_id`` are vLLM's extra parameters.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, model_validator


class _Body(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class ChatMessage(_Body):
    role: str
    content: str | list[dict[str, Any]] | None = None


class GenerationRequest(_Body):
    """What chat and text completions share."""

    model: str | None = None
    max_tokens: StrictInt | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: StrictInt = 1
    seed: StrictInt | None = None
    priority: StrictInt = 0
    request_id: str | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = None


class CompletionRequest(GenerationRequest):
    prompt: str | list[StrictInt]


class TokenizeRequest(_Body):
    """``{"prompt": ...}`` or ``{"messages": [...]}``, exactly one of them."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of `prompt` and `messages`")
        return self
