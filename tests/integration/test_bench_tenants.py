"""The tenants benchmark's quick path end to end: a simulated engine and a real proxy
process per arm, three arms, two runs each, the table printed and written into the
doc, every ratio against the ``alone`` arm of the same invocation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from loadtests.bench import tenants

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def test_the_quick_bench_runs_three_arms_and_sets_each_against_alone(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("WHOSETURN_FAIR_SHARE", raising=False)
    doc = tmp_path / "tenants.md"
    doc.write_text("# Tenants\n\nKept above the results.\n")
    out = tmp_path / "out"
    assert tenants.main(["--quick", "--out", str(out), "--doc", str(doc)]) == 0

    result = json.loads((out / "results.json").read_text())
    arms = result["arms"]
    assert list(arms) == ["alone", "arrival", "fair"]
    for arm, runs in arms.items():
        assert list(runs) == ["cold", "warm"]
        for figures in runs.values():
            assert figures["quiet_requests"] >= 4 and figures["quiet_failed"] == 0
            assert 0 < figures["ttft_p50_s"] <= figures["ttft_p95_s"]
            noisy = figures["noisy_tokens_per_s"]
            assert noisy is None if arm == "alone" else noisy > 0
    ratios = result["ratios_to_alone"]
    for arm, runs in arms.items():
        for run, figures in runs.items():
            alone = arms["alone"][run]
            assert ratios[arm][run]["p50"] == pytest.approx(
                figures["ttft_p50_s"] / alone["ttft_p50_s"]
            )
            assert ratios[arm][run]["p95"] == pytest.approx(
                figures["ttft_p95_s"] / alone["ttft_p95_s"]
            )
    assert ratios["alone"] == {r: {"p50": 1.0, "p95": 1.0} for r in ("cold", "warm")}

    # no tenant config in any arm, yet the proxy told the two keys apart; only the
    # arrival arm turns fair share off
    quiet, noisy = result["tenants"]["quiet"], result["tenants"]["noisy"]
    assert set(result["tenants_seen"]["alone"]) == {quiet}
    assert set(result["tenants_seen"]["arrival"]) == set(result["tenants_seen"]["fair"])
    assert set(result["tenants_seen"]["fair"]) == {quiet, noisy}
    configs = {a: yaml.safe_load((out / f"{a}-proxy.yaml").read_text()) for a in arms}
    assert all("api_keys" not in c for c in configs.values())
    assert configs["arrival"]["fair_share"] is False
    assert "fair_share" not in configs["alone"] and "fair_share" not in configs["fair"]

    printed = capsys.readouterr().out
    table = [line for line in printed.splitlines() if line.startswith("|")]
    rows = [line for line in table if line.startswith("| ")]
    assert [line.split(" | ")[0] for line in rows] == ["| arm", "| alone", "| arrival", "| fair"]
    assert rows[1].count("| 1.00x / 1.00x |") == 2  # cold and warm
    written = doc.read_text()
    assert written.startswith("# Tenants\n\nKept above the results.\n")
    assert tenants.BEGIN in written and tenants.END in written
    assert "### Results (" in written and "python -m loadtests.bench.tenants --quick" in written
    assert " cores, Python 3." in written
    assert "\n".join(table) in written
