"""The pytest plugin (entry point ``pytest11``): a Redis for the session and key prefixes that keep runs apart.

- ``redis_url`` (session): the Redis on 127.0.0.1:6379 when it answers, otherwise a ``redis-server`` started for
  the session (and stopped after it); no Redis and no binary fails the test, with what to install.
- ``redis_session_prefix`` (session): a key prefix of this session's own (``goodput-test-<hex>``); what is left
  under it is deleted when the session ends, so two runs on one Redis (two checkouts, CI beside a developer) never
  see each other's keys.
- ``redis_prefix`` (test): a prefix under the session's, for one test's keys, queues and channels; deleted after it.
- ``tiny_cross_encoder`` (session): a one-layer cross-encoder folder in the exact format ``goodput train`` writes
  (weights, tokenizer, int8 ONNX, model card) with an untrained head: for tests of loading, batching, deadlines and
  the services' plumbing (what it says is arbitrary; the trained models' verdicts are measured by the loadtests).
- ``service_processes`` (test): ``start(module, name, **env)`` runs a service as its own process
  (:class:`~goodput_testing.ServiceProcess`, its log in the test's tmp folder); all are stopped after the test.

A test that talks to a Redis puts every key it writes under one of these prefixes (services take it through
their ``KEY_PREFIX``-like settings).
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from goodput_testing._procs import ServiceProcess
from goodput_testing._redis import RedisServer, delete_keys, redis_answers

LOCAL_REDIS_PORT = 6379


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    if redis_answers(port=LOCAL_REDIS_PORT):
        yield f"redis://127.0.0.1:{LOCAL_REDIS_PORT}/0"
        return
    try:
        server = RedisServer().start()
    except FileNotFoundError:
        pytest.fail("no Redis on 127.0.0.1:6379 and no redis-server binary (make install installs it)", pytrace=False)
    try:
        yield server.url
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_session_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"goodput-test-{uuid.uuid4().hex[:8]}"
    yield prefix
    delete_keys(redis_url, prefix)


@pytest.fixture
def redis_prefix(redis_url: str, redis_session_prefix: str) -> Iterator[str]:
    prefix = f"{redis_session_prefix}-{uuid.uuid4().hex[:6]}"
    yield prefix
    delete_keys(redis_url, prefix)


@pytest.fixture(scope="session")
def tiny_cross_encoder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from goodput_crossencoder.training import make_untrained

    return make_untrained(tmp_path_factory.mktemp("cross-encoder") / "tiny")


@pytest.fixture
def service_processes(tmp_path: Path) -> Iterator[Callable[..., ServiceProcess]]:
    started: list[ServiceProcess] = []

    def start(module: str, name: str, **env: str) -> ServiceProcess:
        p = ServiceProcess(module, env, tmp_path / f"{name}.log")
        started.append(p)
        return p

    yield start
    for p in reversed(started):
        p.stop()
