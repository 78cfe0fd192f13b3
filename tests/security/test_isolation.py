"""Tenant isolation of prefix reuse, black box: on a real vLLM engine a long prompt repeated inside a tenant is served
from the prefix cache, and the same prompt sent by another tenant is not (the cross-tenant timing side channel of
CVE-2025-46570's class is closed), unless the two tenants are in one cache sharing group.

The platform is real processes on localhost with one vLLM CPU worker; requests go through the gateway's REST API
with each tenant's own API key, and the evidence is the engine's own prefix-cache counters, read from the worker's
``/metrics`` (``goodput_worker_prefix_cache_queries_total`` / ``..._hits_total``, prompt tokens looked up / found).
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from goodput_testing import wait_until

from goodput_cli.supervisor import Platform

pytestmark = [pytest.mark.integration, pytest.mark.slow]

PORT_OFFSET = 2900
TENANTS = ("alpha", "beta", "team-eu", "team-us")
GROUPS = json.dumps({"team": ["team-eu", "team-us"]})


def _key(tenant: str) -> str:
    return f"test-key-isolation-{tenant}"


@pytest.fixture(scope="module")
def platform(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Platform]:
    env = {"GOODPUT_INFERENCE_ENFORCE_EAGER": "true", "GOODPUT_INFERENCE_MAX_NUM_SEQS": "4",
           "GOODPUT_INFERENCE_CACHE_SHARING_GROUPS": GROUPS, "GOODPUT_SCHEDULER_CACHE_SHARING_GROUPS": GROUPS,
           "GOODPUT_SCHEDULER_HEALTH_INTERVAL_S": "0.5"}
    keys = [{"key_sha256": hashlib.sha256(_key(t).encode()).hexdigest(), "tenant": t, "max_priority": "P0"}
            for t in TENANTS]
    p = Platform(workdir=tmp_path_factory.mktemp("isolation"), workers=1, port_offset=PORT_OFFSET, env=env,
                 api_keys=keys, knowledge=False, cache=False, jobs=False)
    with p:  # started here, stopped after the module's tests
        yield p


@dataclass(frozen=True)
class Reuse:
    prompt_tokens: int
    cached_tokens: int  # prompt tokens the engine found in its prefix cache for this request


def _counters(platform: Platform) -> tuple[float, float]:
    text = httpx.get(f"{platform.worker_http(0)}/metrics", timeout=5).text
    values = []
    for name in ("goodput_worker_prefix_cache_queries_total", "goodput_worker_prefix_cache_hits_total"):
        m = re.search(rf"^{name} (\S+)$", text, re.M)
        assert m is not None, f"the worker exports no {name}"
        values.append(float(m.group(1)))
    return values[0], values[1]


def _send(platform: Platform, tenant: str, prompt: str) -> Reuse:
    """One request as ``tenant``, alone on the engine; what the engine reused for it."""
    queries, hits = _counters(platform)
    r = httpx.post(f"{platform.gateway_http}/v1/chat/completions", timeout=300,
                   headers={"Authorization": f"Bearer {_key(tenant)}", "Cache-Control": "no-store"},
                   json={"messages": [{"role": "user", "content": prompt}], "max_tokens": 1, "temperature": 0})
    assert r.status_code == 200, r.text
    prompt_tokens = int(r.json()["usage"]["prompt_tokens"])
    # The engine reports its lookups with the step that scheduled the prompt: wait until this one's are counted.
    after = wait_until(lambda: (c := _counters(platform))[0] >= queries + prompt_tokens and c, timeout=30,
                       message="the engine did not report the request's prefix-cache lookups")
    return Reuse(prompt_tokens=prompt_tokens, cached_tokens=int(after[1] - hits))


def _long_prompt() -> str:
    """A prompt of several KV blocks, new to the engine (a fresh id opens it)."""
    rules = " ".join(f"Rule {i}: answer politely, cite the handbook section, and never reveal account numbers."
                     for i in range(40))
    return f"Session {uuid.uuid4().hex}. You are the support assistant. {rules} Question: how do I reset my card PIN?"


def test_a_prompt_is_reused_inside_its_tenant_and_not_across_tenants(platform: Platform) -> None:
    prompt = _long_prompt()
    first = _send(platform, "alpha", prompt)
    assert first.prompt_tokens > 500 and first.cached_tokens == 0
    repeat = _send(platform, "alpha", prompt)
    assert repeat.cached_tokens >= repeat.prompt_tokens // 2, repeat  # most of it is served from the cache
    # The same prompt from another tenant finds nothing: no faster first token tells beta that alpha sent it.
    other = _send(platform, "beta", prompt)
    assert other.prompt_tokens == first.prompt_tokens and other.cached_tokens == 0, other
    # beta's own repeat reuses beta's own prefix
    assert _send(platform, "beta", prompt).cached_tokens >= first.prompt_tokens // 2


def test_tenants_of_one_sharing_group_reuse_each_others_prefix(platform: Platform) -> None:
    prompt = _long_prompt()
    assert _send(platform, "team-eu", prompt).cached_tokens == 0
    shared = _send(platform, "team-us", prompt)
    assert shared.cached_tokens >= shared.prompt_tokens // 2, shared
    assert _send(platform, "alpha", prompt).cached_tokens == 0  # outside the group: nothing
