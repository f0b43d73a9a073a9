"""The probe's I/O against a fake engine behind httpx.MockTransport."""

from __future__ import annotations

import random
import time
from collections.abc import Callable

import httpx
import pytest

from loadtests.engine_io import PromptMaker
from loadtests.probe.runner import (
    ProbeConfig,
    ProbeError,
    default_sizes,
    discover,
    measure,
    run_probe,
)

from .fake_engine import MODEL, FakeEngine

pytestmark = pytest.mark.anyio
URL = "http://engine.test:8000"
SIZES = (200, 400, 800, 1600, 3200)


@pytest.mark.parametrize(
    ("max_model_len", "sizes"),
    [
        (8192, (128, 256, 512, 1024, 2048, 4096, 8128)),
        (4096, (128, 256, 512, 1024, 2048, 4032)),
        (2048, (128, 256, 512, 1024, 1984)),
        (1024, (64, 128, 256, 512, 960)),
        (512, (32, 64, 128, 256, 448)),
    ],
)
def test_default_sizes_double_up_to_the_context(max_model_len: int, sizes: tuple[int, ...]) -> None:
    assert default_sizes(max_model_len) == sizes


@pytest.mark.parametrize(
    "options", [{"repeats": 0}, {"settle_tokens": 2}, {"tail_tokens": 0}, {"sizes": (0, 5)}]
)
def test_config_refuses_nonsense(options: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        ProbeConfig(engine_url=URL, **options)  # type: ignore[arg-type]


async def test_discover_reads_the_model_and_its_context() -> None:
    async with client(FakeEngine(max_model_len=2048)) as http:
        engine = await discover(http, ProbeConfig(engine_url=URL))
    assert (engine.model, engine.max_model_len) == (MODEL, 2048)


async def test_discover_refuses_a_model_the_engine_does_not_serve() -> None:
    async with client(FakeEngine()) as http:
        with pytest.raises(ProbeError, match="'other' not at all"):
            await discover(http, ProbeConfig(engine_url=URL, model="other"))


async def test_discover_needs_max_model_len() -> None:
    def handler(request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, json={"data": [{"id": "m"}]})

    async with httpx.AsyncClient(base_url=URL, transport=httpx.MockTransport(handler)) as http:
        with pytest.raises(ProbeError, match="max_model_len"):
            await discover(http, ProbeConfig(engine_url=URL))


async def test_prompts_have_exactly_the_size_asked_and_differ_from_the_first_token() -> None:
    async with client(FakeEngine()) as http:
        maker = PromptMaker(http, MODEL, random.Random(1))
        prompts = [await maker.make(n) for n in (1, 7, 300, 5000, 300)]
    assert [len(p) for p in prompts] == [1, 7, 300, 5000, 300]
    assert len({p[0] for p in prompts}) == len(prompts)


async def test_measure_times_the_stall_beside_a_serializing_prefill() -> None:
    fake = FakeEngine(gap_s=0.002, per_token_s=0.0001)
    async with client(fake) as http:
        config = ProbeConfig(engine_url=URL)
        engine = await discover(http, config)
        injection = await measure(http, engine, list(range(500)), config, _clock())
    assert injection.prompt_tokens == 500
    # The 50 ms prefill held the stream: the stall covers it (plus at most a gap or
    # two of scheduling), and the prompt took about as long.
    assert 0.050 <= injection.stall_s < 0.050 + 0.030
    assert 0.050 <= injection.prompt_latency_s < 0.050 + 0.030
    assert 0.002 <= injection.baseline_gap_s < 0.010
    assert injection.prefill_steps == 1
    assert fake.streams_closed == 1
    stream, prompt = (r for r in fake.requests if r["path"] == "/v1/completions")
    assert stream["stream"] is True and stream["ignore_eos"] is True
    assert stream["max_tokens"] == 4096 - 64
    assert prompt["max_tokens"] == 1 and prompt["prompt"] == list(range(500))


async def test_run_probe_measures_every_size_after_a_warm_up() -> None:
    # Gaps of 10 ms and prefills of 40 ms and more: a scheduling hiccup of a few ms on
    # a busy machine stays under the step threshold (twice the quiet median gap), so
    # each serializing prefill reads as the one step it was.
    fake = FakeEngine(gap_s=0.010, per_token_s=0.0002)
    config = ProbeConfig(engine_url=URL, sizes=SIZES, repeats=2, settle_tokens=4, extra_repeats=0)
    result = await run_probe(config, transport=fake.transport())
    assert [i.prompt_tokens for i in result.injections] == [*SIZES, *reversed(SIZES)]
    prompts = [r["prompt"] for r in fake.requests if r["path"] == "/v1/completions"]
    injected = [p for p in prompts if isinstance(p, list)]
    # The warm-up (the smallest and the largest size) is not recorded.
    assert [len(p) for p in injected[:2]] == [min(SIZES), max(SIZES)]
    assert len(injected) == 2 + 2 * len(SIZES)
    # no prompt shares a first cache block (16 tokens) with another, so none hits
    # another's cached prefix; their first tokens alone may collide (a random tag through
    # the fake tokenizer's vocabulary: one CI run in a few hundred)
    assert len({tuple(p[:16]) for p in injected}) == len(injected)
    assert fake.streams_closed == len(injected)
    assert result.engine.model == MODEL
    assert [row.prompt_tokens for row in result.analysis.table] == list(SIZES)
    assert all(i.prefill_steps == 1 for i in result.injections[2:])


async def test_a_size_whose_repeats_disagree_is_measured_again() -> None:
    # The first recorded prompt (after two warm-ups) is five times slow: its size's
    # two repeats disagree, and a third settles it.
    fake = FakeEngine(gap_s=0.002, per_token_s=0.00005, slow_calls=frozenset({2}))
    config = ProbeConfig(engine_url=URL, sizes=SIZES, repeats=2, settle_tokens=4)
    result = await run_probe(config, transport=fake.transport())
    counts = {row.prompt_tokens: len(row.stalls_s) for row in result.analysis.table}
    assert counts == {SIZES[0]: 3, **{size: 2 for size in SIZES[1:]}}


async def test_sizes_beyond_the_context_are_refused() -> None:
    config = ProbeConfig(engine_url=URL, sizes=(100, 200, 400, 800, 5000))
    with pytest.raises(ProbeError, match=r"\[5000\] do not fit"):
        await run_probe(config, transport=FakeEngine().transport())


async def test_too_few_sizes_are_refused() -> None:
    config = ProbeConfig(engine_url=URL, sizes=(100, 200, 400, 400))
    with pytest.raises(ProbeError, match="at least 5 distinct"):
        await run_probe(config, transport=FakeEngine().transport())


async def test_a_stream_that_ends_early_is_an_error() -> None:
    config = ProbeConfig(engine_url=URL, sizes=SIZES)
    with pytest.raises(ProbeError, match="ended after 5 tokens"):
        await run_probe(config, transport=FakeEngine(stream_tokens=5).transport())


async def test_an_engine_error_is_reported_with_its_status() -> None:
    config = ProbeConfig(engine_url=URL, sizes=SIZES)
    fake = FakeEngine(completion_status=400)
    with pytest.raises(ProbeError, match="POST /v1/completions: 400"):
        await run_probe(config, transport=fake.transport())


async def test_an_unreachable_engine_is_reported() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    config = ProbeConfig(engine_url=URL)
    with pytest.raises(ProbeError, match=r"cannot talk to http://engine\.test:8000"):
        await run_probe(config, transport=httpx.MockTransport(refuse))


def client(fake: FakeEngine) -> httpx.AsyncClient:
    return httpx.AsyncClient(base_url=URL, transport=fake.transport())


def _clock() -> Callable[[], float]:
    return time.perf_counter
