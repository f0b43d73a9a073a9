"""Prompts of an exact number of the engine's own tokens, unique from the first token.

A prompt is random words behind a fresh random tag, run through the engine's
``/tokenize`` (without special tokens, so the tag comes first) and cut to the exact
length. Sent as token ids, no two prompts share a prefix-cache block, so every
prompt is prefilled in full.
"""

from __future__ import annotations

import math
import random

import httpx

from loadtests.engine_io.info import EngineIOError, post_json

_WORDS = (
    "time year people way day man thing woman life child world school state family "
    "student group country problem hand part place case week company system program "
    "question work government number night point home water room mother area money "
    "story fact month lot right study book eye job word business issue side kind head "
    "house service friend father power hour game line end member law car city name "
    "president team minute idea kid body information back parent face others level "
    "office door health person art war history party result change morning reason "
    "research girl guy moment air teacher force education river garden window letter"
).split()
_TRIES = 6


class PromptMaker:
    """Prompts of an exact number of tokens, each unique from its first token on."""

    def __init__(
        self, client: httpx.AsyncClient, model: str, rng: random.Random | None = None
    ) -> None:
        self._client = client
        self._model = model
        self._rng = rng or random.Random()
        self._tokens_per_word = 1.5

    def text(self, words: int) -> str:
        """A fresh random tag, then ``words`` random words."""
        tag = f"{self._rng.getrandbits(48):012x}"
        return tag + " " + " ".join(self._rng.choice(_WORDS) for _ in range(words))

    async def make(self, tokens: int) -> list[int]:
        """Token ids of a fresh random text, cut to exactly ``tokens``."""
        words = math.ceil(tokens / self._tokens_per_word * 1.1) + 8
        for _ in range(_TRIES):
            ids = await self.tokenize(self.text(words))
            self._tokens_per_word = max(0.1, len(ids) / (words + 1))
            if len(ids) >= tokens:
                return ids[:tokens]
            words = math.ceil(words * 1.5)
        raise EngineIOError(f"could not build a {tokens}-token prompt through /tokenize")

    async def tokenize(self, text: str) -> list[int]:
        """The engine's token ids of ``text``, without special tokens."""
        body = {"model": self._model, "prompt": text, "add_special_tokens": False}
        tokens = (await post_json(self._client, "/tokenize", body)).get("tokens")
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise EngineIOError("/tokenize answered without a list of token ids")
        return tokens
