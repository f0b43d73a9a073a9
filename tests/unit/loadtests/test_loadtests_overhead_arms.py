"""The overhead benchmark's arms: ``--arms`` names only known arms, the
``vllm-router`` arm is skipped with a message when its venv is not built, and its
log's warnings are read without colour codes."""

from __future__ import annotations

import argparse
from contextlib import ExitStack
from pathlib import Path

import pytest

from loadtests.bench.overhead import ARMS, Plan, _router_arm, parse_arms, single_table
from loadtests.bench.overhead_router import router_binary, router_command, router_warnings


def test_arms_keep_the_order_given() -> None:
    assert parse_arms("direct, vllm-router,nginx") == ("direct", "vllm-router", "nginx")


def test_the_default_arms_include_the_router() -> None:
    assert "vllm-router" in ARMS and Plan().arms == ARMS


@pytest.mark.parametrize("text", ["direct,vllm_router", "", "nginx,sglang"])
def test_an_unknown_or_missing_arm_is_refused(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="known: direct"):
        parse_arms(text)


def test_router_arm_is_skipped_without_its_venv(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = Plan(router_venv=tmp_path / "no-venv")
    with ExitStack() as stack:
        assert _router_arm(stack, plan, upstream=1, root=tmp_path) == []
    assert "vllm-router: skipped" in capsys.readouterr().err
    assert router_binary(tmp_path) is None


def test_router_limit_is_never_below_the_largest_level() -> None:
    command = router_command(Path("vllm-router"), "http://127.0.0.1:1", 2, 3, 100_000)
    assert command[command.index("--max-concurrent-requests") + 1] == "100000"
    assert command[command.index("--prometheus-port") + 1] == "3"


def test_router_warnings_are_plain_text(tmp_path: Path) -> None:
    log = tmp_path / "vllm-router.log"
    log.write_text(
        "DEBUG: Server startup function called\n"
        "\x1b[2m2026-12-02 00:41:42\x1b[0m \x1b[32m INFO\x1b[0m ready\n"
        "\x1b[2m2026-12-02 00:41:43\x1b[0m \x1b[33m WARN\x1b[0m worker slow\n"
        "2026-12-02 00:41:50  WARN middleware: queue processor shutting down\n"
    )
    assert router_warnings(log) == ["2026-12-02 00:41:43  WARN worker slow"]


def test_the_one_token_table_puts_the_first_burst_beside_the_others() -> None:
    plan = Plan(one_token=1000, one_token_rounds=3)
    burst = {"errors": 0.0, "ttft_p50": 0.5}
    single = {
        "whoseturn": [
            {**burst, "cpu_s": 2.0},
            {**burst, "cpu_s": 1.0, "ttft_p50": 0.25},
            {**burst, "cpu_s": 0.5, "errors": 2.0},
        ]
    }
    table = single_table(plan, single)
    assert "3 bursts back to back" in table
    # 1,000 / 2.0 s cold; 2,000 requests / 1.5 s again
    assert "| whoseturn | 500 / 1,333 | 2.00 / 0.75 | 500.0 / 250.0 500.0 | 2 |" in table
