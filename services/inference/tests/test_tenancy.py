"""Prefix-cache isolation: each tenant's prompts carry a salt of their own (a keyed hash of the tenant, or of its
sharing group) to the engine, so a tenant never reuses, or times, another tenant's cached prefix."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from goodput_inference.config import InferenceSettings
from goodput_inference.engine import GenRequest, Sampling
from goodput_inference.servicer import WorkerMetrics
from goodput_inference.sim_engine import SimEngine, SimParams
from goodput_inference.tenancy import CacheSalts
from goodput_inference.vllm_engine import VllmEngine


def test_the_salt_is_a_keyed_hash_of_the_tenant_not_its_name() -> None:
    salts = CacheSalts(key=b"k" * 32)
    assert salts.salt("acme") == CacheSalts(key=b"k" * 32).salt("acme")  # stable for one key
    assert salts.salt("acme") != salts.salt("globex") != salts.salt("")  # one per tenant, the anonymous one too
    assert salts.salt("acme") != CacheSalts(key=b"other").salt("acme")  # unguessable without the key
    assert "acme" not in salts.salt("acme") and len(salts.salt("acme")) == 32


def test_a_sharing_group_shares_one_salt_and_nobody_else_gets_it() -> None:
    salts = CacheSalts(key=b"k", groups={"partners": ["acme", "globex"]})
    assert salts.salt("acme") == salts.salt("globex")
    assert salts.salt("initech") != salts.salt("acme")
    # a tenant that happens to be named like a group is not in it
    assert salts.salt("partners") != salts.salt("acme")
    assert salts.scope("partners") == "tenant:partners"


def test_without_a_key_each_process_draws_its_own_and_a_configured_key_is_shared(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert CacheSalts.from_settings(InferenceSettings()).salt("acme") != \
        CacheSalts.from_settings(InferenceSettings()).salt("acme")
    monkeypatch.setenv("GOODPUT_INFERENCE_CACHE_SALT_KEY", "a-secret")
    monkeypatch.setenv("GOODPUT_INFERENCE_CACHE_SHARING_GROUPS", '{"team": ["acme", "acme-batch"]}')
    settings = InferenceSettings()
    a, b = CacheSalts.from_settings(settings), CacheSalts.from_settings(InferenceSettings())
    assert a.salt("acme") == b.salt("acme") == a.salt("acme-batch") != a.salt("globex")
    assert "a-secret" not in repr(settings)  # the key is a secret: not in logs of the settings


def test_sharing_group_settings_are_checked_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GOODPUT_INFERENCE_CACHE_SHARING_GROUPS", '{"a": ["t1"], "b": ["t1", "t2"]}')
    with pytest.raises(ValueError, match="tenant 't1' is in two cache sharing groups"):
        InferenceSettings()
    monkeypatch.setenv("GOODPUT_INFERENCE_CACHE_SHARING_GROUPS", '{"a": "t1"}')
    with pytest.raises(ValueError):
        InferenceSettings()
    monkeypatch.setenv("GOODPUT_INFERENCE_CACHE_SHARING_GROUPS", "")
    assert InferenceSettings().cache_sharing_groups == {}


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) % 100 for c in text]


class _Engine:
    """Stands in for vLLM's AsyncLLM: records the prompts it is given and finishes each at once."""

    def __init__(self) -> None:
        self.prompts: list[dict[str, Any]] = []

    async def generate(self, prompt: dict[str, Any], params: Any, request_id: str, priority: int = 0) -> Any:
        from types import SimpleNamespace

        self.prompts.append(dict(prompt))
        yield SimpleNamespace(finished=True, num_cached_tokens=0,
                              outputs=[SimpleNamespace(token_ids=[1], text="x", finish_reason="stop", index=0)])


async def test_the_vllm_engine_sends_each_prompt_with_its_tenants_salt() -> None:
    salts = CacheSalts(key=b"k", groups={"team": ["acme", "acme-batch"]})
    engine = VllmEngine(InferenceSettings(max_model_len=256), model_dir=Path("/m"), served_model_name="m",
                        salts=salts)
    fake = _Engine()
    engine._engine, engine._tokenizer, engine._ready = fake, _Tokenizer(), True
    for tenant in ("acme", "globex", "acme-batch", ""):
        request = GenRequest(request_id=f"r-{tenant}", prompt="the same long prompt", tenant=tenant,
                             sampling=Sampling(max_tokens=1))
        [_ async for _ in engine.generate(request)]
    salt = [p["cache_salt"] for p in fake.prompts]
    assert salt == [salts.salt("acme"), salts.salt("globex"), salts.salt("acme"), salts.salt("")]
    assert salt[0] != salt[1] and salt[0] == salt[2] and len(set(salt)) == 3
    assert all(p["prompt_token_ids"] == fake.prompts[0]["prompt_token_ids"] for p in fake.prompts)


async def _hits(e: SimEngine, tenant: str, prompt: str) -> int:
    before = e.load().prefix_cache_hits
    [_ async for _ in e.generate(GenRequest(request_id=f"{tenant}-{before}", prompt=prompt, tenant=tenant,
                                            sampling=Sampling(max_tokens=2)))]
    return e.load().prefix_cache_hits - before


async def test_the_simulated_engine_reuses_a_prefix_only_within_a_tenant_or_its_group() -> None:
    settings = InferenceSettings(engine="sim", max_model_len=4096)
    e = SimEngine(settings, params=SimParams(time_scale=0.01),
                  salts=CacheSalts(key=b"k", groups={"team": ["acme", "acme-batch"]}))
    await e.start()
    try:
        prompt = "You are a helpful assistant for the handbook. " * 40
        assert await _hits(e, "acme", prompt) == 0
        assert await _hits(e, "acme", prompt) > 0  # a repeat inside the tenant hits
        assert await _hits(e, "globex", prompt) == 0  # another tenant's identical prompt does not
        assert await _hits(e, "acme-batch", prompt) > 0  # the sharing group does
        registry = CollectorRegistry()
        WorkerMetrics(registry, e)
        text = generate_latest(registry).decode()
        load = e.load()
        assert f"goodput_worker_prefix_cache_hits_total {float(load.prefix_cache_hits)}" in text
        assert f"goodput_worker_prefix_cache_queries_total {float(load.prefix_cache_queries)}" in text
    finally:
        await e.shutdown()
