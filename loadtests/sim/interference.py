"""The interference this project exists for, reproduced on the model in virtual time.

``whoseturn sim interference`` prints two markdown tables:

1. the headline: TTFT of a 1,000-token prompt on an idle engine, the batch-1
   decode step, and a chat request's TTFT when many long batch prompts are queued
   ahead of it;
2. the same mixed scenario under several engine settings (the columns of the
   real-vLLM baseline in shared/notes/vllm-cpu.md): one chat stream running, the
   batch prompts landing at once, a new chat request just after them.
"""

from __future__ import annotations

import argparse
import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass

from loadtests.sim.queues import SchedulingPolicy
from loadtests.sim.request import SimRequest
from loadtests.sim.settings import SimSettings
from loadtests.sim.step_loop import SimEngine, StepResult
from loadtests.sim.step_scheduler import SchedulerConfig
from loadtests.sim.virtual import VirtualRunner
from proxy.clock import VirtualClock

CHAT_PROMPT = 1000
CHAT_ANSWER = 100
RUNNING_ANSWER = 400
BATCH_ANSWER = 64
BATCH_AT = 0.5
NEW_CHAT_AT = 0.51


@dataclass(frozen=True)
class MixedResult:
    setting: str
    new_chat_ttft: float
    new_chat_done: float
    running_worst_gap: float
    batch_done: float


class _Prompts:
    """Unique prompts (no shared prefix blocks), reproducible from a seed."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        return [self._rng.randrange(16, 32000) for _ in range(n)]


def _runner(config: SchedulerConfig, settings: SimSettings) -> VirtualRunner:
    clock = VirtualClock()
    return VirtualRunner(SimEngine(config, settings.profile.step, clock), clock)


def idle_ttft(settings: SimSettings, prompt_tokens: int = CHAT_PROMPT) -> float:
    runner = _runner(settings.scheduler, settings)
    box = runner.submit_at(0.0, _Prompts()(prompt_tokens), 1)
    runner.run()
    request = box[0]
    assert request.first_token_time is not None
    return request.first_token_time - request.arrival_time


def batch1_decode_step(settings: SimSettings) -> float:
    """Mean gap between tokens of a lone stream (a 1,000-token conversation)."""
    runner = _runner(settings.scheduler, settings)
    box = runner.submit_at(0.0, _Prompts()(CHAT_PROMPT), CHAT_ANSWER)
    runner.run()
    r = box[0]
    assert r.first_token_time is not None and r.finished_time is not None
    return (r.finished_time - r.first_token_time) / (CHAT_ANSWER - 1)


def mixed(
    name: str,
    config: SchedulerConfig,
    settings: SimSettings,
    batch_prompts: int,
    batch_prompt_tokens: int,
    with_running_chat: bool = True,
) -> MixedResult:
    """One chat stream running, ``batch_prompts`` long prompts at once, a new chat.

    Under the priority policy chat requests get priority -10 and batch 0.
    """
    prompts = _Prompts()
    runner = _runner(config, settings)
    chat_priority = -10 if config.scheduling_policy is SchedulingPolicy.PRIORITY else 0
    running = runner.submit_at(0.0, prompts(CHAT_PROMPT), RUNNING_ANSWER, priority=chat_priority)
    if not with_running_chat:
        running = []
    batch = [
        runner.submit_at(BATCH_AT, prompts(batch_prompt_tokens), BATCH_ANSWER)
        for _ in range(batch_prompts)
    ]
    new_chat = runner.submit_at(
        NEW_CHAT_AT, prompts(CHAT_PROMPT), CHAT_ANSWER, priority=chat_priority
    )
    worst_gap = [0.0]
    runner.listeners.append(_worst_gap_after(running, BATCH_AT, worst_gap))
    runner.run()
    chat = new_chat[0]
    assert chat.first_token_time is not None and chat.finished_time is not None
    batch_end = max(_done(b[0]) for b in batch)
    return MixedResult(
        setting=name,
        new_chat_ttft=chat.first_token_time - chat.arrival_time,
        new_chat_done=chat.finished_time - chat.arrival_time,
        running_worst_gap=worst_gap[0],
        batch_done=batch_end - BATCH_AT,
    )


def _done(request: SimRequest) -> float:
    assert request.finished_time is not None
    return request.finished_time


def _worst_gap_after(
    box: list[SimRequest], since: float, worst: list[float]
) -> Callable[[SimEngine, StepResult], None]:
    def listen(_: SimEngine, result: StepResult) -> None:
        for token in result.tokens:
            if box and token.request is box[0] and token.gap is not None and token.time > since:
                worst[0] = max(worst[0], token.gap)

    return listen


def engine_arms(config: SchedulerConfig) -> list[tuple[str, SchedulerConfig]]:
    """The engine settings compared: the given one and the usual alternatives."""
    steps, whole = (
        config.max_num_batched_tokens,
        max(config.max_num_batched_tokens, config.max_model_len),
    )
    fcfs, prio = SchedulingPolicy.FCFS, SchedulingPolicy.PRIORITY

    def arm(
        name: str, policy: SchedulingPolicy, chunked: bool, budget: int
    ) -> tuple[str, SchedulerConfig]:
        return name, dataclasses.replace(
            config,
            scheduling_policy=policy,
            enable_chunked_prefill=chunked,
            max_num_batched_tokens=budget,
        )

    return [
        arm(f"FCFS, chunked prefill, {steps}-token steps", fcfs, True, steps),
        arm("FCFS, chunked prefill off", fcfs, False, whole),
        arm("FCFS, chunked prefill, 512-token steps", fcfs, True, 512),
        arm("priority (chat -10), chunked prefill", prio, True, steps),
        arm("priority (chat -10), chunked prefill off", prio, False, whole),
    ]


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.1f} ms" if seconds < 1 else f"{seconds:,.2f} s"


def run_interference(settings: SimSettings, args: argparse.Namespace) -> int:
    n, tokens = args.batch_prompts, args.batch_prompt_tokens
    config = settings.scheduler
    behind = mixed("headline", config, settings, n, tokens, with_running_chat=False)
    print(
        f"Profile `{settings.profile.name}`, virtual time; engine: "
        f"{config.max_num_batched_tokens}-token steps, {config.max_num_seqs} seqs, "
        f"{config.scheduling_policy.value}, chunked prefill "
        f"{'on' if config.enable_chunked_prefill else 'off'}.\n"
    )
    print("| measurement | model |")
    print("|---|---|")
    print(f"| TTFT, {CHAT_PROMPT:,}-token prompt, idle engine | {_ms(idle_ttft(settings))} |")
    print(
        f"| decode step, batch of 1 ({CHAT_PROMPT:,}-token context) "
        f"| {_ms(batch1_decode_step(settings))} |"
    )
    print(
        f"| TTFT, {CHAT_PROMPT:,}-token chat behind {n} queued {tokens:,}-token prompts "
        f"| {_ms(behind.new_chat_ttft)} |"
    )
    print(
        f"\nMixed: a chat stream running ({RUNNING_ANSWER} tokens), {n} batch prompts of "
        f"{tokens:,} tokens ({BATCH_ANSWER} answer tokens) at t={BATCH_AT} s, a new "
        f"{CHAT_PROMPT:,}-token chat ({CHAT_ANSWER} answer tokens) 10 ms later.\n"
    )
    print(
        "| engine setting | new chat TTFT | new chat done | running chat worst gap | batch done |"
    )
    print("|---|---|---|---|---|")
    for name, arm in engine_arms(config):
        r = mixed(name, arm, settings, n, tokens)
        print(
            f"| {r.setting} | {_ms(r.new_chat_ttft)} | {_ms(r.new_chat_done)} "
            f"| {_ms(r.running_worst_gap)} | {_ms(r.batch_done)} |"
        )
    return 0
