"""The ``whoseturn`` command line."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from loadtests.probe.calibrate.command import add_arguments as add_calibrate_arguments
from loadtests.probe.calibrate.command import run as run_calibrate
from loadtests.probe.command import add_probe_parser, run_probe_command
from loadtests.sim.profile import DEFAULT_PROFILE, ProfileError, builtin_profiles, load_profile
from loadtests.sim.settings import SimSettings, scheduler_config


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's own flag names, so a command line moves between the two unchanged."""
    p.add_argument(
        "--profile",
        default=DEFAULT_PROFILE,
        help=f"cost profile: a YAML file or one of {builtin_profiles()}",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="token budget per step (default: the profile's)",
    )
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--long-prefill-token-threshold", type=int, default=0)
    p.add_argument("--scheduling-policy", choices=["fcfs", "priority"], default="fcfs")
    p.add_argument("--block-size", type=int, default=None)
    p.add_argument(
        "--num-gpu-blocks-override",
        type=int,
        default=None,
        help="KV-cache capacity in blocks (default: the profile's)",
    )
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)


def _sim_settings(args: argparse.Namespace) -> SimSettings:
    profile = load_profile(args.profile)
    config = scheduler_config(
        profile,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        scheduling_policy=args.scheduling_policy,
        block_size=args.block_size,
        num_gpu_blocks=args.num_gpu_blocks_override,
        enable_prefix_caching=args.enable_prefix_caching,
    )
    return SimSettings(
        profile=profile,
        scheduler=config,
        served_model_name=args.served_model_name or profile.model,
        host=args.host,
        port=args.port,
        time_scale=args.time_scale,
    )


def _build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="whoseturn", description=__doc__)
    parser.add_argument("--log-level", default="info")
    commands = parser.add_subparsers(dest="command", required=True)

    sim = commands.add_parser("sim", help="run the simulated vLLM-compatible engine")
    sim_commands = sim.add_subparsers(dest="sim_command")
    _add_engine_flags(sim)
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=int, default=8000)
    sim.add_argument(
        "--served-model-name",
        default=None,
        help="model name clients use (default: the profile's model)",
    )
    sim.add_argument(
        "--time-scale",
        type=float,
        default=1.0,
        help="run model time this many times faster than wall time",
    )

    serve = commands.add_parser("serve", help="run the proxy in front of engines")
    serve.add_argument(
        "--engine",
        action="append",
        default=None,
        metavar="URL",
        help="an engine's base URL (repeat for several)",
    )
    serve.add_argument("--config", default=None, help="YAML settings file")
    serve.add_argument("--host", default=None)
    serve.add_argument("--port", type=int, default=None)
    serve.add_argument(
        "--ttft-target",
        type=float,
        default=None,
        dest="ttft_target_s",
        help="interactive TTFT target in seconds (default 0.3)",
    )
    serve.add_argument(
        "--gap-target",
        type=float,
        default=None,
        dest="gap_target_s",
        help="interactive inter-token gap target in seconds (default 0.1)",
    )

    turn = commands.add_parser("turn", help="print whose turn it is, one sentence per engine")
    turn.add_argument("--proxy", default="http://127.0.0.1:8080", help="the proxy's base URL")
    add_probe_parser(commands)

    inter = sim_commands.add_parser(
        "interference",
        help="print the chat-behind-batch interference table, in virtual time",
    )
    _add_engine_flags(inter)
    evaluate = sim_commands.add_parser(
        "evaluate",
        help="chat beside a batch job: direct vs through the proxy's scheduler, virtual time",
    )
    _add_engine_flags(evaluate)
    evaluate.add_argument("--duration", type=float, default=600.0, help="virtual seconds")
    evaluate.add_argument("--chat-rate", type=float, default=2.0, help="chat requests/s")
    evaluate.add_argument("--batch-concurrency", type=int, default=128)
    evaluate.add_argument("--seed", type=int, default=0)
    calibrate = sim_commands.add_parser(
        "calibrate", help="measure a real engine over HTTP and fit a simulator profile"
    )
    add_calibrate_arguments(calibrate)
    inter.add_argument("--batch-prompts", type=int, default=64)
    inter.add_argument("--batch-prompt-tokens", type=int, default=8000)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    # httpx logs every upstream call at info; keep those for debugging only.
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
    try:
        if args.command == "sim" and args.sim_command == "interference":
            from loadtests.sim.interference import run_interference

            return run_interference(_sim_settings_for_table(args), args)
        if args.command == "sim" and args.sim_command == "calibrate":
            return run_calibrate(args)
        if args.command == "sim" and args.sim_command == "evaluate":
            return _evaluate(_sim_settings_for_table(args), args)
        if args.command == "sim":
            from loadtests.sim.server import serve

            return serve(_sim_settings(args))
        if args.command == "serve":
            return _serve(args)
        if args.command == "turn":
            return _turn(args.proxy)
        if args.command == "probe":
            return run_probe_command(args)
    except (ProfileError, ValueError) as exc:
        print(f"whoseturn: error: {exc}", file=sys.stderr)
        return 2
    parser.error(f"unknown command {args.command!r}")
    return 2


def _turn(proxy: str) -> int:
    import httpx

    try:
        response = httpx.get(f"{proxy.rstrip('/')}/turn", params={"format": "text"}, timeout=5)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        print(f"whoseturn: cannot ask {proxy}: {exc}", file=sys.stderr)
        return 1
    print(response.text, end="")
    return 0


def _serve(args: argparse.Namespace) -> int:
    from proxy.config import load_settings
    from proxy.serve import serve

    overrides = {
        "engines": [{"url": u} for u in args.engine] if args.engine else None,
        "host": args.host,
        "port": args.port,
        "ttft_target_s": args.ttft_target_s,
        "gap_target_s": args.gap_target_s,
    }
    settings = load_settings(args.config, overrides)
    return serve(settings, args.log_level.lower())


def _evaluate(settings: SimSettings, args: argparse.Namespace) -> int:
    from loadtests.sim import twin

    workload = twin.MixedWorkload(
        duration_s=args.duration,
        chat_rate_per_s=args.chat_rate,
        batch_concurrency=args.batch_concurrency,
        seed=args.seed,
    )
    print(
        f"Profile `{settings.profile.name}`, virtual time, {workload.duration_s:.0f} s "
        f"(first {workload.warmup_s:.0f} s not counted): Poisson chat at "
        f"{workload.chat_rate_per_s}/s (prompts {workload.chat_prompt_tokens[0]}-"
        f"{workload.chat_prompt_tokens[1]} tokens, answers {workload.chat_answer_tokens[0]}-"
        f"{workload.chat_answer_tokens[1]}) beside a batch job keeping "
        f"{workload.batch_concurrency} documents of {workload.batch_doc_tokens:,} tokens "
        f"({workload.batch_answer_tokens} answer tokens) submitted.\n"
    )
    results = twin.evaluation_arms(
        workload, settings.scheduler, settings.profile.step, settings.served_model_name
    )
    print(twin.evaluation_table(results))
    print()
    print("\n".join(twin.verdict(results, ttft_target_s=0.3)))
    return 0


def _sim_settings_for_table(args: argparse.Namespace) -> SimSettings:
    args.served_model_name = None
    args.host, args.port, args.time_scale = "127.0.0.1", 0, 1.0
    return _sim_settings(args)
