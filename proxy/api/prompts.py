"""Prompt-token counts: the one place that decides how big a request's prompt is,
and what its blocks are for the prefix index (:mod:`proxy.scheduler.prefix`).

- Requests routed by prefix (``route_by: prefix``: batch requests, and chats where
  more than one engine serves the model) are tokenized by ``POST /tokenize`` on the
  first up engine serving the model: exact counts, and the token ids cut into the
  engines' blocks.
- Other batch requests are counted exactly the same way (the engine client caches
  counts by content).
- Interactive requests, and batch requests no engine could count, are estimated
  from the prompt's length in characters times the model's tokens-per-character
  ratio.
- The ratio is learned from the engine's ``usage.prompt_tokens`` of every estimated
  request when it finishes, so later estimates for that model come closer.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol, overload

from proxy.engines import EngineHTTPError, EnginePool, UpstreamError
from proxy.openai.request import ChatRequest
from proxy.scheduler import TrafficClass
from proxy.scheduler.prefix import chain

logger = logging.getLogger(__name__)
# the longest a chat waits for its token ids (0.6-4 ms measured: docs/fleet.md)
CHAT_TOKENIZE_S = 0.25


class TokenEstimator:
    """Prompt tokens from text length, with each model's ratio learned from ``usage``."""

    def __init__(self, tokens_per_char: float = 0.25, weight: float = 0.2) -> None:
        self._ratio: defaultdict[str, float] = defaultdict(lambda: tokens_per_char)
        self._weight = weight

    def estimate(self, model: str, text: str) -> int:
        return max(1, round(len(text) * self._ratio[model]))

    def learn(self, model: str, text: str, tokens: int) -> None:
        if text and tokens > 0:
            seen = tokens / len(text)
            self._ratio[model] += self._weight * (seen - self._ratio[model])


@dataclass(frozen=True)
class PromptCount:
    tokens: int
    estimated: bool
    blocks: tuple[int, ...] = ()  # the prompt's block hashes, where it was tokenized


class BlockPolicy(Protocol):
    """Which prompts are cut into blocks for the prefix index, and at what size
    (:class:`proxy.admission.Admission` is one)."""

    def wants_blocks(self, model: str, cls: TrafficClass) -> bool: ...

    def block_size_for(self, model: str) -> int | None: ...


class PromptCounter:
    """Counts prompts (see the module docstring); ``engines_up_for(model)`` names the
    up engines serving a model, in configuration order."""

    def __init__(
        self,
        pool: EnginePool,
        engines_up_for: Callable[[str], list[str]],
        estimator: TokenEstimator | None = None,
        blocks: BlockPolicy | None = None,
    ) -> None:
        self.pool = pool
        self.engines_up_for = engines_up_for
        self.estimator = estimator or TokenEstimator()
        self.blocks = blocks

    async def count(self, req: ChatRequest) -> PromptCount:
        blocks = self.blocks
        hashable = req.messages is not None or isinstance(req.prompt, str)
        if hashable and blocks is not None and blocks.wants_blocks(req.model, req.cls):
            ids = await self._token_ids(req)
            size = blocks.block_size_for(req.model)
            if ids is not None:
                return PromptCount(len(ids), estimated=False, blocks=chain(ids, size or 1))
            return PromptCount(self.estimator.estimate(req.model, req.text), estimated=True)
        if req.cls is TrafficClass.BATCH:
            exact = await self._tokenize(req)
            if exact is not None:
                return PromptCount(exact, estimated=False)
        return PromptCount(self.estimator.estimate(req.model, req.text), estimated=True)

    def learn(self, req: ChatRequest, count: PromptCount, usage_tokens: int) -> None:
        """The engine's count of an answered prompt: an estimate's model learns from it."""
        if count.estimated:
            self.estimator.learn(req.model, req.text, usage_tokens)

    async def _tokenize(self, req: ChatRequest) -> int | None:
        return await self._ask(req, counted=True)

    async def _token_ids(self, req: ChatRequest) -> list[int] | None:
        return await self._ask(req, counted=False)

    @overload
    async def _ask(self, req: ChatRequest, counted: Literal[True]) -> int | None: ...
    @overload
    async def _ask(self, req: ChatRequest, counted: Literal[False]) -> list[int] | None: ...

    async def _ask(self, req: ChatRequest, counted: bool) -> int | list[int] | None:
        """The engine's count (or token ids) of ``req``'s prompt; None where no engine
        is up or the engine could not tokenize it."""
        up = self.engines_up_for(req.model)
        if not up:
            return None
        client = self.pool.client_for(up[0])
        try:
            if counted:
                if req.messages is not None:
                    return await client.count_tokens(req.model, messages=req.messages)
                return await client.count_tokens(req.model, prompt=req.prompt)
            # a chat waits for it before its turn: bounded, so that a hung engine
            # costs it a moment (estimated, routed without blocks), not seconds
            limit = CHAT_TOKENIZE_S if req.cls is TrafficClass.INTERACTIVE else None
            if req.messages is not None:
                return await client.token_ids(req.model, messages=req.messages, timeout_s=limit)
            return await client.token_ids(req.model, prompt=req.prompt, timeout_s=limit)
        except (UpstreamError, ValueError) as exc:
            # A malformed prompt is the engine's to reject; count it roughly. The
            # client's doing (a 4xx, a bad shape) is no warning: any client could
            # fill the log with it.
            clients = isinstance(exc, ValueError) or (
                isinstance(exc, EngineHTTPError) and exc.status < 500
            )
            level = logging.DEBUG if clients else logging.WARNING
            logger.log(level, "tokenize failed on %s, estimating: %s", client.name, exc)
            return None
