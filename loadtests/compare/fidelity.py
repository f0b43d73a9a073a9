"""The simulator's fidelity: replay the real comparison on the simulated engine.

Each warm repetition of a :mod:`loadtests.compare.arms` run becomes a script — every
request's arrival offset, class, prompt tokens (as vLLM counted them) and answer
length — replayed by :func:`loadtests.sim.replay.replay` with a fitted profile and the
arm's engine flags (through the proxy's scheduler for the proxy arm). Time to first
token is then set side by side per arm and class, p50 and p95 over the warm
repetitions: real (at the client) against simulated. The real value is taken net of
the machine's own stops (:mod:`loadtests.harness.stalls`): the simulator models the engine,
not a machine that stops for a second now and then; the raw value is shown beside
it. The bar of issue #5 is within 30% of the real value.

Usage: ``python -m loadtests.compare.fidelity RECORDS.jsonl [--profile NAME_OR_PATH]``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loadtests.compare.arms import seconds as _s
from loadtests.harness.stalls import stopped_within
from loadtests.sim.profile import Profile, load_profile
from loadtests.sim.replay import ReplayArm, ScriptedRequest, replay
from loadtests.sim.settings import scheduler_config
from loadtests.support.markdown import markdown_table
from proxy.scheduler import TrafficClass
from proxy.scheduler.budget import percentile

PROFILE = "vllm-cpu-tiny"
BAR = 0.30
CLASS_OF = {"running": TrafficClass.INTERACTIVE, "new": TrafficClass.INTERACTIVE}


def arm_for(key: str, profile: Profile) -> ReplayArm:
    """The engine flags (and the proxy, or not) of a comparison arm."""
    if key == "fcfs":
        return ReplayArm(name=key, config=scheduler_config(profile))
    if key == "priority":
        return ReplayArm(name=key, config=scheduler_config(profile, scheduling_policy="priority"))
    if key == "budget512":
        return ReplayArm(name=key, config=scheduler_config(profile, max_num_batched_tokens=512))
    if key == "proxy":
        config = scheduler_config(profile, long_prefill_token_threshold=256)
        return ReplayArm(name=key, config=config, through_proxy=True)
    raise ValueError(f"no arm {key!r}")


@dataclass(frozen=True)
class Row:
    arm: str
    cls: TrafficClass
    real_p50: float
    sim_p50: float
    real_p95: float
    sim_p95: float
    samples: int
    raw_p50: float
    raw_p95: float

    @property
    def error_p50(self) -> float:
        return self.sim_p50 / self.real_p50 - 1

    @property
    def error_p95(self) -> float:
        return self.sim_p95 / self.real_p95 - 1

    @property
    def met(self) -> bool:
        return abs(self.error_p50) <= BAR + 1e-9 and abs(self.error_p95) <= BAR + 1e-9


def read_records(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _prompt_tokens(row: dict[str, Any]) -> int | None:
    """The engine's count of a request's prompt: from its usage, or for a stream the
    client closed (no usage came) the count it was sent with."""
    if row["prompt_tokens"] is not None:
        return int(row["prompt_tokens"])
    if row.get("closed_at") is not None and row["prompt_tokens_sent"]:
        return int(row["prompt_tokens_sent"])
    return None


def _answer_tokens(row: dict[str, Any]) -> int:
    """How many tokens the engine generated: ``max_tokens``, or for a stream the client
    closed, the tokens it had received (the engine stopped at the close)."""
    if row.get("closed_at") is not None:
        return max(1, len(row["token_times"]))
    return int(row["max_tokens"])


def compare(records: Sequence[dict[str, Any]], profile: Profile) -> list[Row]:
    """Replay every warm, kept repetition; real and simulated TTFT per arm and class."""
    reps: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        # A failed request has no engine count of its prompt: it cannot be replayed.
        if not r["cold"] and not r["set_aside"] and _prompt_tokens(r) is not None:
            reps[(r["arm"], r["repetition"])].append(r)
    real: dict[tuple[str, TrafficClass], list[float]] = defaultdict(list)
    raw: dict[tuple[str, TrafficClass], list[float]] = defaultdict(list)
    sim: dict[tuple[str, TrafficClass], list[float]] = defaultdict(list)
    for (arm, _), rows in sorted(reps.items()):
        start = min(r["sent_at"] for r in rows)
        script = [
            ScriptedRequest(
                id=r["id"],
                at_s=r["sent_at"] - start,
                cls=CLASS_OF.get(r["kind"], TrafficClass.BATCH),
                prompt_tokens=_prompt_tokens(r) or 0,  # every row kept above has one
                max_tokens=_answer_tokens(r),
            )
            for r in rows
        ]
        for r, replayed in zip(
            rows, replay(script, arm_for(arm, profile), profile.step), strict=True
        ):
            key = (arm, CLASS_OF.get(r["kind"], TrafficClass.BATCH))
            if r["ttft"] is not None and replayed.ttft_s is not None:
                # Record.ttft_net's arithmetic, on the row's own ttft
                first = r["sent_at"] + r["ttft"]
                stops = [(float(a), float(s)) for a, s in r.get("stall_spans", [])]
                real[key].append(r["ttft"] - stopped_within(r["sent_at"], first, stops))
                raw[key].append(r["ttft"])
                sim[key].append(replayed.ttft_s)
    return [
        Row(
            arm,
            cls,
            percentile(real[(arm, cls)], 0.5),
            percentile(sim[(arm, cls)], 0.5),
            percentile(real[(arm, cls)], 0.95),
            percentile(sim[(arm, cls)], 0.95),
            len(real[(arm, cls)]),
            percentile(raw[(arm, cls)], 0.5),
            percentile(raw[(arm, cls)], 0.95),
        )
        for arm, cls in real
    ]


def table(rows: Sequence[Row]) -> str:
    header = ["arm", "class (requests)", "TTFT p50 real / sim", "error", "TTFT p95 real / sim"]
    header += ["error", "within 30%", "raw real p50 / p95"]
    return markdown_table(
        header,
        (
            [
                r.arm,
                f"{r.cls.value} ({r.samples})",
                f"{_s(r.real_p50)} / {_s(r.sim_p50)}",
                f"{r.error_p50:+.0%}",
                f"{_s(r.real_p95)} / {_s(r.sim_p95)}",
                f"{r.error_p95:+.0%}",
                "yes" if r.met else "NO",
                f"{_s(r.raw_p50)} / {_s(r.raw_p95)}",
            ]
            for r in rows
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m loadtests.compare.fidelity", description=__doc__
    )
    parser.add_argument("records", type=Path, help="records.jsonl of a comparison run")
    parser.add_argument("--profile", default=PROFILE)
    args = parser.parse_args(argv)
    rows = compare(read_records(args.records), load_profile(args.profile))
    text = table(rows)
    print(text)
    (args.records.parent / "fidelity.md").write_text(text + "\n")
    return 0 if all(r.met for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
