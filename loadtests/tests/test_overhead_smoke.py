"""The overhead benchmark's smoke run on a platform of its own (the simulated engine), with two gateway replicas:
both paths through the gateway answer, the requests spread over both replicas, the report carries the
platform's CPU per request, a setting given with ``--set`` reaches the platform and is named in the report, and the
gRPC paths' streams go over as many connections as ``--grpc-channels`` says."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtests import overhead

# no other test or benchmark uses it (tests: 1000, 2300-3900, 4400, 4600; loadtests: 300, 3000-3450, 4100-4260)
PORT_OFFSET = 4300


@pytest.mark.integration
def test_smoke_run_with_two_gateway_replicas(tmp_path: Path) -> None:
    out = tmp_path / "overhead"
    assert overhead.main(["--start", "--engine", "sim", "--smoke", "--gateways", "2", "--port-offset",
                          str(PORT_OFFSET), "--out", str(out),
                          "--set", "GOODPUT_GATEWAY_SPECULATIVE_START=true", "--grpc-channels", "3"]) == 0
    report = json.loads(out.with_suffix(".json").read_text(encoding="utf-8"))
    assert report["config"]["gateways"] == 2 and report["config"]["grpc_channels"] == 3
    assert report["config"]["settings"]["GOODPUT_GATEWAY_SPECULATIVE_START"] == "true"
    for level in report["levels"]:
        assert all(p["errors"] == 0 and p["ok"] > 0 for p in level["paths"].values()), level["paths"]
        served = level["paths"]["gateway_grpc"]["ok"] + level["paths"]["gateway_rest"]["ok"]
        spread = level["gateway_requests_by_replica"]
        assert len(spread) == 2 and sum(spread) == served and min(spread) > 0  # round robin reached both
        cpu = level["cpu_per_request"]
        assert set(cpu) == {"gateway", "scheduler"} and cpu["gateway"]["requests"] == served
        assert cpu["gateway"]["ms_per_request"] > 0
        assert sum(level["speculative_starts"].values()) > 0  # the setting held
    md = out.with_suffix(".md").read_text(encoding="utf-8")
    assert "2 gateway replicas" in md and "## CPU per request" in md and "Gateway requests per replica" in md
    assert "settings changed: " in md and "GOODPUT_GATEWAY_SPECULATIVE_START=true" in md
    assert "3 HTTP/2 connections each" in md
