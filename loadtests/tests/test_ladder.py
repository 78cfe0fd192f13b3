"""The degradation-ladder benchmark: its stand-in retriever over gRPC, its analysis on synthetic outcomes, and its
``--quick`` run end to end (two real platforms on simulated workers, ~1 min). The smoke run asserts that the report
files exist with the keys a reader needs — never timings or the ladder's effect: a benchmark reports numbers, it is
not a timed test."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import grpc
import pytest
from goodput.retriever.v1 import retriever_pb2, retriever_pb2_grpc

from goodput_testing import free_port

from loadtests import ladder
from loadtests.common import cpu_label
from loadtests.ladder import Outcome, Slo

SMOKE_PORT_OFFSET = 4200  # beside the benchmark's own 4100 (+40): a smoke test can run while the benchmark does
ARM_KEYS = {"n", "offered_rps", "served", "met", "share_within_slo", "goodput_tok_s", "goodput_tok_per_engine_s",
            "ttft", "tpot", "shed", "shed_share", "degraded_steps", "outcomes", "settled", "gateway_metrics"}


def test_stand_in_retriever_answers_top_k_chunks_and_reports_each_search() -> None:
    address = f"127.0.0.1:{free_port()}"
    stand_in = ladder.StandIn([("ladder", address, None)], ladder.RetrievalCost(base_s=0.001, per_chunk_s=0.0,
                                                                                 rerank_s=0.001, chunk_chars=120))
    stand_in.start()
    try:
        with grpc.insecure_channel(address) as channel:
            stub = retriever_pb2_grpc.RetrievalStub(channel)
            full = stub.Search(retriever_pb2.SearchRequest(tenant="t", knowledge_base="kb", query="refunds?",
                                                           top_k=4, rerank=True), timeout=10)
            half = stub.Search(retriever_pb2.SearchRequest(tenant="t", knowledge_base="kb", query="refunds?",
                                                           top_k=2), timeout=10)
        assert [len(h.text) for h in full.hits] == [120] * 4
        assert [h.text for h in half.hits] == [h.text for h in full.hits[:2]]  # the same query, the same chunks
        assert [t.leg for t in full.timings] == ["dense", "lexical", "rerank"]
        assert [t.leg for t in half.timings] == ["dense", "lexical"]
        searches = []
        for _ in range(50):  # the reports cross a process boundary
            searches += stand_in.drain()
            if len(searches) == 2:
                break
            time.sleep(0.05)
        assert sorted(searches) == [("ladder", 2, False), ("ladder", 4, True)]
    finally:
        stand_in.stop()


def test_a_request_meets_its_slo_only_when_served_within_ttft_and_tpot() -> None:
    slo = Slo(ttft_s=2.0, tpot_s=0.15)
    ok = Outcome(0.0, status=200, completed=True, ttft_s=1.0, e2e_s=3.0, completion_tokens=32)
    assert ok.met(slo) and ok.tpot_s == pytest.approx(2.0 / 31)
    assert not Outcome(0.0, status=200, completed=True, ttft_s=2.5, e2e_s=3.0, completion_tokens=32).met(slo)
    assert not Outcome(0.0, status=200, completed=True, ttft_s=1.0, e2e_s=9.0, completion_tokens=32).met(slo)
    assert not Outcome(0.0, status=200, completed=False, ttft_s=1.0, e2e_s=2.0, completion_tokens=32).met(slo)
    assert not Outcome(0.0, status=429, code="degraded_shed").met(slo)


def test_the_goals_compare_the_arms_at_two_times_capacity() -> None:
    slo = Slo(ttft_s=1.0, tpot_s=0.1)

    def run(met: int, shed: int) -> dict[str, Any]:
        outcomes = [Outcome(float(i), status=200, completed=True, ttft_s=0.5, e2e_s=1.0, completion_tokens=11,
                            degraded=("skip_rerank", "fewer_chunks")) for i in range(met)]
        outcomes += [Outcome(5.0 + i, status=429, code="degraded_shed") for i in range(shed)]
        return {**ladder.analyse_run(outcomes, slo=slo, duration_s=10.0),
                "settled": ladder.settled(outcomes, slo=slo, duration_s=10.0)}

    report = {"steps": [{"multiple": 1.0, "arms": {"ladder": run(2, 0), "no_ladder": run(2, 0)}},
                        {"multiple": 2.0, "arms": {"ladder": run(6, 4), "no_ladder": run(3, 0)}}]}
    assert (ladder.focus(report) or {}).get("multiple") == 2.0
    share, goodput = ladder.BENCHMARK.evaluate(report)
    assert share["ratio"] == pytest.approx(0.6 / 1.0) and share["threshold"] == 1.5 and share["met"] is False
    assert goodput["ratio"] == pytest.approx(2.0) and goodput["met"] is True
    assert report["steps"][1]["arms"]["ladder"]["degraded_steps"] == {"skip_rerank": 6, "fewer_chunks": 6}
    assert report["steps"][1]["arms"]["ladder"]["shed"] == 4
    # a report is held to the goal its run recorded
    strict = {**report, "setup": {"goal": {"ratio": 2.5, "multiple": 1.0}}}
    assert [(g["threshold"], g["met"]) for g in ladder.BENCHMARK.evaluate(strict)] == [(2.5, False), (2.5, False)]


@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    out = tmp_path_factory.mktemp("ladder") / "ladder"
    rc = ladder.main(["--quick", "--no-progress", "--out", str(out), "--port-offset", str(SMOKE_PORT_OFFSET)])
    assert rc == 0
    return json.loads(out.with_suffix(".json").read_text(encoding="utf-8")), out


@pytest.mark.integration
def test_smoke_run_writes_the_report_files_with_every_step_and_arm(smoke: tuple[dict[str, Any], Path]) -> None:
    report, out = smoke
    for suffix in (".json", ".md", ".png"):
        assert out.with_suffix(suffix).exists(), suffix
    assert report["benchmark"] == "ladder" and report["machine"]["cpu_model"]
    assert set(report["setup"]["slo"]) == {"ttft_s", "tpot_s"} and report["setup"]["retriever"]["stand_in"]
    assert report["capacity"]["rps"] > 0 and report["capacity"]["ramp"]
    assert [s["multiple"] for s in report["steps"]] == [1.0, 2.0]
    for step in report["steps"]:
        assert set(step["arms"]) == set(ladder.ARMS)
        for arm in step["arms"].values():
            assert ARM_KEYS <= set(arm), ARM_KEYS - set(arm)
            assert {"p50_ms", "p95_ms"} <= set(arm["ttft"])
    assert all(g["met"] is not None for g in ladder.BENCHMARK.evaluate(report))  # the goals' fields are there


@pytest.mark.integration
def test_smoke_report_names_the_cpu_the_stand_in_and_the_ratio(smoke: tuple[dict[str, Any], Path]) -> None:
    report, out = smoke
    markdown = out.with_suffix(".md").read_text(encoding="utf-8")
    assert cpu_label(report["machine"]) in markdown
    assert "## Goals" in markdown and "ratio" in markdown and "stand-in" in markdown
    # --render re-renders the same report from its JSON
    assert ladder.main(["--render", str(out.with_suffix(".json"))]) == 0
    assert out.with_suffix(".md").read_text(encoding="utf-8") == markdown
