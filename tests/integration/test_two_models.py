"""Two models served at once through the real vLLM CPU engine: the dev model's weights under two served names, each
its own pool with its own worker ("smollm2" alias "small-chat", "smollm2-b" alias "b-chat"), as `goodput up --pools`
runs them. A request names a model or an alias and is answered by that model's worker only; /v1/models lists both;
when pool b's worker dies, a key that allows it is answered by the lighter model (MODEL_FALLBACKS) and says so, and a
key that does not gets a clear OpenAI-shaped error.

One platform for the module (two engines start in about a minute on 2 cores); only the gateway, the scheduler and
the workers run. The pool b worker is killed by the last test, and the platform stopped after it.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from goodput_testing import wait_until

from goodput_cli.pools import parse_pools
from goodput_cli.supervisor import Platform

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

PORT_OFFSET = 4400  # no other test or benchmark uses it (tests: 1000, 2300-3900; loadtests: 300, 3000-3450, 4100-4260)
KEY_FALLBACK, KEY_PLAIN = "test-key-two-models-fallback", "test-key-two-models-plain"
MODELS = {"smollm2": ("small", "small-chat"), "smollm2-b": ("b", "b-chat")}  # served name -> (pool, alias)
POOLS = {"pools": [{"name": pool, "aliases": [alias], "model": {"servedModelName": name}, "maxNumSeqs": 4}
                   for name, (pool, alias) in MODELS.items()]}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    pools, notes = parse_pools(POOLS, "the test's pools")
    assert notes == []
    keys = [{"key_sha256": hashlib.sha256(KEY_FALLBACK.encode()).hexdigest(), "tenant": "two-models",
             "max_priority": "P0", "model_fallback": True},
            {"key_sha256": hashlib.sha256(KEY_PLAIN.encode()).hexdigest(), "tenant": "two-models",
             "max_priority": "P0"}]
    env = {"GOODPUT_GATEWAY_MODEL_FALLBACKS": json.dumps({"smollm2-b": "smollm2"}),
           "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.5", "GOODPUT_GATEWAY_MODELS_CACHE_S": "0.5"}
    p = Platform(workdir=tmp_path_factory.mktemp("two-models"), pools=pools, port_offset=PORT_OFFSET, env=env,
                 api_keys=keys, knowledge=False, cache=False, jobs=False)
    started = time.monotonic()
    with p:
        print(f"\ntwo-model platform serving after {time.monotonic() - started:.1f} s")
        yield p


def _chat(platform: Platform, model: str, key: str = KEY_FALLBACK) -> httpx.Response:
    body = {"model": model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 2, "temperature": 0}
    return httpx.post(platform.gateway_http + "/v1/chat/completions", json=body, timeout=120,
                      headers={"Authorization": f"Bearer {key}"})


def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of the samples of counter ``name`` (without ``_total``) whose labels include ``labels`` on the
    metrics page at ``url``."""
    text = httpx.get(url, timeout=10).text
    return sum(s.value for family in text_string_to_metric_families(text) if family.name == name
               for s in family.samples if s.name.endswith("_total") and labels.items() <= s.labels.items())


def _served_by(platform: Platform, pools: tuple[str, ...] = ("small", "b")) -> dict[str, float]:
    """Generate calls the worker of each of ``pools`` has finished."""
    return {pool: _metric(platform.worker_http(platform.pool_workers(pool)[0]) + "/metrics", "goodput_worker_requests")
            for pool in pools}


def _workers(platform: Platform) -> list[Any]:
    with platform.internal_channel(platform.scheduler_grpc) as ch:
        return list(scheduler_pb2_grpc.SchedulerStub(ch).ListWorkers(scheduler_pb2.ListWorkersRequest(),
                                                                      timeout=5).workers)


def _listed(platform: Platform) -> dict[str, list[str]]:
    reply = httpx.get(platform.gateway_http + "/v1/models", headers={"Authorization": f"Bearer {KEY_PLAIN}"},
                      timeout=10)
    assert reply.status_code == 200, reply.text
    return {m["id"]: m.get("aliases", []) for m in reply.json()["data"]}


def test_each_pool_reports_its_model_and_v1_models_lists_both_with_their_aliases(fleet: Platform) -> None:
    reported = {w.model.pool: (w.model.served_model_name, list(w.model.aliases), w.healthy) for w in _workers(fleet)}
    assert reported == {"small": ("smollm2", ["small-chat"], True), "b": ("smollm2-b", ["b-chat"], True)}
    assert _listed(fleet) == {"smollm2": ["small-chat"], "smollm2-b": ["b-chat"]}


@pytest.mark.parametrize("asked", ["smollm2", "small-chat", "smollm2-b", "b-chat"])
def test_a_model_named_or_aliased_is_answered_by_its_own_pool(fleet: Platform, asked: str) -> None:
    served = next(name for name, (_, alias) in MODELS.items() if asked in (name, alias))
    pool = MODELS[served][0]
    before = _served_by(fleet)

    reply = _chat(fleet, asked)

    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == served  # an alias answers under the model's served name
    assert "X-Goodput-Degraded" not in reply.headers
    expected = {p: n + (1 if p == pool else 0) for p, n in before.items()}
    wait_until(lambda: _served_by(fleet) == expected, timeout=10,
               message=f"{asked!r} was not served by pool {pool} alone: {before} -> {_served_by(fleet)}")


def test_when_pool_b_is_down_its_model_falls_back_to_the_lighter_one_for_keys_that_allow_it(fleet: Platform) -> None:
    (victim,) = fleet.pool_workers("b")
    fleet.kill_worker(victim)
    # the scheduler ejects the dead worker, and the gateway's list of models drops its model
    wait_until(lambda: not next(w for w in _workers(fleet) if w.model.pool == "b").healthy, timeout=30,
               message="the scheduler still sees pool b's worker healthy")
    wait_until(lambda: "smollm2-b" not in _listed(fleet), timeout=30, message="the gateway still lists smollm2-b")
    before = _served_by(fleet, ("small",))["small"]
    fallbacks = _metric(fleet.gateway_metrics, "goodput_gateway_model_fallbacks", asked="smollm2-b", served="smollm2")

    reply = _chat(fleet, "smollm2-b", KEY_FALLBACK)

    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "smollm2"  # the model that answered, not the one asked for
    assert "model_fallback" in reply.headers["X-Goodput-Degraded"]
    assert reply.json()["choices"][0]["message"]["content"]
    wait_until(lambda: _served_by(fleet, ("small",))["small"] == before + 1, timeout=10,
               message="the fallback was not served by pool small")
    assert _metric(fleet.gateway_metrics, "goodput_gateway_model_fallbacks", asked="smollm2-b",
                   served="smollm2") == fallbacks + 1

    # a key without model_fallback: a clear OpenAI-shaped error naming the model, no silent substitution
    refused = _chat(fleet, "smollm2-b", KEY_PLAIN)
    assert refused.status_code in (400, 404), refused.text  # OpenAI answers an unknown model with 404
    error = refused.json()["error"]
    assert error["code"] == "model_not_found" and error["param"] == "model"
    assert error["type"] == "invalid_request_error"
    assert "smollm2-b" in error["message"] and "smollm2" in error["message"].split("available:")[1]
    assert "X-Goodput-Degraded" not in refused.headers
    assert _served_by(fleet, ("small",))["small"] == before + 1
