"""The limits on request bodies, kept as a body is read:

- a body larger than ``max_body_bytes`` (or the limit ``path_limits`` gives its path:
  the Files API's uploads) is refused with 413 before it is read in full: at once
  when ``Content-Length`` says so, else as soon as the bytes received pass the limit
  (the handler reading the body gets the :class:`~proxy.openai.errors.APIError`);
- no body bytes for ``body_timeout_s`` while the application waits for them: 408,
  and the connection closed;
- the bytes of every body in flight are counted against ``max_body_bytes_in_flight``
  (:mod:`proxy.api.inflight`), and a body the budget cannot take is refused with 503
  and ``Retry-After``: before it is read when ``Content-Length``
  says so, else as its chunks arrive. Uploads under ``path_limits`` are not counted:
  their routes stream them to disk.

:class:`~proxy.api.intake.Intake` opens each request's :class:`BodyRead`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from starlette.types import Message, Receive, Scope

from proxy.api.inflight import BodyBudget, BodyTicket, MemoryReturn, glibc_malloc_trim
from proxy.openai.errors import APIError

BUSY_RETRY_AFTER_S = 1


def too_large(limit: int) -> APIError:
    message = f"The request body is larger than the limit of {limit} bytes."
    return APIError(413, message, code="request_too_large")


def too_slow(timeout_s: float) -> APIError:
    message = f"No bytes of the request body arrived for {timeout_s:g} s."
    return APIError(408, message, code="request_timeout", headers={"Connection": "close"})


def bodies_busy(limit: int) -> APIError:
    message = (
        f"The proxy holds as many request bodies as it may ({limit} bytes in flight, "
        "max_body_bytes_in_flight); retry shortly."
    )
    headers = {"Retry-After": str(BUSY_RETRY_AFTER_S)}
    return APIError(
        503, message, err_type="service_unavailable", code="server_busy", headers=headers
    )


def declared_length(scope: Scope) -> int | None:
    """The request's ``Content-Length``, if it gives a readable one."""
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


class BodyLimits:
    """The app's limits (the module docstring). ``body_timeout_s`` None: no body read
    timeout; ``max_body_bytes_in_flight`` None: bodies in flight not counted."""

    def __init__(
        self,
        *,
        max_body_bytes: int,
        path_limits: Mapping[str, int] | None = None,
        body_timeout_s: float | None = None,
        max_body_bytes_in_flight: int | None = None,
    ) -> None:
        self.limit = max_body_bytes
        self.path_limits = dict(path_limits or {})
        self.body_timeout_s = body_timeout_s
        self.bodies = (
            None if max_body_bytes_in_flight is None else BodyBudget(max_body_bytes_in_flight)
        )
        self.memory = MemoryReturn(
            collect_after_bytes=max_body_bytes_in_flight or 8 * max_body_bytes,
            trim=glibc_malloc_trim(),
        )

    def open(self, scope: Scope) -> BodyRead:
        """The request's body read under the limits; raises :func:`too_large` or
        :func:`bodies_busy` (nothing held) where its ``Content-Length`` says so."""
        limit = self.path_limits.get(scope["path"], self.limit)
        length = declared_length(scope)
        if length is not None and length > limit:
            raise too_large(limit)
        ticket = self._ticket(scope)
        if ticket is not None and length and not ticket.cover(length):
            raise bodies_busy(ticket.budget.limit)
        return BodyRead(self, limit, ticket)

    def _ticket(self, scope: Scope) -> BodyTicket | None:
        """The request's reservation in the budget, if its body is counted."""
        if self.bodies is None or scope["path"] in self.path_limits:
            return None
        return self.bodies.ticket()


class BodyRead:
    """One request's body under its ``limit``, its bytes reserved by ``ticket`` (None:
    not counted); :meth:`close` when the request ends."""

    def __init__(self, limits: BodyLimits, limit: int, ticket: BodyTicket | None) -> None:
        self.limits = limits
        self.limit = limit
        self.ticket = ticket

    def receive(self, receive: Receive) -> Receive:
        """``receive``, raising :func:`too_large` once the body passes the limit,
        :func:`bodies_busy` once the budget cannot take it, and :func:`too_slow`
        when the next piece of the body takes longer than ``body_timeout_s``."""
        seen = 0
        complete = False
        limit, ticket, timeout_s = self.limit, self.ticket, self.limits.body_timeout_s

        async def limited() -> Message:
            nonlocal seen, complete
            if complete or timeout_s is None:
                message = await receive()
            else:
                try:
                    async with asyncio.timeout(timeout_s):
                        message = await receive()
                except TimeoutError:
                    raise too_slow(timeout_s) from None
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                complete = not message.get("more_body", False)
                if seen > limit:
                    raise too_large(limit)
                if ticket is not None and not ticket.cover(seen):
                    raise bodies_busy(ticket.budget.limit)
            return message

        return limited

    def close(self) -> None:
        """The request ended: its bytes go back to the budget, its memory to the system."""
        if self.ticket is not None:
            held = self.ticket.reserved
            self.ticket.release()
            self.limits.memory.body_freed(held)
