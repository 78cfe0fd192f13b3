"""The noisy-neighbour benchmark: its refusal checks on synthetic outcomes, and its ``--smoke`` run end to end (a real
platform on simulated workers: 2 workers, a few seconds per phase, ~45 s). The smoke run asserts structure and the
correctness facts only — B is served, A is refused by its quota with the promised status, code and headers — never
timings: a benchmark reports numbers, it is not a timed test."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from loadtests import noisy_neighbour as nn
from loadtests.common import cpu_label
from loadtests.noisy_neighbour import Outcome

SMOKE_PORT_OFFSET = 3450  # beside the benchmark's own 3400: a smoke test can run while the benchmark does


def _refusal(message: str, headers: dict[str, str], *, code: str = "rate_limit_exceeded") -> Outcome:
    return Outcome(nn.NOISY, 0.0, status=429, code=code, message=message, headers=headers)


RPM_REFUSAL = _refusal("tenant 'tenant-a' is over its limit of 60 requests per minute",
                       {"retry-after": "47", "x-ratelimit-limit-requests": "60",
                        "x-ratelimit-remaining-requests": "0", "x-ratelimit-reset-requests": "46.6s"})


def test_a_refusal_is_checked_for_status_code_retry_after_and_rate_limit_headers() -> None:
    assert nn.refusal_problems(RPM_REFUSAL, 60) == []
    assert nn.refusal_problems(RPM_REFUSAL, 61) == ["x-ratelimit-limit-requests 60 != configured 61"]
    concurrent = _refusal("tenant 'tenant-a' already has 8 requests in flight (its max_concurrent); retry when one "
                          "finishes", {"retry-after": "1"})
    assert nn.refusal_kind(concurrent) == "max_concurrent"
    assert nn.refusal_problems(concurrent, 60) == ["x-ratelimit-*-requests missing"]
    shed = _refusal("tenant tenant-a's share of the P0 queue is full (10 of 20 places)",
                    {**RPM_REFUSAL.headers, "x-ratelimit-remaining-requests": "12"}, code="queue_full")
    assert nn.refusal_kind(shed) == "scheduler: tenant share"
    assert nn.refusal_problems(shed, 60) == []  # the scheduler's code, and the limits at admission
    wrong = _refusal("tenant 'tenant-a' is over its limit of 60 requests per minute",
                     {"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "-1",
                      "x-ratelimit-reset-requests": "soon"}, code="queue_full")
    assert nn.refusal_problems(wrong, 60) == [
        "code queue_full", "Retry-After missing or < 1 s", "x-ratelimit-remaining-requests -1 not within 0..60",
        "x-ratelimit-reset-requests 'soon' not a time within the minute"]


def test_flood_analysis_counts_admitted_refused_by_kind_and_checks() -> None:
    admitted = Outcome(nn.NOISY, 0.1, status=200, ttft_s=0.2, e2e_s=1.0, completed=True,
                       headers={"x-ratelimit-limit-requests": "60", "x-ratelimit-remaining-requests": "59",
                                "x-ratelimit-reset-requests": "60s"})
    concurrent = _refusal("tenant 'tenant-a' already has 8 requests in flight (its max_concurrent)",
                          {"retry-after": "1"})
    stats = nn.analyse_flood([admitted, RPM_REFUSAL, RPM_REFUSAL, concurrent], phase_s=2.0, rpm=60)
    assert (stats["n"], stats["admitted"], stats["completed"], stats["refused"]) == (4, 1, 1, 3)
    assert dict(stats["refused_by"]) == {"rpm": 2, "max_concurrent": 1}
    checks = stats["refusal_checks"]
    assert (checks["checked"], checks["ok"], checks["by_quota"]) == (3, 2, 3)
    assert checks["ok_by_kind"] == {"rpm": [2, 2], "max_concurrent": [0, 1]}
    assert stats["admitted_headers"] == {"checked": 1, "ok": 1, "problems": []}


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("noisy") / "noisy_neighbour"
    rc = nn.main(["--smoke", "--out", str(out), "--port-offset", str(SMOKE_PORT_OFFSET)])
    assert rc == 0
    return json.loads(out.with_suffix(".json").read_text(encoding="utf-8")), out


@pytest.mark.integration
def test_smoke_run_reports_every_phase_with_the_cpu_named(smoke: tuple[dict[str, Any], Path]) -> None:
    report, out = smoke
    for suffix in (".json", ".md", ".png"):
        assert out.with_suffix(suffix).exists(), suffix
    assert [f["workers"] for f in report["fleets"]] == [2]
    fleet = report["fleets"][0]
    assert list(fleet["phases"]) == ["alone", "without_quotas", "with_quotas[rpm]", nn.HOLDS_ALL]
    assert fleet["capacity"]["rps"] > 0 and fleet["limits"]["rpm"] >= 1
    markdown = out.with_suffix(".md").read_text(encoding="utf-8")
    assert cpu_label(report["machine"]) in markdown
    assert "## Goals" in markdown and "with_quotas[rpm]" in markdown
    # --render re-renders the same report from its JSON
    assert nn.main(["--render", str(out.with_suffix(".json"))]) == 0
    assert out.with_suffix(".md").read_text(encoding="utf-8") == markdown


@pytest.mark.integration
def test_smoke_run_serves_b_in_every_phase(smoke: tuple[dict[str, Any], Path]) -> None:
    report, _ = smoke
    for name, phase in report["fleets"][0]["phases"].items():
        quiet = phase["quiet"]
        assert quiet["n"] > 0 and quiet["ok"] == quiet["n"], (name, quiet["failures"])
        assert quiet["ttft"]["n"] == quiet["n"]


@pytest.mark.integration
def test_smoke_run_refuses_a_by_its_quota_with_the_promised_headers(smoke: tuple[dict[str, Any], Path]) -> None:
    report, _ = smoke
    fleet = report["fleets"][0]
    flood = fleet["phases"]["with_quotas[rpm]"]["noisy"]
    refused_by = dict(flood["refused_by"])
    assert refused_by.get("rpm", 0) > 0, refused_by
    checks = flood["refusal_checks"]
    # every refusal by the rpm quota: 429, rate_limit_exceeded, Retry-After, x-ratelimit-* = the configured limit
    assert checks["ok_by_kind"]["rpm"] == [refused_by["rpm"], refused_by["rpm"]], checks["problems"]
    assert flood["admitted"] > 0 and flood["admitted_headers"]["ok"] == flood["admitted_headers"]["checked"]
    assert fleet["phases"]["with_quotas[rpm]"]["quiet"]["admitted_headers"]["problems"] == []
    # without quotas nothing is refused by a quota (the scheduler's queue may refuse A)
    without = dict(fleet["phases"]["without_quotas"]["noisy"]["refused_by"])
    assert not set(without) & set(nn.QUOTA_KINDS), without


@pytest.mark.integration
def test_smoke_run_a_holding_every_slot_without_limits_finishes_all_it_was_admitted(
        smoke: tuple[dict[str, Any], Path]) -> None:
    report, _ = smoke
    flood = report["fleets"][0]["phases"][nn.HOLDS_ALL]["noisy"]
    assert flood["admitted"] > 0 and flood["completed"] == flood["admitted"], flood["other_failures"]
