"""The fleet benchmark's pure parts: its workloads are the same for the same seed and
share a prefix only where they mean to, the fleet's hit rate comes from two scrapes
of every engine, the table gives ratios to round robin, and each arm's command line
or configuration asks for what that arm needs and no more."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest

from loadtests.bench.fleet import Plan, parse_args, run_arm
from loadtests.bench.fleet_arms import (
    Engine,
    EngineSpec,
    fleet_router_command,
    sim_command,
    unavailable,
    whoseturn_config,
)
from loadtests.bench.fleet_figures import (
    BEGIN,
    END,
    CacheCounts,
    Figures,
    Outcome,
    Phase,
    Row,
    cache_counts,
    figures,
    fleet_delta,
    table,
    with_results,
)
from loadtests.bench.fleet_workloads import QUESTIONS, WORKLOADS, make

# -- workloads ---------------------------------------------------------------------


@pytest.mark.parametrize("name", WORKLOADS)
def test_a_workload_is_the_same_for_the_same_seed(name: str) -> None:
    assert make(name, 4, 20, seed=7) == make(name, 4, 20, seed=7)
    assert make(name, 4, 20, seed=7) != make(name, 4, 20, seed=8)


@pytest.mark.parametrize("name", WORKLOADS)
def test_load_grows_with_the_fleet(name: str) -> None:
    small, large = make(name, 4, 20, seed=1), make(name, 16, 20, seed=1)
    assert 3 <= large.chat_requests / small.chat_requests <= 5
    assert len(large.lines) == 4 * len(small.lines)


def test_conversation_turns_resend_the_growing_history() -> None:
    chat = make("conversations", 4, 20, seed=1).chats[0]
    last = len(chat.turns) - 1
    history = chat.messages(last)
    assert len(history) == 2 * last + 1
    reply = {"role": "assistant", "content": chat.replies[last - 1]}
    assert history[:-1] == [*chat.messages(last - 1), reply]
    assert history[-1] == {"role": "user", "content": chat.turns[last]}


def test_chats_share_no_first_block_unless_meant_to() -> None:
    chats = make("conversations", 4, 20, seed=1).chats
    # the id opens every chat's first message: its first 16-token block is its own
    openings = {c.turns[0].split(":")[0] for c in chats}
    assert len(openings) == len(chats)
    asked = make("system-prompt", 4, 20, seed=1).chats
    assert len({c.system for c in asked}) == 1 and len(asked[0].system) > 4000
    assert len({c.turns[0] for c in asked}) == len(asked)


def test_document_lines_ask_each_document_every_question_in_a_row() -> None:
    lines = make("documents", 4, 20, seed=1).lines
    assert len(lines) % len(QUESTIONS) == 0
    first = lines[: len(QUESTIONS)]
    document = first[0].content[: -len(QUESTIONS[0])]
    assert [x.content for x in first] == [document + q for q in QUESTIONS]
    assert not lines[len(QUESTIONS)].content.startswith(document)
    assert len({x.custom_id for x in lines}) == len(lines)


def test_an_unknown_workload_is_refused() -> None:
    with pytest.raises(ValueError, match="known: conversations"):
        make("chat", 4, 20, seed=1)


# -- figures -----------------------------------------------------------------------


def exposition(hits: float, queries: float) -> str:
    """An engine's /metrics as the simulator (and vLLM) write the two counters."""
    return (
        "# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.\n"
        "# TYPE vllm:prefix_cache_queries_total counter\n"
        f'vllm:prefix_cache_queries_total{{engine="0",model_name="tiny"}} {queries}\n'
        "# HELP vllm:prefix_cache_queries_created Prompt tokens looked up.\n"
        "# TYPE vllm:prefix_cache_queries_created gauge\n"
        'vllm:prefix_cache_queries_created{engine="0",model_name="tiny"} 1.79e+09\n'
        "# HELP vllm:prefix_cache_hits_total Prompt tokens found in the prefix cache.\n"
        "# TYPE vllm:prefix_cache_hits_total counter\n"
        f'vllm:prefix_cache_hits_total{{engine="0",model_name="tiny"}} {hits}\n'
    )


def test_the_fleet_hit_rate_is_summed_over_engines_between_two_scrapes() -> None:
    before = [cache_counts(exposition(100, 1000)), cache_counts(exposition(0, 0))]
    after = [cache_counts(exposition(400, 2000)), cache_counts(exposition(100, 3000))]
    delta = fleet_delta(before, after)
    assert delta == CacheCounts(hits=400, queries=4000)
    # not the mean of the engines' rates (30% and 3.3%), nor the totals since start
    assert delta.hit_rate == pytest.approx(0.10)


def test_no_lookups_is_no_hit_rate() -> None:
    assert CacheCounts().hit_rate is None
    with pytest.raises(ValueError):
        fleet_delta([CacheCounts()], [])


BASE = Outcome(
    ttfts_s=(0.1, 0.2, 0.3, 0.4),
    chat_requests=4,
    chat_failed=0,
    prompt_tokens=1000,
    makespan_s=10.0,
)


def outcome(**changes: Any) -> Outcome:
    return dataclasses.replace(BASE, **changes)


def test_figures_pool_phases() -> None:
    one = Phase(CacheCounts(600, 1000), outcome(lines=8, valid_lines=8, batch_s=10.0), 1.0)
    two = Phase(CacheCounts(900, 1000), outcome(lines=8, valid_lines=6, batch_s=20.0), 0.5)
    f = figures([one, two])
    assert f.hit_rate == pytest.approx(0.75)
    assert f.prefilled == pytest.approx(500 / 2000)
    assert (f.ttft_p50_s, f.ttft_p95_s) == (0.2, 0.4)
    assert f.valid_per_hour == pytest.approx(14 * 3600 / 30)
    assert f.cpu_cores == pytest.approx(0.75)
    assert f.failed == 2 and f.runs == 2


def test_prefilled_counts_what_the_engines_computed_against_what_was_asked() -> None:
    # pieces of one prompt: the counters see hits that saved nothing
    pieced = figures([Phase(CacheCounts(512, 1312), outcome(prompt_tokens=800))])
    assert pieced.hit_rate == pytest.approx(512 / 1312)
    assert pieced.prefilled == pytest.approx(1.0)


def test_a_phase_without_chats_has_no_ttft() -> None:
    f = figures([Phase(CacheCounts(), outcome(ttfts_s=(), prompt_tokens=0))])
    assert (f.ttft_p50_s, f.hit_rate, f.prefilled, f.valid_per_hour) == (None, None, None, None)


def fig(hit: float, p50: float, makespan: float) -> Figures:
    return Figures(hit, 1 - hit, p50, 2 * p50, 3600.0, makespan, 0.5, 0)


def test_the_table_gives_ratios_to_round_robin_in_the_same_phase() -> None:
    rows = [
        Row("round-robin", fig(0.2, 0.100, 20.0), fig(0.5, 0.050, 20.0)),
        Row("whoseturn", fig(0.6, 0.050, 10.0), fig(0.8, 0.025, 10.0)),
        Row("kv-aware", note="skipped: no venv"),
    ]
    text = table(rows, batch=True, warm=True)
    head, rule, rr, wt, kv = text.splitlines()
    assert "| warm hit rate |" in head and "valid records/h" in head
    assert rule.count("---") == head.count("|") - 1
    cells = [c.strip() for c in wt.split("|")[1:-1]]
    assert cells[:6] == [
        "whoseturn",
        "60.0% (3.00x)",
        "0.40 (0.50x)",
        "50 / 100 (0.50x / 0.50x)",
        "3,600 (1.00x)",
        "10.0 (0.50x)",
    ]
    assert cells[6] == "80.0% (1.60x)"  # warm against round robin's warm
    assert "20.0% (1.00x)" in rr
    assert "skipped: no venv" in kv and kv.count("|") == head.count("|")


def test_the_table_leaves_out_what_the_workload_has_not() -> None:
    text = table([Row("round-robin", fig(0.2, 0.1, 20.0))], batch=False, warm=False)
    assert "records/h" not in text and "warm" not in text


def test_results_replace_only_their_section() -> None:
    doc = f"# Fleet\n\nprose\n\n{BEGIN}\nold table\n{END}\n\nmore prose\n"
    new = with_results(doc, "new table")
    assert new == f"# Fleet\n\nprose\n\n{BEGIN}\nnew table\n{END}\n\nmore prose\n"
    assert with_results("# Fleet\n", "t") == f"# Fleet\n\n{BEGIN}\nt\n{END}\n"


# -- arms --------------------------------------------------------------------------

ENGINES = [
    Engine(
        f"http://127.0.0.1:{8000 + i}",
        100 + i,
        f"tcp://127.0.0.1:{5550 + i}",
        f"tcp://127.0.0.1:{5560 + i}",
    )
    for i in range(3)
]


def test_whoseturn_arms_write_only_the_keys_they_need(tmp_path: Path) -> None:
    store = tmp_path / "batch.db"
    engines, settings = whoseturn_config("least-load", ENGINES, batch_store=store, batch_window=6)
    assert settings == {"batch_store_path": str(store), "batch_window": 6, "route_by": "load"}
    assert engines[0] == {"name": "e0", "url": "http://127.0.0.1:8000"}
    engines, settings = whoseturn_config("whoseturn", ENGINES, batch_store=store, batch_window=6)
    assert "route_by" not in settings
    assert engines[2] == {
        "name": "e2",
        "url": "http://127.0.0.1:8002",
        "kv_events": "tcp://127.0.0.1:5552",
        "kv_events_replay": "tcp://127.0.0.1:5562",
    }


def test_the_router_gets_every_engine_and_kv_aware_their_events() -> None:
    spec = EngineSpec(block_size=16, model="tiny")
    plain = fleet_router_command(Path("vllm-router"), ENGINES, "cache_aware", 9000, spec)
    at = plain.index("--worker-urls")
    assert plain[at + 1 : at + 4] == [e.url for e in ENGINES]
    assert plain[plain.index("--policy") + 1] == "cache_aware"
    assert "--kv-event-source" not in plain
    kv = fleet_router_command(Path("vllm-router"), ENGINES, "kv_aware", 9000, spec)
    sources = [kv[i + 1] for i, x in enumerate(kv) if x == "--kv-event-source"]
    assert sources == [f"{e.url}={e.events}" for e in ENGINES]
    assert kv[kv.index("--kv-event-block-size") + 1] == "16"
    assert kv[kv.index("--kv-event-model") + 1] == "tiny"


def test_engines_bind_their_event_socket_where_subscribers_can_connect() -> None:
    command = sim_command(EngineSpec(blocks=256, block_size=16), 8000, 5550, 5560)
    config = command[command.index("--kv-events-config") + 1]
    # a loopback address would make the engine's PUB socket connect (vLLM's rule)
    assert '"endpoint": "tcp://*:5550"' in config
    assert '"replay_endpoint": "tcp://127.0.0.1:5560"' in config
    assert command[command.index("--max-model-len") + 1] == "4096"


def test_an_unknown_arm_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--arms", "round-robin,kv_aware"])
    assert "known: round-robin" in capsys.readouterr().err
    plan, _ = parse_args(["--engines", "4", "--arms", "whoseturn,round-robin", "--repeat", "1"])
    assert (plan.engines, plan.arms, plan.repeat) == ((4,), ("whoseturn", "round-robin"), 1)


def test_a_router_arm_without_its_venv_is_skipped_before_any_engine_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = Plan(router_venv=tmp_path / "no-venv")
    workload = make("documents", 4, 20, seed=1)
    row = run_arm(plan, 4, workload, "kv-aware", tmp_path / "logs")
    assert row.cold is None and row.note.startswith("skipped: ")
    assert "kv-aware: skipped" in capsys.readouterr().err
    assert not (tmp_path / "logs").exists()  # no fleet was started for it
    assert unavailable("whoseturn", tmp_path / "no-venv") is None


def test_a_shorter_run_sends_less() -> None:
    for name in WORKLOADS:
        full, half = make(name, 4, 20, seed=1), make(name, 4, 10, seed=1)
        assert 0.3 <= half.chat_requests / full.chat_requests <= 0.7
    assert len(make("documents", 4, 10, seed=1).lines) * 2 == len(
        make("documents", 4, 20, seed=1).lines
    )
