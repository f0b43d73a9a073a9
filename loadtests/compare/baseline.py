"""The baseline workload of ``shared/notes/vllm-cpu.md``: chat beside a batch job.

One repetition:

1. A chat stream starts (a ~60-token question, an answer of up to 4,000 tokens).
2. Once it is running (its first tokens arrived), eight batch prompts of ~5,300
   tokens each are submitted at once, each a different passage of real text.
3. Three new short chat requests (16-token answers) arrive 0.5, 1.0 and 1.5 s after
   the batch.
4. Once every batch prompt has its first token (its prefill is over) and the new
   chats are done, the running stream is closed by the client: so it runs beside
   the whole of the batch's prefill in every repetition, however fast or slow the
   engine is, and its gaps always measure what the batch did to it. (An answer of a
   fixed length either ends before the batch is prefilled now and then or keeps the
   repetition running long after.)
5. The repetition ends when every batch answer is whole.

Every request asks vLLM for ``return_token_ids``, so that every token comes as its
own chunk: this model's gibberish often holds its text back for many tokens (an
incomplete character), which would read as a long gap. Chat goes to ``chat_url``
and batch to ``batch_url``: the engine's own
``/v1/...`` routes when the engine is used directly, the proxy's ``/v1/...`` and
``/batch/v1/...`` routes through the proxy. Under the engine's priority policy,
chat requests carry priority -10 and batch 0 (lower runs first in vLLM).
Every prompt is unique from its first token (see :mod:`loadtests.harness.corpus`), so the
engine's prefix cache never skips a prefill, in any repetition.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import httpx

from loadtests.harness.client import Record, close, stream
from loadtests.harness.corpus import Prompt, Tokenizer, corpus, sized_prompt

CHAT_PRIORITY = -10
BATCH_PRIORITY = 0


@dataclass(frozen=True, kw_only=True)
class Workload:
    # At most: the stream is closed once the batch is prefilled (step 4 above).
    running_answer_tokens: int = 4000
    batch_prompts: int = 8
    batch_prompt_tokens: int = 5300
    # Each batch prompt's own size, when they differ (overrides the two above).
    batch_prompt_sizes: tuple[int, ...] = ()
    batch_answer_tokens: int = 32
    new_chats_after_s: tuple[float, ...] = (0.5, 1.0, 1.5)
    new_chat_answer_tokens: int = 16
    # The batch is submitted once the running stream has this many tokens.
    running_tokens_before_batch: int = 10


@dataclass(frozen=True)
class Prompts:
    """One repetition's inputs: the same for every arm, unique across repetitions."""

    running: list[dict[str, str]]
    running_tokens: int  # the running chat's prompt, as the engine counts it
    batch: list[Prompt]
    new_chats: list[list[dict[str, str]]]


QUESTIONS = (
    "What does the with statement guarantee when the block raises, and why?",
    "How do I read a file line by line without loading all of it?",
    "Why is my default argument list shared between calls?",
    "When should I use a generator instead of a list?",
)


def prepare(tokenizer: Tokenizer, workload: Workload, repetition: int) -> Prompts:
    """The prompts of repetition ``repetition`` (0 is the cold one), sized by the
    engine's tokenizer; passages rotate through the corpus from one repetition to
    the next."""
    sizes = workload.batch_prompt_sizes or (workload.batch_prompt_tokens,) * workload.batch_prompts
    stride = len(corpus()) // (len(sizes) * 3 + 1)
    batch = [
        sized_prompt(
            tokenizer,
            f"Batch document {i + 1} of repetition {repetition}. Summarise it.",
            (repetition * len(sizes) + i) * stride,
            size,
        )
        for i, size in enumerate(sizes)
    ]
    running = [
        {"role": "system", "content": f"Conversation {repetition}-0. Answer at length."},
        {"role": "user", "content": QUESTIONS[0] + " Walk me through an example."},
    ]
    new_chats = [
        [{"role": "user", "content": f"Chat {repetition}-{i + 1}: {q}"}]
        for i, q in enumerate(QUESTIONS[1 : 1 + len(workload.new_chats_after_s)])
    ]
    return Prompts(running, tokenizer.count_messages(running), batch, new_chats)


def _priority(body: dict[str, Any], priority: int | None) -> dict[str, Any]:
    return body if priority is None else {**body, "priority": priority}


async def run_once(
    http: httpx.AsyncClient,
    chat_url: str,
    batch_url: str,
    prompts: Prompts,
    workload: Workload,
    *,
    model: str,
    priorities: bool,
    tag: str,
) -> tuple[list[Record], float]:
    """One repetition; returns every request's record and the time the batch was
    submitted."""
    chat_priority = CHAT_PRIORITY if priorities else None
    batch_priority = BATCH_PRIORITY if priorities else None
    chat = f"{chat_url}/chat/completions"
    running = Record(
        f"{tag}-running",
        "running",
        chat,
        prompts.running_tokens,
        workload.running_answer_tokens,
        time.monotonic(),
    )
    running_body = {
        "model": model,
        "messages": prompts.running,
        "max_tokens": workload.running_answer_tokens,
        "temperature": 0,
        "return_token_ids": True,
    }
    tasks = [asyncio.create_task(stream(http, running, _priority(running_body, chat_priority)))]
    while len(running.token_times) < workload.running_tokens_before_batch:
        if tasks[0].done():
            raise RuntimeError(f"the running chat ended early: {running.error}")
        await asyncio.sleep(0.005)
    batch_at = time.monotonic()
    records = [running]
    batch_tasks: list[asyncio.Task[Record]] = []
    for i, prompt in enumerate(prompts.batch):
        record = Record(
            f"{tag}-batch-{i}",
            "batch",
            f"{batch_url}/completions",
            prompt.tokens,
            workload.batch_answer_tokens,
            batch_at,
        )
        body = {
            "model": model,
            "prompt": prompt.text,
            "max_tokens": workload.batch_answer_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        records.append(record)
        batch_tasks.append(
            asyncio.create_task(stream(http, record, _priority(body, batch_priority)))
        )
    tasks.extend(batch_tasks)
    new_tasks: list[asyncio.Task[Record]] = []
    for i, (after, messages) in enumerate(
        zip(workload.new_chats_after_s, prompts.new_chats, strict=True)
    ):
        await asyncio.sleep(max(0.0, batch_at + after - time.monotonic()))
        record = Record(
            f"{tag}-new-{i}", "new", chat, 0, workload.new_chat_answer_tokens, time.monotonic()
        )
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": workload.new_chat_answer_tokens,
            "temperature": 0,
            "return_token_ids": True,
        }
        records.append(record)
        new_tasks.append(asyncio.create_task(stream(http, record, _priority(body, chat_priority))))
    tasks.extend(new_tasks)
    await _prefilled(records[1 : 1 + len(batch_tasks)], batch_tasks, new_tasks)
    await close(running, tasks[0])
    await asyncio.gather(*tasks[1:])
    return records, batch_at


async def _prefilled(
    batch: list[Record], batch_tasks: list[asyncio.Task[Record]], new: list[asyncio.Task[Record]]
) -> None:
    """Until every batch prompt has its first token (or has ended, failed) and every
    new chat is done."""
    pairs = list(zip(batch, batch_tasks, strict=True))
    while True:
        if all(r.token_times or t.done() for r, t in pairs) and all(t.done() for t in new):
            return
        await asyncio.sleep(0.005)
