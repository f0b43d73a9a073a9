"""One request on its way through the edge (:class:`Ticket`): what the request path
(:mod:`proxy.api.forward`), the relay of its answer (:mod:`proxy.api.relay`) and the
sending of its pieces (:mod:`proxy.api.piece_sender`) know of it."""

from __future__ import annotations

from dataclasses import dataclass

from proxy.api.prompts import PromptCount
from proxy.openai.request import ChatRequest


@dataclass(frozen=True)
class Ticket:
    """One request on its way: its job id, what it asked, when it came, its size."""

    id: str
    req: ChatRequest
    arrival: float
    count: PromptCount
