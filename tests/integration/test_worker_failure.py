"""A worker killed mid-stream while serving several answers: each client's answer goes on on the other worker from the
tokens already sent, the same text at temperature 0 as an uninterrupted answer, with no error (a worker lost holding
one request alone is that request's suspected crash: tests/integration/test_failover.py); the scheduler ejects the
dead worker, the next request is served by the healthy one; the CLI shows it. The worker is restarted afterwards so
test order does not matter."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import openai
import pytest

from goodput_testing import wait_until

from goodput_cli.supervisor import Platform

from .conftest import KEY_P0, list_workers

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]


def goodput(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "goodput_cli.main", *args], capture_output=True, text=True,
                          timeout=120, env={**os.environ, "COLUMNS": "200"})


def status(platform: Platform) -> subprocess.CompletedProcess[str]:
    # Every service of the test platform, found from its state folder and port offset as a user's `goodput up`
    # platform is found from .goodput.
    return goodput("status", "--state-dir", str(platform.workdir), "--port-offset", str(platform.port_offset))


def test_cli_status_and_chat(platform: Platform) -> None:
    shown = status(platform)
    assert shown.returncode == 0, shown.stdout + shown.stderr
    assert platform.worker_grpc(0) in shown.stdout and platform.worker_grpc(1) in shown.stdout
    chat = goodput("chat", "What is the capital of France?", "--url", platform.gateway_http,
                   "--key", KEY_P0, "--max-tokens", "20")
    assert chat.returncode == 0, chat.stderr
    assert len(chat.stdout.strip()) > 3, "the answer is streamed to the terminal"


def test_worker_killed_mid_stream(platform: Platform) -> None:
    client = openai.OpenAI(base_url=platform.gateway_http + "/v1", api_key=KEY_P0, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    ask = {"model": model, "prompt": "1, 2, 3, 4, 5,", "max_tokens": 120, "temperature": 0,
           "extra_body": {"ignore_eos": True}}
    uninterrupted = client.completions.create(**ask, extra_headers={"Cache-Control": "no-store"}).choices[0].text
    # Earlier tests' leases are released off their response path: start from an idle fleet so the leases below
    # are these streams'.
    wait_until(lambda: all(w.inflight == 0 for w in list_workers(platform)))
    streams = [iter(client.completions.create(**ask, stream=True, extra_headers={"Cache-Control": "no-store"}))
               for _ in range(3)]  # over two workers: one serves at least two of them
    texts = ["".join(next(chunks).choices[0].text for _ in range(3)) for chunks in streams]
    busiest = max(list_workers(platform), key=lambda w: w.inflight)
    assert busiest.inflight >= 2, [(w.address, w.inflight) for w in list_workers(platform)]
    victim = next(i for i in range(2) if platform.worker_grpc(i) == busiest.address)
    threading.Timer(0.2, platform.kill_worker, args=(victim,)).start()
    for i, chunks in enumerate(streams):
        finish = None
        for chunk in chunks:  # no error: the answers go on on the other worker
            texts[i] += chunk.choices[0].text
            finish = chunk.choices[0].finish_reason or finish
        assert finish == "length" and texts[i] == uninterrupted  # greedy: every token once, as if nothing happened

    # The scheduler ejects the dead worker and the next request goes to the healthy one.
    wait_until(lambda: not {w.address: w for w in list_workers(platform)}[platform.worker_grpc(victim)].healthy)
    for _ in range(3):
        resp = client.completions.create(model=client.models.list().data[0].id, prompt="Hello", max_tokens=4)
        assert resp.choices[0].text is not None
    assert status(platform).returncode != 0, "status reports the dead worker"

    platform.restart_worker(victim)
    wait_until(lambda: all(w.healthy for w in list_workers(platform)), timeout=120)
