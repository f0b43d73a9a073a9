"""vLLM's KV-cache events, published by the simulated engine as vLLM 0.32 does.

A router that places requests by prefix-cache affinity (vllm-router's ``kv_aware``
policy, or our proxy) learns which blocks each engine holds from these events; with
them the simulator can stand in for a fleet of real engines. The wire format is
vLLM's (``vllm/distributed/kv_events.py``, reimplemented here):

* a ZMQ PUB socket at ``endpoint`` sends one 3-frame message per engine step that
  changed the cache: ``(topic, seq, payload)``, ``seq`` an 8-byte big-endian
  counter from 0 per publisher;
* ``payload`` is msgpack of :class:`KVEventBatch`, an array ``[ts, events,
  data_parallel_rank]``; each event is a map tagged ``"type": <class name>``
  (``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``), fields left at their
  default omitted;
* with a ``replay_endpoint``, a ROUTER socket answers ``(b"", start_seq)`` with
  every buffered message from ``start_seq`` on, each as ``(b"", topic, seq,
  payload)``, then ``(b"", b"", -1, b"")``.

Block hashes go out as unsigned 64-bit ints, as vLLM's do by default
(``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``); the simulator's own hash is a signed
Python hash, mapped one to one by :func:`external_block_hash`. Which cache changes
become events, and when, is :mod:`loadtests.sim.kv_cache`'s and
:mod:`loadtests.sim.step_loop`'s business; this module has the structs, the
``--kv-events-config`` settings and the publisher.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import deque
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

import msgspec

if TYPE_CHECKING:
    import zmq

logger = logging.getLogger(__name__)

MEDIUM_GPU = "GPU"
FULL_ATTENTION = "full_attention"
"""The cache-spec kind vLLM reports for a decoder's one full-attention group."""
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number of the replay's end marker."""

_HASH_MASK = (1 << 64) - 1
_STOP = b"stop"


# -- the events (vLLM's field names, order and defaults) ----------------------------


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Any KV-cache event: encoded as a map whose ``type`` is the class name."""


class BlockStored(KVCacheEvent):
    """Full blocks whose contents became reusable, in prefix order."""

    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(KVCacheEvent):
    """Cached blocks whose contents were dropped (their block was reused)."""

    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    """The whole prefix cache was reset."""


AnyKVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """The events of one engine step, encoded as an array."""

    ts: float
    events: list[AnyKVCacheEvent]
    data_parallel_rank: int | None = None


def external_block_hash(block_hash: int) -> int:
    """The simulator's block hash as vLLM publishes one: an unsigned 64-bit int."""
    return block_hash & _HASH_MASK


def block_stored(
    hashes: list[int], parent: int | None, token_ids: list[int], block_size: int
) -> BlockStored:
    """The event vLLM 0.32 sends for newly cached blocks of a request without LoRA,
    multimodal inputs or cache salt: one group (index 0) of full attention, and no
    extra hash keys for any block (so one ``None`` per block)."""
    return BlockStored(
        block_hashes=[external_block_hash(h) for h in hashes],
        parent_block_hash=None if parent is None else external_block_hash(parent),
        token_ids=token_ids,
        block_size=block_size,
        lora_id=None,
        medium=MEDIUM_GPU,
        lora_name=None,
        extra_keys=[None] * len(hashes),
        group_idx=0,
        kv_cache_spec_kind=FULL_ATTENTION,
    )


def block_removed(block_hash: int) -> BlockRemoved:
    """The event vLLM 0.32 sends for one evicted block (one event per block)."""
    return BlockRemoved(
        block_hashes=[external_block_hash(block_hash)], medium=MEDIUM_GPU, group_idx=0
    )


# -- settings ---------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class KVEventsConfig:
    """``--kv-events-config``: vLLM's ``KVEventsConfig`` keys and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str | None = None
    """``zmq`` or ``null``; None picks ``zmq`` when events are enabled, as vLLM does."""
    endpoint: str = "tcp://*:5557"
    """Bound when it has a wildcard (``*``, ``::``) or is ipc/inproc, else connected to."""
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    """Batches kept for replay."""
    hwm: int = 100_000
    max_queue_size: int = 100_000
    """Batches waiting for the publisher thread; one more is dropped (a gap in seq)."""
    topic: str = ""

    def __post_init__(self) -> None:
        if self.publisher not in (None, "zmq", "null"):
            raise ValueError(f"kv-events-config: unknown publisher {self.publisher!r}")
        if self.buffer_steps < 0 or self.hwm < 0 or self.max_queue_size < 1:
            raise ValueError("kv-events-config: buffer_steps and hwm must be >= 0, "
                             "max_queue_size >= 1")  # fmt: skip

    @property
    def publishes(self) -> bool:
        """Whether events go out at all (enabled, and the publisher is not ``null``)."""
        return self.enable_kv_cache_events and self.publisher != "null"

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Parse the flag's JSON object; ValueError names a bad key or value."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"kv-events-config: not JSON: {exc}") from exc
        if not isinstance(data, dict):
            raise ValueError("kv-events-config: expected a JSON object")
        known = {f.name: f.type for f in fields(cls)}
        for key, value in data.items():
            if key not in known:
                raise ValueError(f"kv-events-config: unknown key {key!r} (known: "
                                 f"{', '.join(known)})")  # fmt: skip
            if not _fits(value, str(known[key])):
                raise ValueError(f"kv-events-config: {key} must be {known[key]}, got {value!r}")
        return cls(**data)


def _fits(value: Any, annotation: str) -> bool:
    """Whether a JSON value fits one of the (simple) field annotations above."""
    if value is None:
        return "None" in annotation
    if isinstance(value, bool):
        return annotation.startswith("bool")
    if isinstance(value, int):
        return annotation.startswith("int")
    return isinstance(value, str) and annotation.startswith("str")


# -- publishing -------------------------------------------------------------------


class EventPublisher(Protocol):
    """Where the engine hands each step's batch; called from one thread only."""

    def publish(self, batch: KVEventBatch) -> None: ...

    def shutdown(self) -> None: ...


def create_publisher(config: KVEventsConfig | None) -> EventPublisher | None:
    """The publisher the settings ask for; None when no event is to go out."""
    if config is None or not config.publishes:
        return None
    return ZmqEventPublisher(config)


def _is_bind_endpoint(endpoint: str) -> bool:
    """vLLM's rule: wildcard and ipc/inproc endpoints are bound, others connected."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    """vLLM's PUB/ROUTER publisher, with its replay buffer.

    :meth:`publish` never blocks the caller (the simulator's asyncio step loop): it
    numbers and encodes the batch and passes it over an in-process socket to a
    thread that owns the PUB and ROUTER sockets, sends, keeps the last
    ``buffer_steps`` batches and answers replay requests as they come (polled
    together with the batches, so a replay waits for nothing). Numbering at publish
    time means a batch dropped on a full queue shows as a gap in ``seq``, which a
    subscriber can see, rather than vanishing.
    """

    SHUTDOWN_TIMEOUT_S = 1.0

    def __init__(self, config: KVEventsConfig, *, data_parallel_rank: int = 0) -> None:
        import zmq

        self._rank = data_parallel_rank
        self._topic = config.topic.encode("utf-8")
        self._encoder = msgspec.msgpack.Encoder()
        self._seq = 0
        self._dropped = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._ctx = zmq.Context()
        try:
            queue = f"inproc://kv-events-{id(self)}"
            self._pull = self._ctx.socket(zmq.PULL)
            self._pull.bind(queue)
            self._push = self._ctx.socket(zmq.PUSH)
            self._push.set_hwm(config.max_queue_size)
            self._push.connect(queue)
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(config.hwm)
            if _is_bind_endpoint(config.endpoint):
                self._pub.bind(config.endpoint)
                self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._pub.connect(config.endpoint)
                self.endpoint = config.endpoint
            self._replay: zmq.Socket[bytes] | None = None
            self.replay_endpoint: str | None = None
            if config.replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
                self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT)
        except zmq.ZMQError:
            self._ctx.destroy(linger=0)
            raise
        self._thread = threading.Thread(target=self._serve, name="kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "KV cache events: publishing on %s (replay: %s, topic %r)",
            self.endpoint,
            self.replay_endpoint or "none",
            config.topic,
        )

    def publish(self, batch: KVEventBatch) -> None:
        """Number, encode and queue one step's batch for the publisher thread."""
        import zmq

        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._rank
        seq = self._seq
        self._seq += 1
        payload = self._encoder.encode(batch)
        try:
            self._push.send_multipart((seq.to_bytes(8, "big"), payload), zmq.NOBLOCK)
        except zmq.Again:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                logger.warning("KV cache events: queue full, %d batches dropped", self._dropped)

    def shutdown(self) -> None:
        """Send what was queued, stop the thread, close the sockets; idempotent."""
        import zmq

        if self._push.closed:
            return
        try:
            self._push.send(_STOP, zmq.NOBLOCK)
        except zmq.Again:
            logger.warning("KV cache events: queue full at shutdown; batches lost")
        self._thread.join(self.SHUTDOWN_TIMEOUT_S)
        self._push.close(linger=0)
        if self._thread.is_alive():
            logger.warning("KV cache events: publisher thread did not stop")
            return
        self._ctx.term()

    # -- the publisher thread ----------------------------------------------------------

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if self._replay is not None and self._replay in ready:
                    try:
                        self._answer_replay(self._replay)
                    except zmq.ZMQError:  # a replay is best effort; publishing goes on
                        logger.exception("KV cache events: answering a replay request")
                if self._pull in ready and not self._send_next():
                    return
        finally:
            # what the PUB socket still holds goes out to connected subscribers
            self._pub.close(linger=int(self.SHUTDOWN_TIMEOUT_S * 1000))
            self._pull.close(linger=0)
            if self._replay is not None:
                self._replay.close(linger=0)

    def _send_next(self) -> bool:
        """Publish the next queued batch; False on the stop message."""
        import zmq

        frames = self._pull.recv_multipart()
        if len(frames) != 2:
            return False
        seq_bytes, payload = frames
        try:
            self._pub.send_multipart((self._topic, seq_bytes, payload), zmq.NOBLOCK)
        except zmq.Again:
            pass  # a PUB socket at its high-water mark drops; the replay still has it
        except zmq.ZMQError:
            logger.exception("KV cache events: sending batch %d", int.from_bytes(seq_bytes))
        self._buffer.append((int.from_bytes(seq_bytes, "big"), payload))
        return True

    def _answer_replay(self, replay: zmq.Socket[bytes]) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV cache events: bad replay request (%d frames)", len(frames))
            return
        client, _, start_bytes = frames
        start = int.from_bytes(start_bytes, "big")
        for seq, payload in self._buffer:
            if seq >= start:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))
