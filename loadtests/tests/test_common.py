"""The helpers every benchmark's numbers go through: a wrong percentile or a broken report would mislead readers."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import pytest

from loadtests.bench import markdown
from loadtests.common import (
    bootstrap_diff_ci,
    cpu_label,
    cpu_seconds,
    machine_info,
    markdown_table,
    percentile,
    summarize,
    write_report,
)
from loadtests.overhead import BENCHMARK as OVERHEAD
from loadtests.overhead import GOODPUT_PATHS, Sample, analyse_level, schedule


def test_percentile_matches_numpy_linear_interpolation() -> None:
    np = pytest.importorskip("numpy")
    rng = random.Random(7)
    values = [rng.expovariate(10) for _ in range(257)]
    for q in (0, 1, 50, 95, 99, 100):
        assert percentile(values, q) == pytest.approx(float(np.percentile(values, q)))


def test_percentile_edges() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1, 2, 3, 4], 50) == 2.5
    with pytest.raises(ValueError):
        percentile([1.0], 101)


def test_summarize_reports_milliseconds_and_handles_no_values() -> None:
    s = summarize([0.001, 0.002, 0.003])
    assert s["n"] == 3
    assert s["p50_ms"] == pytest.approx(2.0)
    assert s["mean_ms"] == pytest.approx(2.0)
    assert set(s) == {"n", "mean_ms", "p50_ms", "p95_ms", "p99_ms"}
    empty = summarize([])
    assert empty["n"] == 0 and empty["p99_ms"] is None and empty["mean_ms"] is None


def test_bootstrap_interval_contains_a_real_shift_and_excludes_zero() -> None:
    pytest.importorskip("numpy")
    rng = random.Random(1)
    base = [rng.gauss(0.100, 0.005) for _ in range(200)]
    shifted = [x + 0.010 for x in base]
    lo, hi = bootstrap_diff_ci(shifted, base)  # type: ignore[misc]
    assert lo < 0.010 < hi
    assert lo > 0
    assert bootstrap_diff_ci([], base) is None


def test_markdown_table() -> None:
    table = markdown_table(["a", "b"], [[1, "x|y"]])
    assert table.splitlines() == ["| a | b |", "|---|---|", "| 1 | x\\|y |"]


def test_write_report_writes_both_files_with_a_timestamp(tmp_path) -> None:
    json_path, md_path = write_report(tmp_path / "sub" / "bench.v1", {"x": 1}, "# hi")
    assert json_path.name == "bench.v1.json" and md_path.name == "bench.v1.md"
    data = json.loads(json_path.read_text())
    assert data["x"] == 1 and "generated_at" in data
    assert md_path.read_text() == "# hi\n"


def test_machine_info_has_no_paths_or_host_names() -> None:
    info = machine_info()
    assert info["cores_usable"] >= 1
    text = json.dumps(info)
    assert "/" not in text.replace("/s", "")  # no file-system paths
    import socket
    assert socket.gethostname() not in text


def test_every_report_can_name_the_cpu_and_its_vector_path() -> None:
    """vLLM's CPU kernels differ between Intel AMX, AVX-512 and AVX2 machines: a report says which it ran on."""
    info = machine_info()
    assert info["cpu_isa"] in ("amx", "avx512", "avx2", "other") and info["cpu_vendor"]
    assert set(info["cpu_flags"]) == {"amx", "avx512", "avx512_bf16", "avx2"}
    label = cpu_label(info)
    assert label.startswith(info["cpu_model"]) and info["cpu_vendor"] in label
    assert cpu_label({"cpu_model": "AMD EPYC"}) == "AMD EPYC"  # an older report without the fields


def test_schedule_sends_every_prompt_once_per_path_in_shuffled_order() -> None:
    jobs = schedule(30, random.Random(0))
    assert len(jobs) == 90
    for i in range(30):
        triple = jobs[3 * i:3 * i + 3]
        assert sorted(p for p, _ in triple) == sorted(GOODPUT_PATHS)
        assert len({prompt for _, prompt in triple}) == 1
    firsts = {jobs[3 * i][0] for i in range(30)}
    assert len(firsts) > 1  # not always the same path first


def test_analyse_level_computes_overhead_and_verdict() -> None:
    samples = []
    for i in range(20):
        samples.append(Sample("direct", i, ttft_s=0.050 + i * 1e-4, itl_s=[0.020] * 5, e2e_s=0.2, deltas=6))
        samples.append(Sample("gateway_grpc", i, ttft_s=0.0515 + i * 1e-4, itl_s=[0.0201] * 5, e2e_s=0.2, deltas=6))
        samples.append(Sample("gateway_rest", i, ttft_s=0.060 + i * 1e-4, itl_s=[0.022] * 5, e2e_s=0.2, deltas=6))
    samples.append(Sample("gateway_rest", 0, error="HTTP 503: busy"))
    cpu = {"gateway": {"cpu_s": 0.4, "requests": 40, "ms_per_request": 10.0},
           "scheduler": {"cpu_s": 0.08, "requests": 40, "ms_per_request": 2.0},
           "litellm_proxy": {"cpu_s": 0.9, "requests": 20, "ms_per_request": 45.0}}
    level = analyse_level(8, samples, wall_s=1.0, stages={"schedule": 0.001}, load_before=(1.0, 1.0, 1.0), cpu=cpu)
    grpc_ttft = level["overhead"]["gateway_grpc"]["ttft"]
    assert grpc_ttft["p50_diff_ms"] == pytest.approx(1.5)
    assert grpc_ttft["pass"] is True  # within the 2 ms goal
    assert level["overhead"]["gateway_grpc"]["itl"]["pass"] is True  # 0.1 ms, within 0.2
    rest = level["overhead"]["gateway_rest"]
    assert rest["ttft"]["p50_diff_ms"] == pytest.approx(10.0) and rest["ttft"]["pass"] is False
    assert rest["itl"]["p50_diff_ms"] == pytest.approx(2.0) and rest["itl"]["pass"] is False
    assert rest["ttft"]["p50_ratio"] == pytest.approx(0.0610 / 0.0510, rel=1e-3)
    assert level["paths"]["gateway_rest"]["errors"] == 1
    assert level["paths"]["gateway_rest"]["error_examples"] == ["HTTP 503: busy"]
    assert level["gateway_stage_mean_ms"] == {"schedule": pytest.approx(1.0)}

    report = {"generated_at": "now", "config": {"max_tokens": 8, "priority": "P0", "timeout_s": 60},
              "levels": [level], "machine": machine_info(), "worker": {}, "engine_flags": "x", "platform": "y",
              "packages": {}}
    md = markdown(OVERHEAD, report)
    assert "**The goal is missed**" in md
    assert "**FAIL**" in md and "PASS" in md
    # CPU per request side by side: Goodput's gateway + scheduler (12 ms) against the proxy's 45 ms
    assert "| 8 | 10.00 | 2.00 | 45.00 | 12.00 | 3.8× |" in md


def test_cpu_seconds_counts_a_process_and_the_processes_below_it() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.3\n"
                              "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        before = cpu_seconds([os.getpid()])
        time.sleep(1.0)  # the child spends its 0.3 s of CPU meanwhile, counted under this process
        after = cpu_seconds([os.getpid()])
        assert before is not None and after is not None and after - before >= 0.2
    finally:
        child.kill()
        child.wait()
    assert cpu_seconds([2 ** 22 + 12345]) is None  # no such process


@pytest.mark.integration
async def test_the_floor_under_the_overhead_is_measured_on_a_scheduler_and_reported(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from loadtests.common import free_port_block
    from loadtests.overhead import Target, round_trips
    from loadtests.simfleet import SimFleet

    with SimFleet(workers=1, base_port=free_port_block(), sim={}, logdir=tmp_path) as fleet:
        fleet.start_scheduler({})
        await fleet.wait_ready()
        floor = await round_trips(Target(gateway_url="", gateway_grpc="", worker="", api_key="",
                                         scheduler=fleet.scheduler_addr))
    assert floor is not None
    for hop in (floor["lease"], floor["tcp"], *floor["first_event"].values()):  # back to back and after idle
        assert hop["busy_p50_ms"] > 0 and hop["idle_p50_ms"] > 0
    assert set(floor["first_event"]) == {"sse", "sse_aiohttp", "grpc"}  # both HTTP clients the benchmark may use
    level = analyse_level(1, [Sample(p, 0, ttft_s=0.05, itl_s=[0.02], e2e_s=0.1, deltas=2) for p in GOODPUT_PATHS],
                          wall_s=1.0, stages={"schedule": 0.0015}, load_before=None)
    for client in ("aiohttp", "httpx"):
        md = markdown(OVERHEAD, {"generated_at": "now", "levels": [level], "machine": machine_info(), "worker": {},
                                 "config": {"max_tokens": 8, "priority": "P0", "timeout_s": 60, "http_client": client},
                                 "engine_flags": "x", "platform": "y", "packages": {}, "round_trips": floor})
        assert "## The floor: round trips on this machine" in md and "lease on the scheduler's stream" in md
        assert "first SSE event" in md and "the same, aiohttp client" in md
        # the REST path's floor is the first event with the client that run used
        assert f"(uvicorn's h11 in the gateway, {client} in the client)" in md
    old = {k: v for k, v in floor.items() if k != "first_event"} | {
        "first_event": {k: v for k, v in floor["first_event"].items() if k != "sse_aiohttp"}}
    md = markdown(OVERHEAD, {"generated_at": "now", "levels": [level], "machine": machine_info(), "worker": {},
                             "config": {"max_tokens": 8, "priority": "P0", "timeout_s": 60},  # a report from before
                             "engine_flags": "x", "platform": "y", "packages": {}, "round_trips": old})
    assert "httpx in the client" in md and "the same, aiohttp client" not in md


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="placing processes on cores needs Linux and two usable cores")
def test_gateway_cores_place_a_process_tree_and_leave_the_rest_a_core() -> None:
    """--gateway-cores: a process and the children it started afterwards all land on the cores given (the
    supervisor's children are the platform), and a placement that leaves the others no core is refused."""
    from loadtests.overhead import place

    usable = sorted(os.sched_getaffinity(0))
    parent = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time; "
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(30)']); "
                               "time.sleep(30)"])
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    children = f"/proc/{parent.pid}/task/{parent.pid}/children"
    child = 0
    try:
        deadline = time.monotonic() + 10
        while not (listed := open(children, encoding="ascii").read().split()):  # noqa: SIM115
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        (child,) = (int(c) for c in listed)
        gateway, rest = place([parent.pid], [other.pid], {usable[-1]})
        assert gateway == {usable[-1]} and rest == set(usable[:-1])
        assert os.sched_getaffinity(parent.pid) == os.sched_getaffinity(child) == {usable[-1]}
        assert os.sched_getaffinity(other.pid) == set(usable[:-1])
        with pytest.raises(SystemExit, match="must leave a core"):
            place([parent.pid], [other.pid], set(usable))
    finally:
        if child:
            os.kill(child, 9)
        for p in (parent, other):
            p.kill()
            p.wait()
