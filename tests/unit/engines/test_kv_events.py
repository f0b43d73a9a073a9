"""vLLM's KV-cache events: decoded for the prefix index, followed over real ZMQ sockets.

The publisher here speaks vLLM's wire format (``vllm/distributed/kv_events.py``):
a PUB socket sending ``(topic, seq, payload)``, a ROUTER answering replay
requests, payloads encoded from structs declared as vLLM declares them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.abc
import anyio.to_thread
import msgspec
import pytest
import zmq
import zmq.asyncio
from anyio.streams.memory import MemoryObjectReceiveStream

from proxy.engines import KVEventSubscriber, decode_kv_events
from proxy.scheduler.prefix import Cleared, KVEvent, PrefixIndex, Removed, Stored, chain
from tests.support.vllm_kv_wire import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVCacheEvent,
)

pytestmark = pytest.mark.anyio

LOGGER = "proxy.engines._kv_events"
BS = 4  # block size

# -- vLLM's structs (tests/support/vllm_kv_wire.py), and a newer engine's ----------


# A newer engine's: fields and an event type this proxy does not know.
class NewerBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    checksum: str = "abc"
    replicas: list[int] = msgspec.field(default_factory=lambda: [1, 2])


class BlockTouched(KVCacheEvent):
    block_hashes: list[bytes | int]


class NewerEventBatch(EventBatch):
    trace_id: str = "t-1"


def stored(
    hashes: list[bytes | int],
    tokens: list[int],
    parent: bytes | int | None = None,
    **fields: Any,
) -> BlockStored:
    base: dict[str, Any] = {"lora_id": None, "medium": "GPU", "lora_name": None}
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=parent,
        token_ids=tokens,
        block_size=BS,
        **(base | fields),
    )


def removed(hashes: list[bytes | int], **fields: Any) -> BlockRemoved:
    return BlockRemoved(block_hashes=hashes, medium=fields.pop("medium", "GPU"), **fields)


def encode(*events: KVCacheEvent) -> bytes:
    return msgspec.msgpack.encode(EventBatch(ts=time.time(), events=list(events)))


TOKENS = list(range(100, 116))  # four blocks
H1, H2, H3 = 11, 12, 13  # the engine's names of the first three
H4 = b"\x04" * 32  # vLLM names blocks by bytes too (sha256 hashing)


# -- decoding ---------------------------------------------------------------------


def test_decodes_stored_removed_and_cleared_in_order() -> None:
    payload = msgspec.msgpack.encode(
        EventBatch(
            ts=1.5,
            events=[
                stored([H1, H2, H3], TOKENS[:12]),
                stored([H4], TOKENS[12:], parent=H3, medium=None),
                removed([H2, H4]),
                AllBlocksCleared(),
            ],
            data_parallel_rank=0,
        )
    )
    assert decode_kv_events(payload) == [
        Stored(hashes=[H1, H2, H3], parent=None, token_ids=TOKENS[:12], block_size=BS),
        Stored(hashes=[H4], parent=H3, token_ids=TOKENS[12:], block_size=BS),
        Removed(hashes=[H2, H4]),
        Cleared(),
    ]


def test_tolerates_fields_and_event_types_it_does_not_know() -> None:
    newer = NewerBlockStored(
        block_hashes=[H1],
        parent_block_hash=None,
        token_ids=TOKENS[:4],
        block_size=BS,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    payload = msgspec.msgpack.encode(
        NewerEventBatch(
            ts=2.0,
            events=[newer, BlockTouched(block_hashes=[H1]), removed([H1], locality="LOCAL")],
            data_parallel_rank=3,
            trace_id="x",
        )
    )
    assert decode_kv_events(payload) == [
        Stored(hashes=[H1], parent=None, token_ids=TOKENS[:4], block_size=BS),
        Removed(hashes=[H1]),
    ]


def test_keeps_only_blocks_the_index_can_name() -> None:
    payload = encode(
        stored([1], TOKENS[:4], medium="CPU"),  # an offload tier
        stored([2], TOKENS[:4], group_idx=1),  # a hybrid model's other group
        stored([3], TOKENS[:4], lora_name="adapter", lora_id=7),  # an adapter's
        stored([4], TOKENS[:4], extra_keys=[("mm-hash", 0)]),  # an image's
        stored([5], TOKENS[:4], extra_keys=[None], group_idx=0),  # plain text
        stored([6], TOKENS[:4], medium=None),  # older engines name no tier
        removed([1], medium="CPU"),
        removed([2], group_idx=1),
        removed([5], group_idx=0),
    )
    assert decode_kv_events(payload) == [
        Stored(hashes=[5], parent=None, token_ids=TOKENS[:4], block_size=BS),
        Stored(hashes=[6], parent=None, token_ids=TOKENS[:4], block_size=BS),
        Removed(hashes=[5]),
    ]


@pytest.mark.parametrize("payload", [b"\xc1", b"\x92\xcb", msgspec.msgpack.encode({"ts": 1})])
def test_a_payload_that_is_no_batch_raises(payload: bytes) -> None:
    with pytest.raises(msgspec.DecodeError):
        decode_kv_events(payload)


def test_the_decoded_events_build_the_prefix_index() -> None:
    index = PrefixIndex(block_size=BS, capacity=100)
    prompt = chain(TOKENS, BS)
    index.apply(decode_kv_events(encode(stored([H1, H2, H3], TOKENS[:12]))))
    assert index.match(prompt) == 3
    index.apply(decode_kv_events(encode(stored([H4], TOKENS[12:], parent=H3))))
    assert index.match(prompt) == 4
    index.apply(decode_kv_events(encode(removed([H4]))))
    assert index.match(prompt) == 3
    index.apply(decode_kv_events(encode(removed([H2]))))
    assert index.match(prompt) == 1


def test_a_bind_address_is_refused() -> None:
    with pytest.raises(ValueError, match="bind address"):
        KVEventSubscriber("a", "tcp://*:5557", lambda name, events: None)
    with pytest.raises(ValueError, match="bind address"):
        KVEventSubscriber(
            "a", "tcp://h:5557", lambda name, events: None, replay_endpoint="tcp://*:5558"
        )


# -- over ZMQ ---------------------------------------------------------------------


class FakePublisher:
    """An engine's publisher, as vLLM's ``ZmqEventPublisher``: PUB plus a replay
    ROUTER over a buffer of the batches sent. ``publish(..., send=False)`` numbers
    and buffers a batch without sending it: a batch the subscriber missed."""

    def __init__(self, context: zmq.asyncio.Context, *, answer_replays: bool = True):
        self.pub = context.socket(zmq.PUB)
        self.router = context.socket(zmq.ROUTER)
        port = self.pub.bind_to_random_port("tcp://127.0.0.1")
        replay_port = self.router.bind_to_random_port("tcp://127.0.0.1")
        self.endpoint = f"tcp://127.0.0.1:{port}"
        self.replay_endpoint = f"tcp://127.0.0.1:{replay_port}"
        self.answer_replays = answer_replays
        self.buffer: list[tuple[int, bytes]] = []
        self.next_seq = 0
        self.replay_requests: list[int] = []
        self.replay_asked = anyio.Event()

    async def publish(self, *events: KVCacheEvent, send: bool = True) -> int:
        return await self.publish_payload(encode(*events), send=send)

    async def publish_payload(
        self, payload: bytes, *, send: bool = True, seq: int | None = None
    ) -> int:
        seq = self.next_seq if seq is None else seq
        self.next_seq = seq + 1
        self.buffer.append((seq, payload))
        if send:
            await self.pub.send_multipart((b"", seq.to_bytes(8, "big"), payload))
        return seq

    async def serve_replays(self) -> None:
        while True:
            client, _, start = await self.router.recv_multipart()
            self.replay_requests.append(int.from_bytes(start, "big"))
            self.replay_asked.set()
            if not self.answer_replays:
                continue
            for seq, payload in self.buffer:
                if seq >= int.from_bytes(start, "big"):
                    await self.router.send_multipart(
                        (client, b"", b"", seq.to_bytes(8, "big"), payload)
                    )
            await self.router.send_multipart(
                (client, b"", b"", (-1).to_bytes(8, "big", signed=True), b"")
            )

    def close(self) -> None:
        self.pub.close(linger=0)
        self.router.close(linger=0)


Received = MemoryObjectReceiveStream[tuple[str, list[KVEvent]]]


@pytest.fixture
async def context() -> AsyncIterator[zmq.asyncio.Context]:
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


@pytest.fixture
async def engine(context: zmq.asyncio.Context) -> AsyncIterator[FakePublisher]:
    publisher = FakePublisher(context)
    async with anyio.create_task_group() as tg:
        tg.start_soon(publisher.serve_replays)
        yield publisher
        tg.cancel_scope.cancel()
    publisher.close()


@asynccontextmanager
async def following(
    engine: FakePublisher, *, replay: bool = True, **options: Any
) -> AsyncIterator[tuple[KVEventSubscriber, Received]]:
    """A subscriber reading ``engine``, joined: the handshake's batches are read."""
    send, receive = anyio.create_memory_object_stream[tuple[str, list[KVEvent]]](1000)
    subscriber = KVEventSubscriber(
        "a",
        engine.endpoint,
        lambda name, events: send.send_nowait((name, events)),
        replay_endpoint=engine.replay_endpoint if replay else None,
        **options,
    )
    async with send, receive, anyio.create_task_group() as tg:
        tg.start_soon(subscriber.run)
        await joined(engine, receive)
        yield subscriber, receive
        tg.cancel_scope.cancel()


async def joined(engine: FakePublisher, receive: Received) -> list[KVEvent]:
    """PUB drops what it sends before the subscriber's connection is up: send empty
    batches until one is read (the subscriber's first batch begins with Cleared)."""
    with anyio.fail_after(5):
        while True:
            await engine.publish()
            with anyio.move_on_after(0.05):
                _, events = await receive.receive()
                return events


async def next_events(receive: Received) -> list[KVEvent]:
    with anyio.fail_after(5):
        name, events = await receive.receive()
    assert name == "a"
    return events


async def test_batches_reach_the_index_with_counters(engine: FakePublisher) -> None:
    index = PrefixIndex(block_size=BS, capacity=100)
    prompt = chain(TOKENS, BS)
    async with following(engine) as (subscriber, receive):
        before = subscriber.batches
        await engine.publish(
            stored([H1, H2, H3], TOKENS[:12]), stored([H4], TOKENS[12:], parent=H3)
        )
        index.apply(await next_events(receive))
        assert index.match(prompt) == 4
        await engine.publish(removed([H3]))
        index.apply(await next_events(receive))
        assert index.match(prompt) == 2
        assert subscriber.batches - before == 2
        assert subscriber.events == 3
        assert subscriber.last_seq == engine.next_seq - 1
        assert subscriber.last_at is not None and abs(subscriber.last_at - time.time()) < 5
        assert (subscriber.gaps, subscriber.lost, subscriber.restarts) == (0, 0, 0)


async def test_a_gap_is_filled_from_the_replay_endpoint(
    engine: FakePublisher, caplog: pytest.LogCaptureFixture
) -> None:
    index = PrefixIndex(block_size=BS, capacity=100)
    prompt = chain(TOKENS, BS)
    async with following(engine) as (subscriber, receive):
        await engine.publish(stored([H1, H2, H3], TOKENS[:12]))
        index.apply(await next_events(receive))
        engine.replay_requests.clear()
        missed = await engine.publish(removed([H2]), send=False)
        await engine.publish(stored([H4], TOKENS[12:], parent=H3))
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            events = await next_events(receive)
        assert events == [
            Removed(hashes=[H2]),
            Stored(hashes=[H4], parent=H3, token_ids=TOKENS[12:], block_size=BS),
        ]
        assert engine.replay_requests == [missed]
        index.apply(events)
        assert index.match(prompt) == 1  # the replayed removal counted
        assert prompt[3] in index  # and the live batch after it
        assert (subscriber.gaps, subscriber.lost) == (1, 0)
        assert not caplog.records


async def test_a_gap_without_replay_clears_the_index(
    engine: FakePublisher, caplog: pytest.LogCaptureFixture
) -> None:
    index = PrefixIndex(block_size=BS, capacity=100)
    async with following(engine, replay=False) as (subscriber, receive):
        await engine.publish(stored([H1, H2, H3], TOKENS[:12]))
        index.apply(await next_events(receive))
        assert index.match(chain(TOKENS, BS)) == 3
        await engine.publish(removed([H2]), send=False)
        await engine.publish(stored([21, 22], TOKENS[8:16]))
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            events = await next_events(receive)
        assert events == [
            Cleared(),
            Stored(hashes=[21, 22], parent=None, token_ids=TOKENS[8:16], block_size=BS),
        ]
        index.apply(events)
        assert index.match(chain(TOKENS, BS)) == 0  # no longer trusted
        assert index.match(chain(TOKENS[8:16], BS)) == 2
        assert (subscriber.gaps, subscriber.lost) == (1, 1)
        assert not engine.replay_requests
        assert [r.levelno for r in caplog.records] == [logging.WARNING]
        assert "engine a" in caplog.records[0].getMessage()


async def test_a_gap_the_replay_buffer_no_longer_holds_clears_the_index(
    engine: FakePublisher, caplog: pytest.LogCaptureFixture
) -> None:
    async with following(engine) as (subscriber, receive):
        await engine.publish(stored([H1], TOKENS[:4]), send=False)
        await engine.publish(removed([H1]), send=False)
        del engine.buffer[-2]  # the buffer kept only the last of the two missed
        await engine.publish(stored([H2], TOKENS[4:8]))
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            events = await next_events(receive)
        assert events == [
            Cleared(),
            Removed(hashes=[H1]),
            Stored(hashes=[H2], parent=None, token_ids=TOKENS[4:8], block_size=BS),
        ]
        assert (subscriber.gaps, subscriber.lost) == (1, 1)
        assert len(caplog.records) == 1
        assert "not replayable" in caplog.records[0].getMessage()


async def test_a_silent_replay_endpoint_times_out_and_clears(
    context: zmq.asyncio.Context,
) -> None:
    engine = FakePublisher(context, answer_replays=False)
    async with anyio.create_task_group() as tg:
        tg.start_soon(engine.serve_replays)
        async with following(engine, catch_up=False, replay_timeout_s=0.1) as (sub, receive):
            await engine.publish(removed([H1]), send=False)
            await engine.publish(stored([H2], TOKENS[4:8]))
            events = await next_events(receive)
            assert events[0] == Cleared()
            assert engine.replay_requests and sub.lost == 1
        tg.cancel_scope.cancel()
    engine.close()


async def test_an_engine_restart_starts_the_index_over(engine: FakePublisher) -> None:
    async with following(engine, replay=False) as (subscriber, receive):
        await engine.publish(stored([H1], TOKENS[:4]))
        await next_events(receive)
        engine.next_seq = 0  # a new engine process counts from 0 again
        await engine.publish(stored([H2], TOKENS[4:8]))
        events = await next_events(receive)
        assert events == [
            Cleared(),
            Stored(hashes=[H2], parent=None, token_ids=TOKENS[4:8], block_size=BS),
        ]
        assert (subscriber.restarts, subscriber.gaps) == (1, 0)


async def test_a_subscriber_started_after_its_engine_catches_up(engine: FakePublisher) -> None:
    await engine.publish(stored([H1, H2], TOKENS[:8]), send=False)
    await engine.publish(stored([H3], TOKENS[8:12], parent=H2), send=False)
    index = PrefixIndex(block_size=BS, capacity=100)
    send, receive = anyio.create_memory_object_stream[tuple[str, list[KVEvent]]](100)
    subscriber = KVEventSubscriber(
        "a",
        engine.endpoint,
        lambda name, events: send.send_nowait((name, events)),
        replay_endpoint=engine.replay_endpoint,
    )
    async with send, receive, anyio.create_task_group() as tg:
        tg.start_soon(subscriber.run)
        events = await joined(engine, receive)
        tg.cancel_scope.cancel()
    assert events[0] == Cleared()  # what the index held was not learnt from this stream
    index.apply(events)
    assert engine.replay_requests == [0]
    assert index.match(chain(TOKENS, BS)) == 3
    assert subscriber.gaps == 0


async def test_an_undecodable_batch_clears_the_index(
    engine: FakePublisher, caplog: pytest.LogCaptureFixture
) -> None:
    async with following(engine) as (subscriber, receive):
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            await engine.publish_payload(b"\xc1")
            await engine.publish(stored([H1], TOKENS[:4]))
            assert await next_events(receive) == [Cleared()]
            assert await next_events(receive) == [
                Stored(hashes=[H1], parent=None, token_ids=TOKENS[:4], block_size=BS)
            ]
        assert (subscriber.lost, subscriber.gaps) == (1, 0)
        assert "undecodable" in caplog.records[0].getMessage()


async def test_cancelling_closes_its_sockets_even_mid_replay() -> None:
    """A context terminates only once every socket made from it is closed."""
    engine_context = zmq.asyncio.Context()
    engine = FakePublisher(engine_context, answer_replays=False)
    context = zmq.asyncio.Context()
    subscriber = KVEventSubscriber(
        "a",
        engine.endpoint,
        lambda name, events: None,
        replay_endpoint=engine.replay_endpoint,
        replay_timeout_s=60,
        context=context,
    )
    await engine.publish(send=False)  # so the first batch read is not the engine's first
    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(engine.serve_replays)
            tg.start_soon(subscriber.run)
            with anyio.fail_after(5):
                while not engine.replay_asked.is_set():  # first batch read: catching up
                    await engine.publish()
                    with anyio.move_on_after(0.05):
                        await engine.replay_asked.wait()
            tg.cancel_scope.cancel()
        with anyio.fail_after(5):
            await anyio.to_thread.run_sync(context.term, abandon_on_cancel=True)
    finally:
        engine.close()
        engine_context.destroy(linger=0)
