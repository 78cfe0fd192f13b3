"""`goodput status` as a newcomer meets it: every service of the platform is checked, and the tables fit an
80-column terminal."""

from __future__ import annotations

import json
import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from rich.console import Console
from typer.testing import CliRunner

from goodput_testing import dead_port

from goodput_cli.main import app
from goodput_cli.status import StatusReport, WorkerRow, collect, render
from goodput_cli.supervisor import Platform

runner = CliRunner()


def test_every_service_of_the_platform_is_checked(tmp_path: Path) -> None:
    endpoints = Platform(workdir=tmp_path, port_offset=20000).endpoints()  # nothing listens there
    assert set(endpoints) == {"gateway_http", "gateway_metrics", "gateway", "scheduler", "embedder", "retriever",
                              "cache", "index-worker", "jobs-worker"}
    names = [s.name for s in collect(endpoints, timeout_s=0.2).services]
    assert names == ["gateway", "gateway (HTTP)", "gateway (metrics)", "scheduler", "embedder", "retriever", "cache",
                     "index-worker", "jobs-worker"]


def test_a_serving_service_and_a_celery_worker_show_healthy_beside_those_that_are_down(tmp_path: Path) -> None:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    servicer = health.HealthServicer()
    servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    cache_port = server.add_insecure_port("127.0.0.1:0")
    server.start()

    class Metrics(BaseHTTPRequestHandler):  # what a Celery worker's metrics port answers on every path
        def do_GET(self) -> None:  # noqa: N802
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"# metrics\n")

        def log_message(self, *args: object) -> None:
            pass

    http = ThreadingHTTPServer(("127.0.0.1", 0), Metrics)
    threading.Thread(target=http.serve_forever, daemon=True).start()
    try:
        endpoints = {"cache": f"127.0.0.1:{cache_port}", "index-worker": f"http://127.0.0.1:{http.server_port}",
                     "embedder": f"127.0.0.1:{dead_port()}"}
        report = collect(endpoints, timeout_s=1)
    finally:
        server.stop(None)
        http.shutdown()
    by_name = {s.name: s for s in report.services}
    assert by_name["cache"].ok and by_name["cache"].detail == "serving"
    assert by_name["index-worker"].ok
    assert not by_name["embedder"].ok and report.problems == ["embedder is down (not reachable)"]


def test_the_worker_table_fits_80_columns_and_errors_go_below_it() -> None:
    report = StatusReport(workers=[
        WorkerRow("worker-0", "127.0.0.1:50061", True, "serving", 12, 3, 0.42, 15, ""),
        WorkerRow("worker-1", "127.0.0.1:50062", False, "down (not reachable)", 0, 0, 0.0, 0,
                  "StatusCode.UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: "
                  "ipv4:127.0.0.1:50062: Failed to connect to remote host: Connection refused"),
    ])
    console = Console(width=80, record=True, color_system=None)
    render(report, console)
    lines = console.export_text().splitlines()
    assert max(len(line) for line in lines) <= 80
    row = next(line for line in lines if line.lstrip().startswith("worker-1 "))
    assert "127.0.0.1:50062" in row and "unhealthy (down)" in row
    assert any(line.startswith("worker-1: last error: StatusCode.UNAVAILABLE") for line in lines)
    assert "42%" in next(line for line in lines if line.lstrip().startswith("worker-0 "))


def test_a_draining_worker_is_shown_as_such_and_is_no_problem() -> None:
    report = StatusReport(workers=[WorkerRow("worker-0", "127.0.0.1:50061", False, "serving", 2, 0, 0.1, 2, "",
                                             draining=True)])
    console = Console(width=80, record=True, color_system=None)
    render(report, console)
    assert "draining" in next(line for line in console.export_text().splitlines()
                              if line.lstrip().startswith("worker-0 "))
    assert report.problems == []


def test_status_reads_the_endpoints_of_the_running_platform_from_its_state_folder(tmp_path: Path) -> None:
    cache = f"127.0.0.1:{dead_port()}"
    (tmp_path / "up.json").write_text(json.dumps({"endpoints": {"cache": cache}}))

    result = runner.invoke(app, ["status", "--state-dir", str(tmp_path), "--timeout", "0.5"])

    assert result.exit_code == 1 and "Traceback" not in result.output
    assert cache in result.output and "error: cache is down" in result.output
    assert "gateway" not in result.output  # not part of that platform
