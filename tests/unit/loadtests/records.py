"""Records of requests as the load-test client keeps them, built for the tests."""

from __future__ import annotations

from typing import Any

from loadtests.harness.client import Record


def record(
    n: int, *, kind: str = "x", sent_at: float = 0.0, max_tokens: int = 4, **fields: Any
) -> Record:
    """Request ``n`` of ``kind`` (its id ``KIND-N``), sent at ``sent_at`` to a URL that
    does not matter, no prompt tokens counted by the client; ``fields`` set the rest."""
    return Record(
        id=f"{kind}-{n}",
        kind=kind,
        url="u",
        prompt_tokens_sent=0,
        max_tokens=max_tokens,
        sent_at=sent_at,
        **fields,
    )
