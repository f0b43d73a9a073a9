"""Prompt-token counts: the one place that decides how big a request's prompt is.

- Batch requests are counted exactly, by ``POST /tokenize`` on the first up engine
  serving the model (the engine client caches counts by content).
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

from proxy.engines import EngineHTTPError, EnginePool, UpstreamError
from proxy.openai.request import ChatRequest
from proxy.scheduler import TrafficClass

logger = logging.getLogger(__name__)


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


class PromptCounter:
    """Counts prompts (see the module docstring); ``engines_up_for(model)`` names the
    up engines serving a model, in configuration order."""

    def __init__(
        self,
        pool: EnginePool,
        engines_up_for: Callable[[str], list[str]],
        estimator: TokenEstimator | None = None,
    ) -> None:
        self.pool = pool
        self.engines_up_for = engines_up_for
        self.estimator = estimator or TokenEstimator()

    async def count(self, req: ChatRequest) -> PromptCount:
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
        up = self.engines_up_for(req.model)
        if not up:
            return None
        client = self.pool.client_for(up[0])
        try:
            if req.messages is not None:
                return await client.count_tokens(req.model, messages=req.messages)
            return await client.count_tokens(req.model, prompt=req.prompt)
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
