"""Real text for the load tests: Python's own documentation, sliced into prompts.

The passages are the topic texts that ship with Python (``pydoc_data.topics``, the
same text the small model's tokenizer was trained on), read in a fixed order, so
every run on every machine sends the same prompts. A prompt is sized in the engine's
own tokens with ``POST /tokenize``.

vLLM caches prompt prefixes by whole blocks, each block's hash chained to the one
before: two prompts that differ in their first tokens share no block. Every prompt
here starts with its own header line, so no prompt's prefill is ever skipped, even
when the same passage is sent again in a later repetition.

These are text prompts of real prose, sized to within 0.5% by bisection, because
the harness sends what users send. The measuring tools (probe, calibration) want
token-id prompts of an exact length instead: :class:`loadtests.engine_io.PromptMaker`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import httpx


@cache
def corpus() -> str:
    """All of Python's topic texts, in key order, as one string."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[key].strip() for key in sorted(topics))


@dataclass(frozen=True)
class Prompt:
    text: str
    tokens: int  # as the engine counts them (completions ``prompt``, or chat ``messages``)


class Tokenizer:
    """The engine's ``/tokenize``, for sizing prompts."""

    def __init__(self, http: httpx.Client, model: str) -> None:
        self.http = http
        self.model = model

    def count_prompt(self, text: str) -> int:
        return self._count({"prompt": text})

    def count_messages(self, messages: list[dict[str, str]]) -> int:
        return self._count({"messages": messages})

    def _count(self, body: dict[str, object]) -> int:
        response = self.http.post("/tokenize", json={"model": self.model, **body})
        response.raise_for_status()
        return int(response.json()["count"])


def passage(start: int, chars: int) -> str:
    """``chars`` characters of the corpus from ``start``, wrapping around its end."""
    text = corpus()
    start %= len(text)
    out = text[start : start + chars]
    while len(out) < chars:
        out += ("\n\n" + text)[: chars - len(out)]
    return out


def sized_prompt(tokenizer: Tokenizer, header: str, start: int, tokens: int) -> Prompt:
    """``header`` then a passage from ``start``, cut so that the whole prompt has
    ``tokens`` tokens or just under (within 0.5%), by bisection on its length."""
    lo, hi = 0, tokens * 8  # characters; a token is at least one character
    best: Prompt | None = None
    for _ in range(40):
        chars = (lo + hi) // 2
        text = f"{header}\n\n{passage(start, chars)}"
        count = tokenizer.count_prompt(text)
        if count <= tokens:
            best = Prompt(text, count)
            if count >= tokens * 0.995:
                return best
            lo = chars + 1
        else:
            hi = chars - 1
        if lo > hi:
            break
    raise RuntimeError(f"could not size a prompt to {tokens} tokens (best {best})")
