"""One real platform per test session: two vLLM CPU workers, the scheduler and the gateway, each its own process,
talking gRPC over localhost (starting vLLM takes a minute or two, so it is shared by every test here).

Every service writes its spans to a JSON-lines file so tests can follow one trace across processes."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from goodput_testing import delete_keys

from goodput_cli.supervisor import Platform

PORT_OFFSET = int(os.environ.get("GOODPUT_TEST_PORT_OFFSET", "1000"))
KEY_P0, KEY_P2 = "test-key-interactive", "test-key-batch"
SERVICES = ("gateway", "scheduler", "inference")


@pytest.fixture(scope="session")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    workdir = tmp_path_factory.mktemp("platform")
    env: dict[str, str] = {"GOODPUT_INFERENCE_ENFORCE_EAGER": "true", "GOODPUT_INFERENCE_MAX_NUM_SEQS": "16"}
    for svc in SERVICES:
        prefix = f"GOODPUT_{svc.upper()}_"
        env[prefix + "OTEL_EXPORTER"] = "file"
        env[prefix + "OTEL_FILE"] = str(workdir / f"spans-{svc}.jsonl")
    env["GOODPUT_SCHEDULER_HEALTH_INTERVAL_S"] = "0.5"
    # The response cache keeps its entries in Redis across runs: each session gets its own keys (removed at the end),
    # so an answer cached by an earlier run never replaces a generation a test expects.
    cache_prefix = env["GOODPUT_CACHE_KEY_PREFIX"] = f"goodput:cache:test-{uuid.uuid4().hex[:8]}"
    keys = [
        {"key_sha256": _sha(KEY_P0), "tenant": "interactive-team", "max_priority": "P0"},
        {"key_sha256": _sha(KEY_P2), "tenant": "batch-team", "max_priority": "P2"},
    ]
    # Two gateway replicas: state that must hold across replicas (stored responses, quotas) is tested through both.
    p = Platform(workdir=workdir, workers=2, port_offset=PORT_OFFSET, env=env, api_keys=keys, gateways=2)
    p.start(timeout_s=900)
    try:
        yield p
    finally:
        p.stop()
        delete_keys(p.redis_url, cache_prefix + ":")


def _sha(key: str) -> str:
    import hashlib

    return hashlib.sha256(key.encode()).hexdigest()


def read_spans(platform: Platform) -> list[dict[str, Any]]:
    spans = []
    for svc in SERVICES:
        path = platform.workdir / f"spans-{svc}.jsonl"
        if path.exists():
            spans.extend(json.loads(line) for line in path.read_text().splitlines() if line.strip())
    return spans


def list_workers(platform: Platform) -> list[scheduler_pb2.WorkerStatus]:
    with platform.internal_channel(platform.scheduler_grpc) as ch:  # mTLS, as the operator
        return list(scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(
            scheduler_pb2.ListWorkersRequest(), timeout=5).workers)


def worker_load(platform: Platform, i: int) -> inference_pb2.WorkerLoad:
    with platform.internal_channel(platform.worker_grpc(i)) as ch:
        return inference_pb2_grpc.InferenceStub(ch).GetLoad(inference_pb2.GetLoadRequest(), timeout=5)



@pytest.fixture
def client(platform: Platform) -> openai.OpenAI:
    """The official openai SDK, unchanged, at the first gateway replica, with the P0 key."""
    return openai.OpenAI(base_url=platform.gateway_http + "/v1", api_key=KEY_P0, max_retries=0, timeout=120)


def model_id(client: openai.OpenAI) -> str:
    """The served generation model (the first listed)."""
    models = client.models.list().data
    assert models, "the gateway lists the served model"
    return models[0].id
