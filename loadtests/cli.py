"""The test bench's commands: ``whoseturn sim`` (with ``interference``, ``evaluate`` and
``calibrate``), ``whoseturn probe``, ``whoseturn demo`` and ``whoseturn loadtest``.

``proxy.cli`` hands the rest of the command line here only when one of these commands
runs, so ``whoseturn serve`` never loads the bench. :func:`main` takes the command's
name and its arguments and returns the exit status.

Flags given to ``sim`` before a subcommand count: engine flags are honoured by
``interference`` and ``evaluate`` (a copy given after the subcommand wins), and a flag
the subcommand has no use for is refused rather than dropped. So every ``sim`` flag
defaults to None here, meaning "not given", and the defaults are applied in one place
(:func:`sim_settings`).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from proxy.help_format import Parser

if TYPE_CHECKING:
    from typing import TypeAlias

    from loadtests.sim import twin
    from loadtests.sim.settings import SimSettings

    Commands: TypeAlias = argparse._SubParsersAction[argparse.ArgumentParser]

SIM_HOST = "127.0.0.1"
SIM_PORT = 8000
SIM_TIME_SCALE = 1.0

ENGINE_FLAGS = (
    "profile",
    "max_num_batched_tokens",
    "max_num_seqs",
    "max_model_len",
    "enable_chunked_prefill",
    "long_prefill_token_threshold",
    "scheduling_policy",
    "block_size",
    "num_gpu_blocks_override",
    "enable_prefix_caching",
    "async_scheduling",
)
SERVING_FLAGS = (
    "host",
    "port",
    "served_model_name",
    "time_scale",
    "enable_prompt_tokens_details",
    "request_log",
    "kv_events_config",
)


def main(command: str, argv: Sequence[str]) -> int:
    """Run ``whoseturn COMMAND ARGV...`` for a bench command; the exit
    status."""
    from loadtests.sim.profile import ProfileError

    args = parse(command, argv)
    try:
        return _run(args)
    except (ProfileError, ValueError) as exc:
        print(f"whoseturn: error: {exc}", file=sys.stderr)
        return 2


def parse(command: str, argv: Sequence[str]) -> argparse.Namespace:
    """The namespace of ``whoseturn COMMAND ARGV...``; exits 2 on a refused flag."""
    from loadtests.probe.command import add_probe_parser

    parser = Parser(prog="whoseturn")
    # add_probe_parser takes ArgumentParser's subparsers; Parser is one.
    commands = cast("Commands", parser.add_subparsers(dest="command", required=True))
    sim = _add_sim_parser(commands)
    add_probe_parser(commands)
    _add_demo_parser(commands)
    args = parser.parse_args([command, *argv])
    problem = _misplaced(args)
    if problem:
        sim.error(problem)
    return args


def _add_demo_parser(commands: Commands) -> None:
    from loadtests.demo.run import add_arguments

    demo = commands.add_parser(
        "demo",
        help="chat beside a batch job, direct and through the proxy",
        description="Start two simulated engines and the proxy on loopback, run a short "
        "chat and batch workload directly against the engines and through the proxy, "
        "print the side-by-side table and write a report with plots.",
    )
    add_arguments(demo)
    from loadtests.harness.loadtest import add_arguments as add_loadtest_arguments

    loadtest = commands.add_parser(
        "loadtest",
        help="a workload file against a proxy and, if given, directly against engines",
        description="Run a workload file (loadtests/workloads/*.yaml) against a running "
        "proxy and, with --direct, against its engines; print the side-by-side table and "
        "write a result directory.",
    )
    add_loadtest_arguments(loadtest)


def _add_sim_parser(commands: Commands) -> argparse.ArgumentParser:
    from loadtests.probe.calibrate.command import add_arguments as add_calibrate_arguments

    sim = commands.add_parser(
        "sim",
        help="run the simulated vLLM-compatible engine",
        description="Serve a model of vLLM's V1 scheduler over vLLM's HTTP API "
        "(/health answers 200 when ready), or, with a subcommand, run it in virtual time.",
    )
    _add_engine_flags(sim, suppress=False)
    sim.add_argument(
        "--host",
        default=None,
        metavar="ADDRESS",
        help=f"address to listen on (default: {SIM_HOST})",
    )
    sim.add_argument(
        "--port", type=int, default=None, metavar="N", help=f"port (default: {SIM_PORT})"
    )
    sim.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="model name clients use (default: the profile's model)",
    )
    sim.add_argument(
        "--time-scale",
        type=float,
        default=None,
        metavar="X",
        help=f"run model time this many times faster than wall time (default: {SIM_TIME_SCALE})",
    )
    sim.add_argument(
        "--enable-prompt-tokens-details",
        action="store_true",
        default=None,
        help="report the prompt tokens found in the prefix cache in each answer's usage "
        "(prompt_tokens_details.cached_tokens), as vLLM does with this flag (default: off)",
    )
    sim.add_argument(
        "--kv-events-config",
        default=None,
        metavar="JSON",
        help="publish vLLM's KV-cache events over ZMQ, as vLLM does with this flag: a JSON "
        'object of vLLM\'s keys, e.g. \'{"enable_kv_cache_events": true, "endpoint": '
        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558"}\' (default: off)',
    )
    sim.add_argument(
        "--request-log",
        default=None,
        metavar="PATH",
        help="append a JSON line to PATH when each generation request arrives and when "
        "it ends (for tests that count what reached the engine; default: none)",
    )
    subcommands = sim.add_subparsers(dest="sim_command", metavar="SUBCOMMAND")
    inter = _table_command(
        subcommands,
        "interference",
        "print the chat-behind-batch interference table, in virtual time",
    )
    inter.add_argument("--batch-prompts", type=int, default=64, help="batch prompts queued")
    inter.add_argument("--batch-prompt-tokens", type=int, default=8000, help="tokens each")
    evaluate = _table_command(
        subcommands,
        "evaluate",
        "chat beside a batch job: direct vs through the proxy's scheduler, virtual time",
    )
    evaluate.add_argument("--duration", type=float, default=600.0, help="virtual seconds")
    evaluate.add_argument(
        "--workload",
        choices=("large-docs", "small-docs"),
        default="large-docs",
        help="large-docs: 8,000-token documents, one fits in a budget; small-docs: "
        "500-2,000-token documents at 6 chats/s, several fit, and the proxy is also run "
        "with each of its rules switched off",
    )
    evaluate.add_argument("--chat-rate", type=float, help="chat requests/s (default: workload's)")
    evaluate.add_argument("--batch-concurrency", type=int, help="documents kept (default: 128)")
    evaluate.add_argument("--seed", type=int, default=0, help="workload random seed")
    evaluate.add_argument(
        "--batch-min-share",
        type=float,
        default=0.05,
        help="the proxy's starvation bound: batch's minimum share of prefill (0: none)",
    )
    evaluate.add_argument(
        "--hold-timeout", type=float, default=10.0, help="the proxy's hold timeout, seconds"
    )
    calibrate = subcommands.add_parser(
        "calibrate", help="measure a real engine over HTTP and fit a simulator profile"
    )
    add_calibrate_arguments(calibrate)
    # The engine's step budget may be given before `calibrate` as well as after it:
    # not given after it, it leaves what `sim` was given.
    for action in calibrate._actions:
        if action.dest == "max_num_batched_tokens":
            action.default = argparse.SUPPRESS
    return sim


def _table_command(subcommands: Commands, name: str, help: str) -> argparse.ArgumentParser:
    """A ``sim`` subcommand that prints a table from the engine model: it takes the
    engine flags, which may also come before it (``sim --profile P NAME``)."""
    command = subcommands.add_parser(name, help=help)
    _add_engine_flags(command, suppress=True)
    return command


def _add_engine_flags(p: argparse.ArgumentParser, *, suppress: bool) -> None:
    """vLLM's own flag names, so a command line moves between the two unchanged.

    With ``suppress`` a flag not given leaves what ``sim`` itself was given.
    """
    from loadtests.sim.profile import DEFAULT_PROFILE, builtin_profiles

    unset: Any = argparse.SUPPRESS if suppress else None
    profiles = ", ".join(builtin_profiles())
    count: dict[str, Any] = {"type": int, "metavar": "N"}
    switch: dict[str, Any] = {"action": argparse.BooleanOptionalAction}
    profile_help = f"cost profile: a YAML file or one of {profiles} (default: {DEFAULT_PROFILE})"
    flags: list[tuple[str, dict[str, Any], str]] = [
        ("--profile", {"metavar": "NAME|FILE"}, profile_help),
        ("--max-num-batched-tokens", count, "token budget per step (default: the profile's)"),
        ("--max-num-seqs", count, "sequences per step (default: the profile's)"),
        ("--max-model-len", count, "context length (default: the profile's)"),
        ("--enable-chunked-prefill", switch, "split long prefills over steps (default: on)"),
        ("--long-prefill-token-threshold", count, "cap on one prefill's tokens per step, "
         "0 for none (default: 0)"),
        ("--scheduling-policy", {"choices": ["fcfs", "priority"]},
         "order of waiting requests (default: fcfs)"),
        ("--block-size", count, "KV-cache block size in tokens (default: the profile's)"),
        ("--num-gpu-blocks-override", count, "KV-cache blocks (default: the profile's)"),
        ("--enable-prefix-caching", switch, "reuse the KV cache of repeated prefixes "
         "(default: on)"),
        ("--async-scheduling", switch, "plan each step while the one before it runs, as "
         "vLLM does on a GPU (default: the profile's: what vLLM 0.32 picks there)"),
    ]  # fmt: skip
    for flag, kind, text in flags:
        p.add_argument(flag, default=unset, help=text, **kind)


def _misplaced(args: argparse.Namespace) -> str | None:
    """Why the flags given to ``sim`` before its subcommand cannot be honoured, if so."""
    if args.command != "sim" or args.sim_command is None:
        return None
    refused = [name for name in SERVING_FLAGS if getattr(args, name) is not None]
    if args.sim_command == "calibrate":
        refused += [name for name in ENGINE_FLAGS if name != "max_num_batched_tokens"]
        refused = [name for name in refused if getattr(args, name, None) is not None]
    if not refused:
        return None
    flags = ", ".join("--" + name.replace("_", "-") for name in refused)
    if args.sim_command == "calibrate":
        why = "it measures the engine at --engine and runs no simulator"
    else:
        why = "it runs the engine model in virtual time and serves nothing"
    return f"{flags}: not used by sim {args.sim_command} ({why})"


def _run(args: argparse.Namespace) -> int:
    if args.command == "loadtest":
        from loadtests.harness.loadtest import run_loadtest

        return run_loadtest(args)
    if args.command == "demo":
        from loadtests.demo.run import run_demo

        return run_demo(args)
    if args.command == "probe":
        from loadtests.probe.command import run_probe_command

        return run_probe_command(args)
    if args.sim_command == "interference":
        from loadtests.sim.interference import run_interference

        return run_interference(sim_settings(args), args)
    if args.sim_command == "evaluate":
        return _evaluate(sim_settings(args), args)
    if args.sim_command == "calibrate":
        from loadtests.probe.calibrate.command import run as run_calibrate

        return run_calibrate(args)
    from loadtests.sim.server import run_sim_server

    return run_sim_server(sim_settings(args))


def sim_settings(args: argparse.Namespace) -> SimSettings:
    """The simulated engine's settings from ``sim``'s flags, defaults for those not given."""
    from loadtests.sim.kv_events import KVEventsConfig
    from loadtests.sim.profile import DEFAULT_PROFILE, load_profile
    from loadtests.sim.settings import SimSettings, scheduler_config

    def given(name: str, default: Any) -> Any:
        value = getattr(args, name, None)
        return default if value is None else value

    profile = load_profile(given("profile", DEFAULT_PROFILE))
    kv_json = getattr(args, "kv_events_config", None)
    config = scheduler_config(
        profile,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_chunked_prefill=given("enable_chunked_prefill", True),
        long_prefill_token_threshold=given("long_prefill_token_threshold", 0),
        scheduling_policy=given("scheduling_policy", "fcfs"),
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks_override,
        enable_prefix_caching=given("enable_prefix_caching", True),
        async_scheduling=getattr(args, "async_scheduling", None),
    )
    return SimSettings(
        profile=profile,
        scheduler=config,
        served_model_name=given("served_model_name", profile.model),
        host=given("host", SIM_HOST),
        port=given("port", SIM_PORT if args.sim_command is None else 0),
        time_scale=given("time_scale", SIM_TIME_SCALE),
        enable_prompt_tokens_details=given("enable_prompt_tokens_details", False),
        request_log=Path(args.request_log) if getattr(args, "request_log", None) else None,
        kv_events=KVEventsConfig.from_json(kv_json) if kv_json else None,
    )


def _workload_line(settings: SimSettings, workload: twin.MixedWorkload) -> str:
    lo, hi = workload.batch_doc_tokens
    docs = f"{lo:,}" if lo == hi else f"{lo:,}-{hi:,}"
    return (
        f"Profile `{settings.profile.name}`, virtual time, {workload.duration_s:.0f} s "
        f"(first {workload.warmup_s:.0f} s not counted): Poisson chat at "
        f"{workload.chat_rate_per_s}/s (prompts {workload.chat_prompt_tokens[0]}-"
        f"{workload.chat_prompt_tokens[1]} tokens, answers {workload.chat_answer_tokens[0]}-"
        f"{workload.chat_answer_tokens[1]}) beside a batch job keeping "
        f"{workload.batch_concurrency} documents of {docs} tokens "
        f"({workload.batch_answer_tokens} answer tokens) submitted.\n"
    )


def _evaluate(settings: SimSettings, args: argparse.Namespace) -> int:
    from loadtests.sim import twin
    from proxy.scheduler import HoldRules

    small = args.workload == "small-docs"
    base = twin.SMALL_DOCS if small else twin.MixedWorkload(batch_concurrency=128)
    workload = dataclasses.replace(
        base,
        duration_s=args.duration,
        chat_rate_per_s=args.chat_rate or base.chat_rate_per_s,
        batch_concurrency=args.batch_concurrency or base.batch_concurrency,
        seed=args.seed,
    )
    print(_workload_line(settings, workload))
    model, step = settings.served_model_name, settings.profile.step
    hold = HoldRules(batch_min_share=args.batch_min_share, hold_timeout_s=args.hold_timeout)
    results = twin.evaluation_arms(workload, settings.scheduler, step, model, hold)
    print(twin.evaluation_table(results))
    proxied = results[-1]
    print(
        f"\nBatch under {workload.chat_rate_per_s:g} chats/s through the proxy "
        f"(batch_min_share {hold.batch_min_share:g}, hold timeout {hold.hold_timeout_s:g} s): "
        f"{proxied.batch_docs_per_hour:,.0f} documents/hour, chat TTFT p95 "
        f"{proxied.ttft_p95 * 1000:,.0f} ms"
    )
    print()
    print("\n".join(twin.verdict(results, ttft_target_s=0.3)))
    if small:
        arms = twin.rule_arms(workload, settings.scheduler, step, model)
        print("\nThe proxy with each rule switched off (recommended flags):\n")
        print(twin.evaluation_table([arm for arm, _ in arms]))
        budget = arms[0][1].engines["engine-0"].budget
        print("\nBudget history, every rule on (s: tokens): ", end="")
        print(", ".join(f"{t:.0f}: {b:,}" for t, b in budget.history))
    return 0
