"""The garbage collector of a service's process (goodput_core.server.tune_gc): once serving, start-up's objects are
frozen out of the collector's walks; a test's in-process service leaves the test's collector alone."""

from __future__ import annotations

import gc
import json
import os
import subprocess
import sys

from prometheus_client import CollectorRegistry

from goodput_core.server import ServiceRunner
from goodput_core.settings import ServiceSettings

_SERVICE = """
import asyncio, gc, json
from prometheus_client import CollectorRegistry
from goodput_core.server import ServiceRunner, run_main
from goodput_core.settings import load_settings, ServiceSettings

async def main():
    before = gc.get_freeze_count()
    settings = load_settings(ServiceSettings)
    runner = ServiceRunner(name="probe", settings=settings, registry=CollectorRegistry(), provider=None)
    await runner.start()
    print(json.dumps({"frozen_before": before, "frozen": gc.get_freeze_count(), "threshold": gc.get_threshold(),
                      "enabled": gc.isenabled()}))
    await runner.stop()

run_main(main)
"""


_STARTING_SERVICE = """
import asyncio, gc, json
from prometheus_client import CollectorRegistry
from goodput_core.server import ServiceRunner, run_main
from goodput_core.settings import load_settings, ServiceSettings

async def main():
    runner = ServiceRunner(name="probe", settings=load_settings(ServiceSettings), registry=CollectorRegistry(),
                           provider=None)
    seen = {}

    async def started():  # a worker's engine loading: made after the server started, frozen all the same
        seen["while_starting"] = gc.get_freeze_count()
        seen["made"] = [[i] for i in range(20_000)]

    async def report():
        while not runner.ready:
            await asyncio.sleep(0.01)
        print(json.dumps({"while_starting": seen["while_starting"], "frozen": gc.get_freeze_count()}))
        runner.request_stop()

    task = asyncio.create_task(report())
    await runner.run(after_start=started)
    await task

run_main(main)
"""


def _serve(script: str = _SERVICE, **env: str) -> dict:
    environ = {k: v for k, v in os.environ.items() if not k.startswith("GOODPUT_GC_")}
    environ |= {"GOODPUT_INSECURE_INTERNAL": "true", "GOODPUT_DRAIN_GRACE_S": "0", **env}
    out = subprocess.run([sys.executable, "-c", script], env=environ, capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_serving_process_freezes_start_up() -> None:
    got = _serve()
    assert got["frozen_before"] == 0
    assert got["frozen"] > 10_000  # the modules, the server and its clients: out of every collection's walk
    assert got["enabled"]


def test_a_service_that_finishes_starting_later_is_frozen_once_it_serves() -> None:
    """run(after_start=...): nothing is frozen while the start runs; what it made is frozen once it is done."""
    got = _serve(_STARTING_SERVICE)
    assert got["while_starting"] == 0
    assert got["frozen"] > 20_000


async def test_an_in_process_service_leaves_the_callers_collector_alone() -> None:
    frozen, threshold = gc.get_freeze_count(), gc.get_threshold()
    runner = ServiceRunner(name="probe", settings=ServiceSettings(insecure_internal=True, drain_grace_s=0),
                           registry=CollectorRegistry(), provider=None)
    await runner.start()
    try:
        assert gc.get_freeze_count() == frozen and gc.get_threshold() == threshold
    finally:
        await runner.stop()
