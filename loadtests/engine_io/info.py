"""What an engine says about itself: the served model, its context length and, where
the engine exports ``vllm:cache_config_info``, its KV-cache block size and count."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import httpx

from loadtests.engine_io.metrics import labelled_samples


class EngineIOError(RuntimeError):
    """The engine answered something a measurement cannot use (an HTTP error, a body
    that is not what the API promises, a stream that ended too soon); the message
    says what."""


@dataclass(frozen=True, kw_only=True)
class EngineInfo:
    """What the engine says about itself (``/v1/models``, ``/metrics``)."""

    url: str
    model: str
    max_model_len: int
    block_size: int | None = None
    num_gpu_blocks: int | None = None


async def engine_info(
    client: httpx.AsyncClient, model: str | None = None, *, cache_config: bool = False
) -> EngineInfo:
    """The served model (the first ``/v1/models`` lists unless ``model`` is given) and
    its ``max_model_len``; with ``cache_config``, the KV cache's block size and count
    too (``None`` where the engine does not say). Raises :class:`EngineIOError`."""
    response = await client.get("/v1/models")
    await check_status(response)
    cards = _json_object(response).get("data") or []
    card = next((c for c in cards if model in (None, c.get("id"))), None)
    if card is None:
        wanted = f"model {model!r}" if model else "any model"
        raise EngineIOError(f"the engine serves {wanted} not at all (GET /v1/models)")
    max_len = card.get("max_model_len")
    if not isinstance(max_len, int):
        raise EngineIOError("/v1/models gives no max_model_len")
    info = EngineInfo(
        url=str(client.base_url).rstrip("/"), model=str(card["id"]), max_model_len=max_len
    )
    if not cache_config:
        return info
    block_size, num_blocks = await _cache_config(client)
    return dataclasses.replace(info, block_size=block_size, num_gpu_blocks=num_blocks)


async def _cache_config(client: httpx.AsyncClient) -> tuple[int | None, int | None]:
    """``block_size`` and ``num_gpu_blocks`` from ``vllm:cache_config_info``, if any."""
    try:
        response = await client.get("/metrics")
        response.raise_for_status()
        found = labelled_samples(response.text)
    except (httpx.HTTPError, ValueError):
        return None, None
    for name, labels in found:
        if name == "vllm:cache_config_info":
            values = dict(labels)
            return _int(values.get("block_size")), _int(values.get("num_gpu_blocks"))
    return None, None


def _int(text: str | None) -> int | None:
    return int(text) if text is not None and text.isdigit() and int(text) > 0 else None


async def check_status(response: httpx.Response) -> None:
    """Raise :class:`EngineIOError` with the method, path, status and the start of the
    body unless the response succeeded (reads a streamed body first)."""
    if response.is_success:
        return
    text = (await response.aread()).decode(errors="replace")[:300]
    raise EngineIOError(
        f"{response.request.method} {response.url.path}: {response.status_code} {text}"
    )


async def post_json(client: httpx.AsyncClient, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """``POST`` ``body`` to ``path``; the answer's JSON object. Raises
    :class:`EngineIOError` for an error status or an answer that is not an object."""
    response = await client.post(path, json=body)
    await check_status(response)
    return _json_object(response)


def _json_object(response: httpx.Response) -> dict[str, Any]:
    path = response.url.path
    try:
        body = response.json()
    except ValueError as exc:
        raise EngineIOError(f"{path} answered with something other than JSON") from exc
    if not isinstance(body, dict):
        raise EngineIOError(f"{path} answered with JSON that is not an object")
    return body
