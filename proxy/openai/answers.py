"""One whole answer for work with no client connection (a batch line's), as the
request path hands it to the Batch API: the status, the JSON body's bytes as a
client would have had them, and the same body as the object they were made from,
to be read (usage, the answer's text) but never written again."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Answer:
    """``raw`` is ``body`` as JSON text on one line (UTF-8)."""

    status: int
    raw: bytes
    body: dict[str, Any]

    @classmethod
    def of(cls, status: int, body: dict[str, Any]) -> Answer:
        """An answer made here (an error, a test's): ``body`` written once."""
        return cls(status, json.dumps(body).encode(), body)


def cached_tokens(usage: dict[str, Any]) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens``: the prompt tokens the engine
    found in its prefix cache (vLLM with ``--enable-prompt-tokens-details``); None
    where the answer does not say."""
    details = usage.get("prompt_tokens_details")
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) else None
