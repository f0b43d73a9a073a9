"""vLLM's KV-cache events, read off the engine's ZMQ publisher for the prefix index.

An engine started with ``--kv-events-config`` (``"publisher": "zmq"``) publishes
on a PUB socket one message per batch of events, three frames: a topic, a
sequence number (8 bytes, big-endian, counting up from 0 in each engine process)
and a msgpack payload ``[ts, events, data_parallel_rank]`` whose events are maps
tagged by ``"type"``: ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``.
With a ``replay_endpoint`` the engine also keeps its last batches behind a ROUTER
socket: a request ``(b"", start_seq)`` is answered with ``(b"", topic, seq,
payload)`` for every buffered batch from ``start_seq`` on, then an end marker of
sequence -1.

:func:`decode_kv_events` turns a payload into :mod:`proxy.scheduler.prefix`'s
:class:`Stored`, :class:`Removed` and :class:`Cleared`, keeping only what the index
can name: blocks of the GPU cache (not a CPU or storage offload tier), of the
first KV-cache group (not a hybrid model's other groups), and hashed from their
token ids alone (not a LoRA adapter's, a multimodal input's or a salted prompt's,
whose blocks the index's token-only :func:`~proxy.scheduler.prefix.chain` would
mistake for plain text's). Fields and event types this module does not know are
passed over, so a newer engine's additions do not stop the stream.

:class:`KVEventSubscriber` follows one engine's stream and hands each batch's
events to a callback, in order. PUB/SUB drops messages when a reader falls
behind or reconnects, and one lost removal leaves the index believing in a block
the engine no longer holds; so the subscriber tracks the sequence numbers:

- a gap is filled from the replay endpoint when there is one and it still holds
  the missed batches; else the callback's events begin with :class:`Cleared`, so
  the index forgets what it can no longer trust, and a warning is logged;
- the first batch it reads, and one whose number goes back (the engine
  restarted), begin with :class:`Cleared` too: nothing held before was learnt
  from this stream. With a replay endpoint the engine's buffered history before
  that batch is read first (``catch_up``), so an index started after its engine
  knows the engine's cache at once.

It cannot tell an engine restart whose new numbers happen to continue the old
ones (the reader missed exactly the new engine's first batches) from a gap; such
an index keeps the old engine's blocks until they age out.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import anyio
import msgspec
import zmq
import zmq.asyncio

from proxy.scheduler.prefix import Cleared, KVEvent, Removed, Stored

__all__ = ["KVEventSubscriber", "decode_kv_events"]

logger = logging.getLogger(__name__)

END_SEQ = -1  # the replay's end marker
GPU = "GPU"


class _BlockStored(msgspec.Struct, tag="BlockStored", gc=False):
    block_hashes: list[int | bytes]
    parent_block_hash: int | bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None


class _BlockRemoved(msgspec.Struct, tag="BlockRemoved", gc=False):
    block_hashes: list[int | bytes]
    medium: str | None = None
    group_idx: int | None = None


class _AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared", gc=False):
    pass


_Event = _BlockStored | _BlockRemoved | _AllBlocksCleared


class _Batch(msgspec.Struct, array_like=True, gc=False):
    ts: float
    events: list[_Event]


class _RawBatch(msgspec.Struct, array_like=True, gc=False):
    """A batch whose events are decoded one by one: one holds a type not known here."""

    ts: float
    events: list[msgspec.Raw]


_BATCH = msgspec.msgpack.Decoder(_Batch)
_RAW_BATCH = msgspec.msgpack.Decoder(_RawBatch)
_EVENT = msgspec.msgpack.Decoder(_Event)


def decode_kv_events(payload: bytes) -> list[KVEvent]:
    """The events of one published batch that the prefix index can use, in order.

    Raises :class:`msgspec.DecodeError` (or its :class:`msgspec.ValidationError`)
    when ``payload`` is not a batch at all."""
    try:
        events: Sequence[_Event] = _BATCH.decode(payload).events
    except msgspec.ValidationError:
        # One event of a type this module does not know (a newer engine's)
        # fails the whole batch; decode the rest one by one.
        events = [e for e in map(_known_event, _RAW_BATCH.decode(payload).events) if e is not None]
    out: list[KVEvent] = []
    for event in events:
        if isinstance(event, _BlockStored):
            if _ours(event.medium, event.group_idx) and _token_keyed(event):
                out.append(
                    Stored(
                        hashes=event.block_hashes,
                        parent=event.parent_block_hash,
                        token_ids=event.token_ids,
                        block_size=event.block_size,
                    )
                )
        elif isinstance(event, _BlockRemoved):
            if _ours(event.medium, event.group_idx):
                out.append(Removed(hashes=event.block_hashes))
        else:
            out.append(Cleared())
    return out


def _known_event(raw: msgspec.Raw) -> _Event | None:
    try:
        return _EVENT.decode(raw)
    except msgspec.ValidationError as exc:
        logger.debug("KV event passed over: %s", exc)
        return None


def _ours(medium: str | None, group_idx: int | None) -> bool:
    """The GPU cache's first group: the blocks a prompt's prefill can reuse."""
    return medium in (None, GPU) and group_idx in (None, 0)


def _token_keyed(event: _BlockStored) -> bool:
    """Whether the blocks' hashes cover their token ids and nothing else."""
    if event.lora_name is not None or event.lora_id is not None:
        return False
    return event.extra_keys is None or all(key is None for key in event.extra_keys)


class KVEventSubscriber:
    """Follows engine ``name``'s KV events at ``endpoint`` (connectable, e.g.
    ``tcp://10.0.0.5:5557``: the engine's own ``tcp://*:5557`` is where it binds),
    handing each batch's events to ``on_events(name, events)`` (never empty).

    :meth:`run` reads until cancelled; ZMQ reconnects by itself when the engine
    goes and comes back. The counters are for metrics: ``batches`` read (live or
    replayed), ``events`` handed on (as decoded, not the :class:`Cleared` this
    class adds), ``gaps`` (missed batches, filled or not), ``lost`` (gaps and
    undecodable batches the index was cleared for), ``restarts`` (the engine's
    numbers went back), ``last_at`` (wall time of the last batch read, None
    before one) and ``last_seq``.

    An exception from ``on_events`` ends :meth:`run`: the caller's task group
    decides what follows."""

    def __init__(
        self,
        name: str,
        endpoint: str,
        on_events: Callable[[str, list[KVEvent]], None],
        *,
        replay_endpoint: str | None = None,
        catch_up: bool = True,
        replay_timeout_s: float = 2.0,
        receive_hwm: int = 100_000,
        context: zmq.asyncio.Context | None = None,
    ):
        for address in (endpoint, replay_endpoint):
            if address is not None and "*" in address:
                raise ValueError(
                    f"engine {name}: {address!r} is a bind address; "
                    "give the engine's host, e.g. tcp://engine-host:5557"
                )
        self.name = name
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.catch_up = catch_up
        self.replay_timeout_s = replay_timeout_s
        self.receive_hwm = receive_hwm
        self._on_events = on_events
        self._context = context
        self.batches = 0
        self.events = 0
        self.gaps = 0
        self.lost = 0
        self.restarts = 0
        self.last_at: float | None = None
        self.last_seq: int | None = None

    async def run(self) -> None:
        """Read the engine's batches until cancelled (which closes the sockets)."""
        context = self._context or zmq.asyncio.Context.instance()
        sub = context.socket(zmq.SUB)
        try:
            sub.linger = 0
            sub.rcvhwm = self.receive_hwm  # live batches wait here during a replay
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.connect(self.endpoint)
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    logger.debug("engine %s: KV event message of %d frames", self.name, len(frames))
                    continue
                await self._received(context, _seq(frames[1]), frames[2])
        finally:
            sub.close(linger=0)

    async def _received(self, context: zmq.asyncio.Context, seq: int, payload: bytes) -> None:
        self.last_at = time.time()
        expected = None if self.last_seq is None else self.last_seq + 1
        self.last_seq = seq
        clear = False
        missed: list[tuple[int, bytes]] = []
        if expected is None or seq < expected:
            if expected is not None:
                self.restarts += 1
                logger.warning(
                    "engine %s: KV event numbers went back from %d to %d (engine restarted); "
                    "its prefix index starts over",
                    self.name,
                    expected - 1,
                    seq,
                )
            clear = True
            if self.catch_up:
                missed, _ = await self._replay(context, 0, seq)
        elif seq > expected:
            self.gaps += 1
            missed, complete = await self._replay(context, expected, seq)
            if complete:
                logger.info(
                    "engine %s: KV event batches %d-%d missed, replayed",
                    self.name,
                    expected,
                    seq - 1,
                )
            else:
                clear = True
                self.lost += 1
                logger.warning(
                    "engine %s: KV event batches %d-%d missed%s; its prefix index starts over",
                    self.name,
                    expected,
                    seq - 1,
                    "" if self.replay_endpoint is None else " and not replayable",
                )
        events = self._decode([*missed, (seq, payload)], clear)
        if events:
            self._on_events(self.name, events)

    def _decode(self, batches: Sequence[tuple[int, bytes]], clear: bool) -> list[KVEvent]:
        events: list[KVEvent] = [Cleared()] if clear else []
        for seq, payload in batches:
            self.batches += 1
            try:
                decoded = decode_kv_events(payload)
            except msgspec.DecodeError as exc:
                self.lost += 1
                logger.warning(
                    "engine %s: KV event batch %d undecodable (%s); its prefix index starts over",
                    self.name,
                    seq,
                    exc,
                )
                events = [Cleared()]
                continue
            self.events += len(decoded)
            events.extend(decoded)
        return events

    async def _replay(
        self, context: zmq.asyncio.Context, start: int, stop: int
    ) -> tuple[list[tuple[int, bytes]], bool]:
        """The engine's buffered batches ``start`` to ``stop - 1`` that lead up to
        ``stop`` without a hole, and whether they are all of them."""
        if start >= stop:
            return [], True
        if self.replay_endpoint is None:
            return [], False
        got: dict[int, bytes] = {}
        dealer = context.socket(zmq.DEALER)  # one per request: a late answer dies with it
        try:
            dealer.linger = 0
            dealer.connect(self.replay_endpoint)
            await dealer.send_multipart((b"", start.to_bytes(8, "big")))
            with anyio.move_on_after(self.replay_timeout_s) as scope:
                while True:
                    frames = await dealer.recv_multipart()
                    if len(frames) != 4:
                        continue
                    seq = _seq(frames[2])
                    if seq == END_SEQ:
                        break
                    if start <= seq < stop:
                        got[seq] = frames[3]
            if scope.cancelled_caught:
                logger.warning(
                    "engine %s: no KV event replay from %s within %.1f s",
                    self.name,
                    self.replay_endpoint,
                    self.replay_timeout_s,
                )
        finally:
            dealer.close(linger=0)
        first = stop
        while first - 1 in got:
            first -= 1
        return [(seq, got[seq]) for seq in range(first, stop)], first == start


def _seq(frame: bytes) -> int:
    return int.from_bytes(frame, "big", signed=True)
