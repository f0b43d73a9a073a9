"""Two models on one card in virtual time: chat on model ``a``, a batch job on model
``b``, only one of them awake at a time (issue 32).

One simulated engine is the card; a swap empties it (nothing in flight is cut: the
awake model drains first) and then runs nothing for ``wake_s`` while the other model
wakes. Arms, each on a fresh card and the same arrivals:

- ``a alone``: the chat, no batch job (the reference);
- ``policy``: :func:`proxy.scheduler.residency.decide` says when to swap;
- ``swap on demand``: the oldest request waiting names the model (what a router that
  wakes whatever the next request asks for does): a request for the sleeping model
  drains the awake one and swaps;
- ``two half cards``: each model on an engine of half the card, no swaps (each
  step twice as long, half the KV cache).

Chat comes in spells (``chat_on_s`` of Poisson arrivals, then ``chat_off_s`` of
none), as a team's does; the batch job's lines all wait from the start, kept
``batch_outstanding`` in flight by a closed loop, its completion window
``window_s``. Per arm: chat TTFT p50/p95 over every chat and over those that did not
wait for a wake, batch lines done per hour while the job ran and when its last
line finished (within its window or not), swaps per hour.

Run: ``python -m loadtests.sim.card``.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

from loadtests.sim.drivers import Recorder, RequestRecord
from loadtests.sim.profile import Profile, load_profile
from loadtests.sim.settings import scheduler_config
from loadtests.sim.step_loop import SimEngine
from loadtests.sim.virtual import VirtualRunner
from loadtests.support.markdown import markdown_table
from proxy.clock import VirtualClock
from proxy.scheduler import TrafficClass
from proxy.scheduler.budget import percentile
from proxy.scheduler.residency import Card, Demand, Move, ResidencyRules, decide

ARMS = ("a alone", "policy", "swap on demand", "two half cards")
TICK_S = 1.0


@dataclass(frozen=True, kw_only=True)
class CardWorkload:
    duration_s: float = 7200.0
    chat_rate_per_s: float = 1.0
    chat_on_s: float = 600.0
    chat_off_s: float = 300.0
    chat_prompt_tokens: tuple[int, int] = (200, 2000)
    chat_answer_tokens: tuple[int, int] = (100, 300)
    batch_lines: int = 20_000
    batch_prompt_tokens: tuple[int, int] = (1000, 3000)
    batch_answer_tokens: int = 200
    batch_outstanding: int = 64
    window_s: float = 7200.0
    wake_s: float = 8.0
    seed: int = 0


@dataclass
class CardResult:
    arm: str
    ttft_p50: float
    ttft_p95: float
    ttft_p95_no_wake: float
    chats: int
    chats_waited_for_wake: int
    batch_done: int
    batch_last_s: float | None
    swaps: int
    duration_s: float

    @property
    def batch_per_hour(self) -> float:
        """Lines done per hour while the job ran (to its last line, else the run)."""
        span = self.batch_last_s if self.batch_last_s else self.duration_s
        return self.batch_done * 3600.0 / span

    @property
    def swaps_per_hour(self) -> float:
        return self.swaps * 3600.0 / self.duration_s


@dataclass
class _Chat:
    rid: str
    arrival: float
    prompt: list[int]
    answer: int
    woke_for: bool = False  # it waited while a model was being woken


@dataclass
class _Card:
    """The driver's side of one card: the engine, what it holds, what waits."""

    engine: SimEngine
    state: Card
    chats: list[_Chat] = field(default_factory=list)
    chat_in_flight: set[str] = field(default_factory=set)
    batch_in_flight: set[str] = field(default_factory=set)
    last_chat: float | None = None
    swaps: int = 0


def chat_arrivals(w: CardWorkload, rng: random.Random) -> list[float]:
    """Poisson arrivals in spells of ``chat_on_s``, ``chat_off_s`` apart."""
    times: list[float] = []
    t = 0.0
    period = w.chat_on_s + w.chat_off_s
    while True:
        t += rng.expovariate(w.chat_rate_per_s)
        if t >= w.duration_s:
            return times
        if t % period < w.chat_on_s:
            times.append(t)


def run_arm(arm: str, w: CardWorkload, profile: Profile, rules: ResidencyRules) -> CardResult:
    """One arm of :data:`ARMS` on a fresh card."""
    rng = random.Random(w.seed)
    clock = VirtualClock()
    config = scheduler_config(profile)
    half = arm == "two half cards"
    if half:
        slow = profile.step.scaled(2.0)
        halved = replace(config, num_gpu_blocks=config.num_gpu_blocks // 2)
        engines = [SimEngine(halved, slow, clock), SimEngine(halved, slow, clock)]
    else:
        engines = [SimEngine(config, profile.step, clock)]
    runner = VirtualRunner(engines, clock)
    rec = Recorder()
    runner.listeners.append(rec.listen)
    cards = [
        _Card(e, Card(f"card{i}", ("a", "b") if not half else (("a",), ("b",))[i]))
        for i, e in enumerate(engines)
    ]
    for card in cards:
        card.state.awake = card.state.models[0]  # a is awake at the start
        card.state.wake_s = {"a": w.wake_s, "b": w.wake_s}
    chat_card, batch_card = (cards[0], cards[1]) if half else (cards[0], cards[0])
    chats: dict[str, _Chat] = {}
    batch_left = w.batch_lines if arm != "a alone" else 0
    batch_done: list[float] = []
    # swap on demand: since when the batch runner's next line has waited, undispatched
    # (None: lines go out as slots free, their model awake)
    line_ready: list[float | None] = [0.0 if batch_left else None]
    # card seconds per batch line: a guess until 100 lines finished, then learned
    line_s = [0.25]
    ids = iter(range(10**9))

    def send_chat(card: _Card, chat: _Chat) -> None:
        rec.records[chat.rid] = RequestRecord(TrafficClass.INTERACTIVE, chat.arrival)
        card.engine.add_request(chat.prompt, chat.answer, request_id=chat.rid)
        card.chat_in_flight.add(chat.rid)

    def send_batch(card: _Card) -> None:
        nonlocal batch_left
        while batch_left and len(card.batch_in_flight) < w.batch_outstanding:
            rid = f"line-{next(ids)}"
            prompt = rng.randint(*w.batch_prompt_tokens)
            rec.records[rid] = RequestRecord(TrafficClass.BATCH, clock.now())
            tokens = [rng.randrange(16, 32000) for _ in range(prompt)]
            card.engine.add_request(tokens, w.batch_answer_tokens, request_id=rid)
            card.batch_in_flight.add(rid)
            batch_left -= 1
        line_ready[0] = None

    def begin_swap(card: _Card, target: str, now: float) -> None:
        card.state.swapping = target
        card.swaps += 1
        for chat in card.chats:
            chat.woke_for = True

        def woken(t: float) -> None:
            card.state.awake, card.state.awake_since, card.state.swapping = target, t, None
            control(t)

        runner.call_at(now + w.wake_s, woken)

    def demand(card: _Card, now: float) -> dict[str, Demand]:
        out = {
            "a": Demand(
                chat_waiting=len(card.chats),
                chat_oldest=card.chats[0].arrival if card.chats else None,
                chat_in_flight=len(card.chat_in_flight),
                last_chat=card.last_chat,
            )
        }
        if batch_left:
            out["b"] = Demand(
                batch_waiting=batch_left,
                batch_deadline=w.window_s,
                batch_work_s=batch_left * line_s[0],
            )
        return out

    def serve_awake(card: _Card) -> None:
        if card.state.awake == "a":
            for chat in card.chats:
                send_chat(card, chat)
            card.chats.clear()
        elif card.state.awake == "b":
            send_batch(card)

    def control(now: float) -> None:
        if half:
            for chat in chat_card.chats:
                send_chat(chat_card, chat)
            chat_card.chats.clear()
            send_batch(batch_card)
            return
        card = cards[0]
        if card.state.swapping is not None:
            return
        card.state.in_flight = len(card.chat_in_flight) + len(card.batch_in_flight)
        if arm == "policy":
            decision = decide(card.state, demand(card, now), now, rules)
            if decision.move is Move.SWAP and decision.target is not None:
                begin_swap(card, decision.target, now)
            elif decision.move is Move.STAY:
                serve_awake(card)
            return
        # swap on demand, and "a alone" (whose card never sees b's work): the oldest
        # request waiting names the model
        oldest_chat = card.chats[0].arrival if card.chats else float("inf")
        ready = line_ready[0]
        oldest_line = ready if batch_left and ready is not None else float("inf")
        if oldest_chat == oldest_line == float("inf"):
            serve_awake(card)  # lines flowing, or nothing to do
            return
        wanted = "a" if oldest_chat <= oldest_line else "b"
        if wanted == card.state.awake:
            serve_awake(card)
        elif card.state.in_flight == 0:
            begin_swap(card, wanted, now)
        elif card.state.awake == "b" and batch_left and ready is None:
            line_ready[0] = now  # a slot freed while draining: the next line waits

    def arrive(chat: _Chat) -> None:
        def at(t: float) -> None:
            chat_card.chats.append(chat)
            chat_card.last_chat = t
            chats[chat.rid] = chat
            control(t)

        runner.call_at(chat.arrival, at)

    def finished(record: RequestRecord, t: float) -> None:
        for card in cards:
            for rid in [r for r in card.chat_in_flight if rec.records[r] is record]:
                card.chat_in_flight.discard(rid)
                card.last_chat = t
            for rid in [r for r in card.batch_in_flight if rec.records[r] is record]:
                card.batch_in_flight.discard(rid)
                batch_done.append(t)
        control(t)

    rec.on_finished = finished
    for t in chat_arrivals(w, rng):
        prompt = rng.randint(*w.chat_prompt_tokens)
        tokens = [rng.randrange(16, 32000) for _ in range(prompt)]
        arrive(_Chat(f"chat-{next(ids)}", t, tokens, rng.randint(*w.chat_answer_tokens)))

    def tick(t: float) -> None:
        if len(batch_done) > 100:
            line_s[0] = max(0.001, (batch_done[-1] - batch_done[-101]) / 100)
        control(t)
        if t + TICK_S < w.duration_s:
            runner.call_at(t + TICK_S, tick)

    runner.call_at(0.0, tick)
    runner.run(until=w.duration_s)
    ttfts, no_wake = [], []
    for rid, chat in chats.items():
        first = rec.records[rid].first_token if rid in rec.records else None
        if first is None:
            continue
        ttfts.append(first - chat.arrival)
        if not chat.woke_for:
            no_wake.append(first - chat.arrival)
    within = [t for t in batch_done if t <= w.window_s]
    return CardResult(
        arm=arm,
        ttft_p50=percentile(ttfts, 0.5),
        ttft_p95=percentile(ttfts, 0.95),
        ttft_p95_no_wake=percentile(no_wake, 0.95),
        chats=len(ttfts),
        chats_waited_for_wake=len(ttfts) - len(no_wake),
        batch_done=len(within),
        batch_last_s=max(batch_done) if batch_done and batch_left == 0 else None,
        swaps=sum(c.swaps for c in cards),
        duration_s=w.duration_s,
    )


def card_arms(
    w: CardWorkload | None = None,
    profile: Profile | None = None,
    rules: ResidencyRules | None = None,
) -> list[CardResult]:
    w = w or CardWorkload()
    profile = profile or load_profile("h100-llama3-8b")
    rules = rules or ResidencyRules()
    return [run_arm(arm, w, profile, rules) for arm in ARMS]


def card_table(results: list[CardResult], w: CardWorkload) -> str:
    alone = results[0].ttft_p95
    rows = []
    for r in results:
        rows.append(
            [
                r.arm,
                f"{r.ttft_p50 * 1000:,.0f}",
                f"{r.ttft_p95 * 1000:,.0f}",
                f"{r.ttft_p95 / alone:.2f}x" if alone else "-",
                f"{r.ttft_p95_no_wake * 1000:,.0f}",
                f"{r.chats_waited_for_wake:,} of {r.chats:,}",
                f"{r.batch_per_hour:,.0f}",
                "-"
                if r.arm == "a alone"
                else (
                    f"{r.batch_last_s:,.0f} s"
                    if r.batch_last_s is not None
                    else f"no ({r.batch_done:,} of {w.batch_lines:,})"
                ),
                f"{r.swaps_per_hour:.1f}",
            ]
        )
    head = [
        "arm", "chat TTFT p50 ms", "p95 ms", "p95 / a alone", "p95 ms, no wake waited",
        "chats that waited for a wake", "batch lines per hour", "batch done in its window",
        "swaps per hour",
    ]  # fmt: skip
    return markdown_table(head, rows)


def main() -> None:
    w = CardWorkload()
    print(card_table(card_arms(w), w))


if __name__ == "__main__":
    main()
