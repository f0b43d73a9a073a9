"""``whoseturn sim --kv-events-config`` publishes vLLM's KV-cache events over ZMQ, as a
router that consumes them (vllm-router's ``kv_aware`` policy, our proxy) reads them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import msgspec
import pytest
import zmq
from zmq.utils.monitor import recv_monitor_message

from loadtests.engine_io.metrics import labelled_samples
from loadtests.sim.kv_cache import block_hashes
from loadtests.sim.kv_events import external_block_hash
from tests.support import MODEL
from tests.support.children import logged_sim
from tests.support.processes import LOOPBACK, free_port

pytestmark = pytest.mark.integration

SHARED = (
    "You answer questions about the schedule of a shared inference cluster. Each engine "
    "serves chat users first and batch jobs with whatever capacity is left, and a router "
    "in front of the engines decides which engine gets each request by looking at which "
    "prefixes every engine still holds in its cache, so that a long system prompt like "
    "this one is computed once per engine rather than once per request."
)
QUESTIONS = (
    "Whose turn is it now on the second engine, and how long will the batch job in front "
    "of the queue keep waiting before it gets a share of the prefill budget again?",
    "Which engine should a new conversation go to if the first one is busy with a long "
    "document and the third one has just finished a batch of short summaries?",
)
END = (-1).to_bytes(8, "big", signed=True)


def messages(question: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SHARED}, {"role": "user", "content": question}]


@contextmanager
def subscribed() -> Iterator[tuple[zmq.Context[Any], zmq.Socket[bytes]]]:
    """A context and, in it, a SUB socket to every topic; all closed on exit."""
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        sub = ctx.socket(zmq.SUB)
        sub.subscribe(b"")
        yield ctx, sub
    finally:
        ctx.destroy(linger=0)


def await_handshake(monitor: zmq.Socket[bytes], timeout_s: float) -> None:
    assert monitor.poll(int(timeout_s * 1000)), "the subscriber never reached the publisher"
    event = recv_monitor_message(monitor)
    assert event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED


def receive(sock: zmq.Socket[bytes], timeout_s: float = 5.0) -> list[bytes]:
    assert sock.poll(int(timeout_s * 1000)), "no message within the timeout"
    return sock.recv_multipart()


def cache_config(http: httpx.Client) -> dict[str, str]:
    """The labels of ``vllm:cache_config_info``, where a router learns the block size."""
    samples = labelled_samples(http.get("/metrics").text)
    infos = [dict(labels) for name, labels in samples if name == "vllm:cache_config_info"]
    assert len(infos) == 1
    return infos[0]


def test_the_engine_publishes_each_prefill_and_replays_it(tmp_path: Path) -> None:
    """Two chats share a long system prompt: the first one's prefill announces all its
    full blocks (batch 0); the second hits those and announces only its own blocks,
    chained to the last shared one (batch 1). The replay endpoint returns both."""
    pub_port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://*:{pub_port}",  # a wildcard: bound, as vLLM does
        "replay_endpoint": f"tcp://{LOOPBACK}:{replay_port}",
        "topic": "kv",
    }
    with subscribed() as (ctx, sub):
        monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(f"tcp://{LOOPBACK}:{pub_port}")  # ZMQ retries until the sim binds
        flags = ("--time-scale", "20", "--kv-events-config", json.dumps(config))
        with logged_sim(tmp_path, *flags) as (_, url), httpx.Client(base_url=url) as http:
            # the subscription is sent on the handshake, long before the first step
            await_handshake(monitor, timeout_s=10)
            info = cache_config(http)
            assert int(info["num_gpu_blocks"]) > 0
            block_size = int(info["block_size"])
            prompts = []
            began = time.time()
            for question in QUESTIONS:
                body: dict[str, Any] = {"model": MODEL, "messages": messages(question)}
                prompts.append(http.post("/tokenize", json=body).json()["tokens"])
                reply = http.post("/v1/chat/completions", json={**body, "max_tokens": 1})
                assert reply.status_code == 200
            frames = [receive(sub), receive(sub)]
            ended = time.time()
            replayed = replay(ctx, f"tcp://{LOOPBACK}:{replay_port}")

    assert [topic for topic, _, _ in frames] == [b"kv", b"kv"]
    assert [int.from_bytes(seq, "big") for _, seq, _ in frames] == [0, 1]
    assert replayed == frames
    batches = [msgspec.msgpack.decode(payload) for _, _, payload in frames]
    for ts, _, rank in batches:
        assert began <= ts <= ended
        assert rank == 0
    first, second = (events for _, events, _ in batches)
    assert [e["type"] for e in first] == [e["type"] for e in second] == ["BlockStored"]
    a, b = prompts
    chain_a, chain_b = (
        [external_block_hash(h) for h in block_hashes(p, block_size, [])] for p in prompts
    )
    shared = next(i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y) // block_size
    assert 0 < shared < len(chain_b)
    stored_a, stored_b = first[0], second[0]
    assert stored_a["block_size"] == stored_b["block_size"] == block_size
    assert stored_a["block_hashes"] == chain_a
    assert stored_a["parent_block_hash"] is None
    assert stored_a["token_ids"] == a[: len(chain_a) * block_size]
    assert stored_b["block_hashes"] == chain_b[shared:]
    assert stored_b["parent_block_hash"] == chain_a[shared - 1] == chain_b[shared - 1]
    assert stored_b["token_ids"] == b[shared * block_size : len(chain_b) * block_size]


def replay(ctx: zmq.Context[Any], endpoint: str) -> list[list[bytes]]:
    """Every buffered message from seq 0, as (topic, seq, payload), up to the end marker."""
    frames = []
    with ctx.socket(zmq.DEALER) as dealer:
        dealer.connect(endpoint)
        dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        while (reply := receive(dealer)) != [b"", b"", END, b""]:
            assert reply[0] == b""
            frames.append(reply[1:])
    return frames
