"""Tenants over HTTP, with the official ``openai`` client against a simulated
engine: a key without the batch class is refused the Batch API (403), and a key
over its tenant's tokens per minute gets a 429 the client reads as a rate limit,
with ``Retry-After``."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam

from loadtests.engine_io.metrics import labelled_samples
from tests.support.metrics import metric_sum

from .proxyserver import ProxyServer, engine, run_proxy
from .simserver import MODEL, SimServer

pytestmark = pytest.mark.integration

CHAT_ONLY, LIMITED, BOTH = "sk-chat-only", "sk-limited", "sk-both"
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Whose turn?"}]


@pytest.fixture(scope="module")
def proxy(shared_sim: SimServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyServer]:
    store = tmp_path_factory.mktemp("tenants") / "batch.db"
    keys = [
        {"key": CHAT_ONLY, "tenant": "chat", "classes": ["interactive"]},
        # a short prompt (a few tokens) fits; after its 28-token answer nothing more does
        {"key": LIMITED, "tenant": "small", "limits": {"tokens_per_minute": 30}},
        BOTH,
    ]
    with run_proxy(
        [engine(shared_sim.base_url, "sim-0")], api_keys=keys, batch_store_path=str(store)
    ) as server:
        yield server


def client_for(proxy: ProxyServer, key: str, path: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{proxy.base_url}{path}", api_key=key, max_retries=0)


def test_a_key_without_the_batch_class_is_refused_the_batch_api(proxy: ProxyServer) -> None:
    with client_for(proxy, CHAT_ONLY) as client:
        with pytest.raises(openai.PermissionDeniedError) as listed:
            client.batches.list()
        with pytest.raises(openai.PermissionDeniedError):
            client.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
        reply = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    assert listed.value.status_code == 403
    assert "may not use the batch class" in listed.value.message
    assert reply.choices[0].message.content  # its own class is served
    batch_route = client_for(proxy, CHAT_ONLY, "/batch/v1")
    with batch_route, pytest.raises(openai.PermissionDeniedError):
        batch_route.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    with client_for(proxy, BOTH) as allowed:
        assert allowed.batches.list().data is not None  # a key with the class is served


def test_a_key_over_its_tokens_per_minute_is_rate_limited(proxy: ProxyServer) -> None:
    with client_for(proxy, LIMITED) as client:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=28)
        with pytest.raises(openai.RateLimitError) as caught:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=28)
    error = caught.value
    assert error.status_code == 429
    assert 1 <= int(error.response.headers["retry-after"]) <= 60
    body = error.response.json()["error"]
    assert (body["type"], body["code"]) == ("tokens", "rate_limit_exceeded")
    assert "tenant small" in body["message"] and "tokens_per_minute 30" in body["message"]
    with client_for(proxy, BOTH) as other:  # another tenant is served meanwhile
        other.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2)
    samples = labelled_samples(metrics_text(proxy))
    limited = metric_sum(samples, "whoseturn_tenant_limited_total", tenant="small")
    assert limited == 1


def test_the_metrics_name_tenants_never_keys(proxy: ProxyServer) -> None:
    text = metrics_text(proxy)
    assert 'tenant="small"' in text and 'tenant="chat"' in text
    for key in (CHAT_ONLY, LIMITED, BOTH):
        assert key not in text


def metrics_text(proxy: ProxyServer) -> str:
    response = proxy.http.get("/metrics", headers={"authorization": f"Bearer {BOTH}"})
    response.raise_for_status()
    return response.text
