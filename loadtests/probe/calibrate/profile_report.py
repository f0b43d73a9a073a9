"""A fit as people read it (tables) and as the simulator reads it (a profile file)."""

from __future__ import annotations

import math
from collections.abc import Iterable
from datetime import datetime

from loadtests.engine_io import EngineInfo
from loadtests.probe.calibrate.cost_fit import COLUMNS, OVERHEAD, FitResult
from loadtests.probe.calibrate.measure import Plan
from loadtests.probe.calibrate.token_times import Kind, Measurement
from loadtests.sim.profile import EngineDefaults, Profile, dump_profile

_UNITS = {
    "fixed_s": "per step",
    "prefill_per_token_s": "per prompt token",
    "decode_per_token_s": "per decoding sequence",
    "decode_step_overhead_s": "per step that decodes",
    OVERHEAD: "per request (not in profile)",
    "prefill_attention_per_token_context_s": "per prompt token x context",
    "decode_per_context_token_s": "per context token read",
}


_CLOCKS = {
    False: "wall clock at the client (TTFT, token arrival times)",
    True: "the engine's own histograms (request_prefill_time, inter_token_latency)",
}


def human_seconds(seconds: float) -> str:
    """``0.0045`` -> ``4.5 ms``; three significant figures, s / ms / µs / ns."""
    magnitude = abs(seconds)
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if magnitude >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return "0" if seconds == 0 else f"{seconds / 1e-9:.3g} ns"


def residual_summary(result: FitResult) -> dict[Kind, tuple[float, float]]:
    """Per kind measured: (RMS, max absolute) of the relative errors."""
    summary: dict[Kind, tuple[float, float]] = {}
    for kind in Kind:
        errors = result.relative_errors(kind)
        if errors:
            rms = math.sqrt(sum(e * e for e in errors) / len(errors))
            summary[kind] = (rms, max(abs(e) for e in errors))
    return summary


def coefficient_table(result: FitResult) -> str:
    head = f"{'coefficient':<40} {'value (s)':>12} {'':>10}  {'paid':<30} status"
    lines = [head, "-" * len(head)]
    for name in COLUMNS:
        value = result.coefficient(name)
        state = "fitted" if name in result.fitted else "set to 0"
        lines.append(
            f"{name:<40} {value:>12.4e} {human_seconds(value):>10}  {_UNITS[name]:<30} {state}"
        )
    return "\n".join(lines)


def measurement_table(result: FitResult) -> str:
    head = f"{'kind':<8} {'prompt':>6} {'steps':>5} {'batch':>5} {'context':>8} "
    head += f"{'measured':>10} {'fitted':>10} {'error':>7}"
    lines = [head, "-" * len(head)]
    for m in result.measurements:
        predicted = result.predict(m)
        error = (predicted - m.seconds) / m.seconds
        lines.append(
            f"{m.kind.value:<8} {m.prompt_tokens:>6} {m.prefill_steps or '':>5} "
            f"{m.batch or '':>5} {_context(m):>8} {human_seconds(m.seconds):>10} "
            f"{human_seconds(predicted):>10} {error:>+7.1%}"
        )
    return "\n".join(lines)


def _context(m: Measurement) -> str:
    return f"{m.context_tokens:.0f}" if m.context_tokens else ""


def residual_table(result: FitResult) -> str:
    lines = [f"{'residuals':<10} {'n':>3} {'RMS':>7} {'max':>7}"]
    for kind, (rms, worst) in residual_summary(result).items():
        n = len(result.relative_errors(kind))
        lines.append(f"{kind.value:<10} {n:>3} {rms:>7.1%} {worst:>7.1%}")
    return "\n".join(lines)


def report(result: FitResult) -> str:
    """The three tables, and the fit's notes."""
    parts = [coefficient_table(result), measurement_table(result), residual_table(result)]
    if result.notes:
        parts.append("notes:\n" + "\n".join(f"  - {n}" for n in result.notes))
    return "\n\n".join(parts)


def fitted_profile(
    result: FitResult, info: EngineInfo, plan: Plan, name: str, when: str
) -> Profile:
    """The fit as a profile; the engine section from what the engine said."""
    defaults = EngineDefaults()
    block = info.block_size or defaults.block_size
    blocks = info.num_gpu_blocks or max(defaults.num_gpu_blocks, -(-info.max_model_len // block))
    return Profile(
        name=name,
        model=info.model,
        description=f"Fitted by `whoseturn sim calibrate` against {info.url} on {when}.",
        step=result.cost,
        engine=EngineDefaults(
            max_num_batched_tokens=plan.budget,
            max_model_len=info.max_model_len,
            block_size=block,
            num_gpu_blocks=blocks,
        ),
    )


def profile_file(
    result: FitResult, info: EngineInfo, plan: Plan, *, name: str, now: datetime, seconds: float
) -> str:
    """The profile YAML with a header that says where it came from."""
    when = now.strftime("%Y-%m-%d %H:%M UTC")
    command = f"whoseturn sim calibrate --engine {info.url} --max-num-batched-tokens {plan.budget}"
    command += " --clock engine" if plan.engine_clock else ""
    header = [
        f"Fitted by `{command}`",
        f"on {when} in {seconds:.0f} s. Engine: model {info.model}, max_model_len"
        f" {info.max_model_len};",
        f"step budget {plan.budget} tokens (as given to calibrate, not read from the engine).",
        f"Times: {_CLOCKS[plan.engine_clock]}.",
        f"Measurements (medians of {plan.repeats} runs each):",
        *_ranges(result.measurements, plan.engine_clock),
        "Fit: least squares on relative error; residuals RMS / max:",
        *(
            f"  {kind.value}: {rms:.1%} / {worst:.1%}"
            for kind, (rms, worst) in residual_summary(result).items()
        ),
        *(
            []
            if plan.engine_clock
            else [
                "Request overhead outside the steps (TTFT intercept, not in the profile):"
                f" {human_seconds(result.request_overhead_s)}."
            ]
        ),
        *(f"Note: {n}" for n in result.notes),
        "Block size and KV blocks: from vllm:cache_config_info when the engine has it.",
    ]
    profile = fitted_profile(result, info, plan, name, when)
    return "".join(f"# {line}\n" for line in header) + dump_profile(profile)


def _ranges(measurements: tuple[Measurement, ...], engine_clock: bool) -> list[str]:
    lines = []
    what = {
        Kind.PREFILL: "prefill alone, " + ("prefill time" if engine_clock else "TTFT"),
        Kind.DECODE: "decode steps",
        Kind.MIXED: "one decode beside a one-step prefill",
    }
    for kind in Kind:
        ms = [m for m in measurements if m.kind is kind]
        if not ms:
            continue
        prompts = _span(m.prompt_tokens for m in ms)
        batches = _span(m.batch for m in ms)
        times = f"{human_seconds(min(m.seconds for m in ms))}-"
        times += human_seconds(max(m.seconds for m in ms))
        shape = f"batch {batches}, prompts {prompts}" if kind is not Kind.PREFILL else prompts
        lines.append(f"  {what[kind]}: {len(ms)} shapes, {shape} tokens, {times}")
    return lines


def _span(values: Iterable[int]) -> str:
    items = sorted(set(values))
    return f"{items[0]}" if len(items) == 1 else f"{items[0]}-{items[-1]}"
