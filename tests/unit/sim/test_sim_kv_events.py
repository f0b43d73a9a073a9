"""vLLM's KV-cache events from the simulated engine: wire format, faithfulness to the
engine's own prefix cache, the ZMQ publisher and the ``--kv-events-config`` flag."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import msgspec
import pytest
import zmq

from loadtests import cli as bench
from loadtests.sim.kv_cache import block_hashes
from loadtests.sim.kv_events import (
    AllBlocksCleared,
    AnyKVCacheEvent,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
    KVEventsConfig,
    ZmqEventPublisher,
    block_removed,
    block_stored,
    create_publisher,
    external_block_hash,
)
from loadtests.sim.request import SimRequest
from loadtests.sim.step_loop import SimEngine
from loadtests.sim.step_scheduler import EngineScheduler, SchedulerConfig
from proxy.clock import VirtualClock
from tests.support.vllm_kv_wire import WIRE
from tests.support.vllm_kv_wire import AllBlocksCleared as WireAllBlocksCleared
from tests.support.vllm_kv_wire import BlockRemoved as WireBlockRemoved
from tests.support.vllm_kv_wire import BlockStored as WireBlockStored

from .helpers import UNIT_COST, make_request, sample_position, step, unique_prompt

# vLLM 0.32's wire structs are tests/support/vllm_kv_wire.py's, written out
# independently of the simulator's
U64 = 1 << 64


def sample_batch() -> KVEventBatch:
    events: list[AnyKVCacheEvent] = [
        block_stored([-5, 7], None, [1, 2, 3, 4], 2),
        block_stored([9], 7, [5, 6], 2),
        block_removed(-5),
        AllBlocksCleared(),
    ]
    return KVEventBatch(ts=1712345678.25, events=events, data_parallel_rank=0)


# -- wire format ----------------------------------------------------------------------


def test_a_batch_decodes_with_vllms_structs() -> None:
    batch = WIRE.decode(msgspec.msgpack.encode(sample_batch()))
    assert batch.ts == 1712345678.25
    assert batch.data_parallel_rank == 0
    first, second, removed, cleared = batch.events
    assert isinstance(first, WireBlockStored)
    assert first.block_hashes == [U64 - 5, 7]  # unsigned 64-bit, as vLLM's int hashes
    assert first.parent_block_hash is None
    assert first.token_ids == [1, 2, 3, 4]
    assert first.block_size == 2
    assert (first.lora_id, first.lora_name, first.medium) == (None, None, "GPU")
    assert first.extra_keys == [None, None]
    assert (first.group_idx, first.kv_cache_spec_kind) == (0, "full_attention")
    assert isinstance(second, WireBlockStored)
    assert (second.block_hashes, second.parent_block_hash, second.token_ids) == ([9], 7, [5, 6])
    assert isinstance(removed, WireBlockRemoved)
    assert (removed.block_hashes, removed.medium, removed.group_idx) == ([U64 - 5], "GPU", 0)
    assert isinstance(cleared, WireAllBlocksCleared)


def test_the_wire_shape_is_an_array_of_tagged_maps_without_defaulted_fields() -> None:
    """Exactly the keys vLLM 0.32 sends for such events: required ones even when
    None, defaulted ones only when set."""
    ts, events, rank = msgspec.msgpack.decode(msgspec.msgpack.encode(sample_batch()))
    assert (ts, rank) == (1712345678.25, 0)
    assert [e["type"] for e in events] == [
        "BlockStored",
        "BlockStored",
        "BlockRemoved",
        "AllBlocksCleared",
    ]
    assert set(events[0]) == {
        "type",
        "block_hashes",
        "parent_block_hash",
        "token_ids",
        "block_size",
        "lora_id",
        "medium",
        "lora_name",
        "extra_keys",
        "group_idx",
        "kv_cache_spec_kind",
    }
    assert set(events[2]) == {"type", "block_hashes", "medium", "group_idx"}
    assert events[3] == {"type": "AllBlocksCleared"}


def test_external_hashes_map_the_signed_range_one_to_one() -> None:
    assert external_block_hash(0) == 0
    assert external_block_hash(2**63 - 1) == 2**63 - 1
    assert external_block_hash(-1) == U64 - 1
    assert external_block_hash(-(2**63)) == 2**63


# -- events against the engine's own cache --------------------------------------------


def internal(h: int) -> int:
    """Back from the published hash to the simulator's signed one."""
    return h - U64 if h >= 2**63 else h


class Replayer:
    """A consumer's view of one engine's cache, built from its events alone; checks
    each event against that view as it goes."""

    def __init__(self) -> None:
        self.cached: set[int] = set()
        self.stored: list[BlockStored] = []
        self.removed: list[int] = []

    def apply(self, event: AnyKVCacheEvent) -> None:
        if isinstance(event, BlockStored):
            if event.parent_block_hash is not None:
                assert event.parent_block_hash in self.cached, "stored after an unknown parent"
            for h in event.block_hashes:
                assert h not in self.cached, "stored twice"
                self.cached.add(h)
            self.stored.append(event)
        elif isinstance(event, BlockRemoved):
            for h in event.block_hashes:
                assert h in self.cached, "removed a block not cached"
                self.cached.remove(h)
                self.removed.append(h)
        else:
            self.cached.clear()


def published(kv_hashes: set[int]) -> set[int]:
    return {external_block_hash(h) for h in kv_hashes}


def shared_prefix_requests(n: int, block_size: int) -> list[SimRequest]:
    """``n`` requests: six blocks of one shared prefix, then 2-3 blocks of their own
    (one with a ragged end)."""
    prefix = unique_prompt(6 * block_size)
    return [
        make_request(f"r{i}", 0, 6, prompt=prefix + unique_prompt((2 + i % 2) * block_size + i % 3))
        for i in range(n)
    ]


def check_chains(stored: list[BlockStored], requests: list[SimRequest], block_size: int) -> None:
    """Every stored run is a slice of some request's own block hashes (the engine's
    ``block_hashes`` over its final tokens): its tokens are those blocks' tokens and
    its parent is the block before (None only at the start)."""
    where: dict[int, tuple[list[int], list[int], int]] = {}
    for request in requests:
        tokens = request.token_ids()
        chain = [external_block_hash(h) for h in block_hashes(tokens, block_size, [])]
        for k, h in enumerate(chain):
            where.setdefault(h, (tokens, chain, k))
    for event in stored:
        tokens, chain, k = where[event.block_hashes[0]]
        n = len(event.block_hashes)
        assert event.block_size == block_size
        assert chain[k : k + n] == event.block_hashes
        assert event.token_ids == tokens[k * block_size : (k + n) * block_size]
        assert event.parent_block_hash == (chain[k - 1] if k > 0 else None)


def test_events_replayed_reproduce_the_cache_step_by_step_under_eviction() -> None:
    """Requests sharing a prefix through a cache too small for them all: hits,
    evictions and preemptions; after every step a consumer that saw only the events
    holds exactly the hashes the engine's cache can hit."""
    config = SchedulerConfig(
        max_num_batched_tokens=32, max_num_seqs=3, max_model_len=64, block_size=4,
        num_gpu_blocks=24,
    )  # fmt: skip
    sched = EngineScheduler(config, sample_position, kv_cache_events=True)
    requests = shared_prefix_requests(12, config.block_size)
    consumer = Replayer()
    pending = list(requests)
    for _ in range(2_000):
        while pending and len(sched.requests) < 4:
            sched.add_request(pending.pop(0))
        if not sched.has_unfinished_requests:
            break
        step(sched)
        for event in sched.kv.take_events():
            consumer.apply(event)
        assert consumer.cached == published(sched.kv.cached_hashes)
    assert not sched.has_unfinished_requests
    assert consumer.cached == published(sched.kv.cached_hashes)
    assert consumer.removed, "the cache never had to evict: the test proves nothing"
    assert any(r.num_cached_tokens > 0 for r in requests), "no prefix-cache hit"
    assert any(e.parent_block_hash is not None for e in consumer.stored)
    check_chains(consumer.stored, requests, config.block_size)
    # a hit announces nothing: the shared prefix went out less often than it was used
    prefix_head = consumer.stored[0].block_hashes[0]
    announced = [h for e in consumer.stored for h in e.block_hashes]
    assert announced.count(prefix_head) < len(requests)


def test_removed_events_name_the_evicted_blocks() -> None:
    """One request's blocks are freed into the cache, a second takes every block:
    each cached hash of the first is removed, by one event per block, last block
    first (the order they are evicted in)."""
    config = SchedulerConfig(max_num_batched_tokens=64, max_model_len=32, block_size=4,
                             num_gpu_blocks=8)  # fmt: skip
    sched = EngineScheduler(config, sample_position, kv_cache_events=True)
    sched.add_request(make_request("a", 20, 1))
    step(sched)
    first = sched.kv.take_events()
    assert [type(e) for e in first] == [BlockStored]
    assert isinstance(first[0], BlockStored)
    assert len(first[0].block_hashes) == 5
    sched.add_request(make_request("b", 31, 1))
    step(sched)
    events = sched.kv.take_events()
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert [e.block_hashes for e in removed] == [[h] for h in reversed(first[0].block_hashes)]
    assert not published(sched.kv.cached_hashes) & set(first[0].block_hashes)


def test_no_events_are_recorded_unless_asked() -> None:
    config = SchedulerConfig(max_model_len=32, block_size=4, num_gpu_blocks=8)
    sched = EngineScheduler(config, sample_position)
    sched.add_request(make_request("a", 20, 1))
    step(sched)
    assert sched.kv.cached_hashes
    assert sched.kv.take_events() == []


def test_reset_clears_all_once_nothing_is_held() -> None:
    config = SchedulerConfig(max_model_len=32, block_size=4, num_gpu_blocks=8)
    sched = EngineScheduler(config, sample_position, kv_cache_events=True)
    sched.add_request(make_request("a", 20, 3))
    step(sched)
    assert not sched.kv.reset_prefix_cache()  # "a" still holds its blocks
    while sched.has_unfinished_requests:
        step(sched)
    consumer = Replayer()
    for event in sched.kv.take_events():
        consumer.apply(event)
    assert consumer.cached
    assert sched.kv.reset_prefix_cache()
    assert sched.kv.take_events() == [AllBlocksCleared()]
    assert sched.kv.cached_hashes == set()


class RecordingPublisher:
    def __init__(self) -> None:
        self.batches: list[KVEventBatch] = []

    def publish(self, batch: KVEventBatch) -> None:
        self.batches.append(batch)

    def shutdown(self) -> None:
        pass


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_publishes_one_batch_per_step_in_wall_time(async_scheduling: bool) -> None:
    config = SchedulerConfig(
        max_num_batched_tokens=32, max_num_seqs=3, max_model_len=64, block_size=4,
        num_gpu_blocks=24, async_scheduling=async_scheduling,
    )  # fmt: skip
    publisher = RecordingPublisher()
    clock = VirtualClock()
    engine = SimEngine(config, UNIT_COST, clock, kv_events=publisher)
    requests = shared_prefix_requests(8, config.block_size)
    for request in requests:
        engine.add_request(request.prompt_token_ids, request.max_tokens)
    began = time.time()
    steps = 0
    while (plan := engine.begin_step()) is not None:
        clock.advance(plan.duration)
        before = len(publisher.batches)
        engine.finish_step(plan)
        assert len(publisher.batches) - before <= 1
        steps += 1
    consumer = Replayer()
    for batch in publisher.batches:
        assert batch.events and batch.data_parallel_rank is None
        assert began <= batch.ts <= time.time()
        for event in batch.events:
            consumer.apply(event)
    assert 1 < len(publisher.batches) <= steps
    assert consumer.removed
    assert consumer.cached == published(engine.scheduler.kv.cached_hashes)


# -- the publisher ----------------------------------------------------------------------


@contextmanager
def zmq_context() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        yield ctx
    finally:
        ctx.destroy(linger=0)


@contextmanager
def publisher(**config: Any) -> Iterator[ZmqEventPublisher]:
    """A publisher bound to free loopback ports (its ``endpoint`` and
    ``replay_endpoint`` say which)."""
    made = ZmqEventPublisher(
        KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint="tcp://127.0.0.1:*",
            **config,
        )
    )
    try:
        yield made
    finally:
        made.shutdown()


def receive(sock: zmq.Socket[bytes], timeout_s: float = 5.0) -> list[bytes]:
    assert sock.poll(int(timeout_s * 1000)), "nothing arrived"
    return sock.recv_multipart()


def replay(ctx: zmq.Context[zmq.Socket[bytes]], endpoint: str, start: int) -> list[list[bytes]]:
    """Everything the replay endpoint sends for ``start``, up to its end marker."""
    frames = []
    with ctx.socket(zmq.DEALER) as dealer:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        while (reply := receive(dealer))[1:] != [b"", (-1).to_bytes(8, "big", signed=True), b""]:
            assert reply[0] == b""
            frames.append(reply[1:])
    return frames


def batch_at(ts: float) -> KVEventBatch:
    return KVEventBatch(ts=ts, events=[block_stored([int(ts)], None, [1, 2], 2)])


def test_batches_go_out_numbered_and_replay_from_any_point() -> None:
    """PUB frames (topic, seq, payload) with seq counting up by one; a subscriber
    that joins late learns from the replay what it missed, from seq 0."""
    with zmq_context() as ctx, publisher(topic="kv") as pub:
        sub = ctx.socket(zmq.SUB)
        sub.subscribe(b"")
        sub.connect(pub.endpoint)
        # a subscription takes effect some time after connecting: publish until one
        # arrives (the ones before it are what a late subscriber misses)
        sent, deadline = 0, time.monotonic() + 5
        while not sub.poll(20):
            assert time.monotonic() < deadline, "the subscription never took effect"
            pub.publish(batch_at(sent))
            sent += 1
        topic, seq_bytes, payload = sub.recv_multipart()
        first = int.from_bytes(seq_bytes, "big")
        assert topic == b"kv"
        assert WIRE.decode(payload).ts == first
        for ts in range(sent, sent + 3):
            pub.publish(batch_at(ts))
        received = [(first, payload)]
        while len(received) < sent + 3 - first:
            topic, seq_bytes, payload = receive(sub)
            received.append((int.from_bytes(seq_bytes, "big"), payload))
        assert [seq for seq, _ in received] == list(range(first, sent + 3))
        assert pub.replay_endpoint is not None
        everything = replay(ctx, pub.replay_endpoint, 0)
        assert [int.from_bytes(f[1], "big") for f in everything] == list(range(sent + 3))
        assert {f[0] for f in everything} == {b"kv"}
        assert [WIRE.decode(f[2]).ts for f in everything] == list(range(sent + 3))
        assert [WIRE.decode(f[2]).data_parallel_rank for f in everything] == [0] * (sent + 3)
        tail = replay(ctx, pub.replay_endpoint, first)
        assert [(int.from_bytes(s, "big"), p) for _, s, p in tail] == received


def test_the_replay_buffer_keeps_the_last_steps() -> None:
    with zmq_context() as ctx, publisher(buffer_steps=2) as pub:
        for ts in range(5):
            pub.publish(batch_at(ts))
        endpoint = pub.replay_endpoint
        assert endpoint is not None
        # the batches reach the buffer in order: once the last is there, all were
        deadline = time.monotonic() + 5
        while (seqs := [int.from_bytes(f[1], "big") for f in replay(ctx, endpoint, 0)]) != [3, 4]:
            assert time.monotonic() < deadline, f"replay still {seqs}"
            assert not seqs or seqs[-1] < 4


def test_an_endpoint_in_use_fails_at_once() -> None:
    with publisher() as pub:
        taken = KVEventsConfig(
            enable_kv_cache_events=True,
            endpoint="tcp://127.0.0.1:*",
            replay_endpoint=pub.replay_endpoint,  # the replay endpoint is always bound
        )
        with pytest.raises(zmq.ZMQError, match="in use"):
            ZmqEventPublisher(taken)


# -- settings and the flag -------------------------------------------------------------


def test_config_takes_vllms_keys_and_defaults() -> None:
    given = {"enable_kv_cache_events": True, "endpoint": "tcp://*:6000"}
    text = json.dumps({**given, "replay_endpoint": "tcp://*:6001", "buffer_steps": 5, "topic": "t"})
    config = KVEventsConfig.from_json(text)
    assert config.publishes
    assert (config.endpoint, config.replay_endpoint) == ("tcp://*:6000", "tcp://*:6001")
    assert (config.buffer_steps, config.topic) == (5, "t")
    default = KVEventsConfig.from_json("{}")
    assert not default.publishes
    assert (default.endpoint, default.replay_endpoint) == ("tcp://*:5557", None)
    assert create_publisher(default) is None
    null = KVEventsConfig.from_json('{"enable_kv_cache_events": true, "publisher": "null"}')
    assert not null.publishes and create_publisher(null) is None


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        "{not json",
        '{"enable_kv_cache_events": true, "endpont": "tcp://*:1"}',
        '{"enable_kv_cache_events": "yes"}',
        '{"buffer_steps": "10"}',
        '{"buffer_steps": true}',
        '{"publisher": "kafka"}',
        '{"max_queue_size": 0}',
    ],
)
def test_config_refuses_what_vllm_would_not_take(text: str) -> None:
    with pytest.raises(ValueError, match="kv-events-config"):
        KVEventsConfig.from_json(text)


def test_the_sim_flag_reaches_the_settings_and_is_off_by_default() -> None:
    flag = '{"enable_kv_cache_events": true, "endpoint": "tcp://*:7000"}'
    settings = bench.sim_settings(bench.parse("sim", ["--kv-events-config", flag]))
    assert settings.kv_events == KVEventsConfig(enable_kv_cache_events=True,
                                                endpoint="tcp://*:7000")  # fmt: skip
    assert bench.sim_settings(bench.parse("sim", [])).kv_events is None


def test_the_flag_is_refused_before_a_virtual_time_subcommand(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        bench.parse("sim", ["--kv-events-config", "{}", "interference"])
    assert "--kv-events-config: not used by sim interference" in capsys.readouterr().err


def test_a_bad_flag_value_exits_2_with_the_reason(capsys: pytest.CaptureFixture[str]) -> None:
    assert bench.main("sim", ["--kv-events-config", '{"bogus": 1}']) == 2
    assert "unknown key 'bogus'" in capsys.readouterr().err
