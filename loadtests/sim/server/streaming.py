"""How an answer reaches the client, and how a client's hang-up aborts its request.

Streamed: :func:`sse_events` turns a :class:`TokenStream` into server-sent events;
:class:`EventStreamResponse` is Starlette's ``StreamingResponse`` (which listens
for ``http.disconnect`` beside the stream and cancels it) that also closes its
generator and token stream when it ends, so the engine request is aborted at once
rather than whenever the generator is collected.

Not streamed: :func:`collect` waits for every token while watching ``receive()``
for ``http.disconnect`` in the same anyio task group; whichever ends first cancels
the other.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

import anyio
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from loadtests.sim.request import SimRequest
from loadtests.sim.server.loop import TokenStream
from loadtests.sim.server.responses import DONE, Json, Renderer, sse, usage
from loadtests.sim.step_loop import TokenEvent

Decode = Callable[[int], str]


def request_usage(request: SimRequest, details: bool) -> Json:
    """The answer's ``usage``; with ``details`` (vLLM's
    ``--enable-prompt-tokens-details``) the prompt tokens the prefix cache held."""
    cached = max(request.num_cached_tokens, 0) if details else None
    return usage(request.num_prompt_tokens, len(request.output_token_ids), cached)


async def sse_events(
    stream: TokenStream,
    renderer: Renderer,
    decode: Decode,
    *,
    include_usage: bool,
    details: bool = False,
) -> AsyncGenerator[str, None]:
    """The event stream of one answer, ``data: [DONE]`` last; aborts if not run to the end."""
    try:
        async for event in stream:
            parts = [sse(c) for c in renderer.first_chunks()] if event.is_first else []
            finish = event.request.finish_reason if event.finished else None
            parts.append(sse(renderer.token_chunk(decode(event.token_id), finish)))
            yield "".join(parts)
        if include_usage:
            yield sse(renderer.usage_chunk(request_usage(stream.request, details)))
        yield DONE
    finally:
        stream.close()


class EventStreamResponse(StreamingResponse):
    """A ``text/event-stream`` response that closes its generator and stream when it ends.

    Closing the stream too covers a client gone before the generator first ran
    (closing a generator that never started does not run its ``finally``).
    """

    def __init__(
        self, events: AsyncGenerator[str, None], stream: TokenStream, headers: dict[str, str]
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._events.aclose()
            self._stream.close()


async def collect(request: Request, stream: TokenStream) -> list[TokenEvent] | None:
    """Every token of the answer, or None if the client hung up first (then aborted)."""
    events: list[TokenEvent] = []
    disconnected = False
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            nonlocal disconnected
            while (await request.receive())["type"] != "http.disconnect":
                pass
            disconnected = True
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            async for event in stream:
                events.append(event)
        finally:
            stream.close()
        group.cancel_scope.cancel()
    return None if disconnected else events


def answer_text(events: list[TokenEvent], decode: Decode) -> str:
    return "".join(decode(e.token_id) for e in events)
