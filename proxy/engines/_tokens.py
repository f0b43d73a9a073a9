"""A bounded least-recently-used cache of prompt token counts.

Keys are ``(model, digest)``: the digest is a SHA-256 of the canonical JSON of
the prompt or messages, so the cache never holds prompt text itself.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from typing import Any

DEFAULT_TOKEN_CACHE_SIZE = 4096

CacheKey = tuple[str, str]


def content_key(model: str, kind: str, content: Any) -> CacheKey:
    """The cache key of ``content`` (a prompt or a messages list) for ``model``."""
    text = json.dumps([kind, content], sort_keys=True, separators=(",", ":"), default=str)
    return model, hashlib.sha256(text.encode()).hexdigest()


class TokenCountCache:
    """At most ``size`` counts; the least recently used one goes first."""

    def __init__(self, size: int = DEFAULT_TOKEN_CACHE_SIZE) -> None:
        if size < 0:
            raise ValueError(f"cache size must be at least 0, got {size}")
        self.size = size
        self._counts: OrderedDict[CacheKey, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._counts)

    def get(self, key: CacheKey) -> int | None:
        count = self._counts.get(key)
        if count is not None:
            self._counts.move_to_end(key)
        return count

    def put(self, key: CacheKey, count: int) -> None:
        if self.size == 0:
            return
        self._counts[key] = count
        self._counts.move_to_end(key)
        while len(self._counts) > self.size:
            self._counts.popitem(last=False)
