"""Fallback to a lighter model (MODEL_FALLBACKS, opt-in per model and per key): a model that no healthy worker serves,
or whose admission is refused, is answered by its configured lighter model for keys that allow it, counted; other
keys and unconfigured models get the refusal as it was. The scheduler here is absent (nothing listens at its
address), so every admission is refused as "unavailable": the behaviour under test is the gateway's decision."""

from __future__ import annotations

import json

import httpx
import pytest
from prometheus_client import CollectorRegistry

from goodput_gateway.catalogue import ModelEntry
from goodput_gateway.service import GatewayService

from .helpers import GatewayFactory, assert_openai_error

KEYS = json.dumps({"keys": [{"key": "k-fallback", "tenant": "a", "max_priority": "P1", "model_fallback": True},
                            {"key": "k-strict", "tenant": "a", "max_priority": "P1"}]})
FALLBACKS = "goodput_gateway_model_fallbacks_total"


@pytest.fixture
async def gateway(gateway: GatewayFactory) -> tuple[httpx.AsyncClient, GatewayService, CollectorRegistry]:
    gw = await gateway(api_keys=KEYS, model_fallbacks={"big": "small"},
                       models=[ModelEntry(id="small", max_model_len=2048, model_version="v", workers=1)])
    return gw.client, gw.service, gw.registry


def _ask(model: str) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


async def _post(client: httpx.AsyncClient, key: str, model: str) -> httpx.Response:
    return await client.post("/v1/chat/completions", json=_ask(model), headers={"Authorization": f"Bearer {key}"})


async def test_a_model_that_is_down_falls_back_only_for_keys_that_opted_in(gateway) -> None:  # type: ignore[no-untyped-def]
    client, _, registry = gateway
    # no worker serves "big": the strict key is told so, as before
    assert_openai_error(await _post(client, "k-strict", "big"), 400, "model")
    assert registry.get_sample_value(FALLBACKS, {"asked": "big", "served": "small", "reason": "down"}) is None
    # the opted-in key is routed to "small" (which the absent scheduler then cannot admit: 503, not 400)
    assert_openai_error(await _post(client, "k-fallback", "big"), 503)
    assert registry.get_sample_value(FALLBACKS, {"asked": "big", "served": "small", "reason": "down"}) == 1
    # a model without a configured fallback is refused as before, for any key
    assert_openai_error(await _post(client, "k-fallback", "medium"), 400, "model")


async def test_a_refused_admission_falls_back_once(gateway) -> None:  # type: ignore[no-untyped-def]
    client, service, registry = gateway
    service.pipeline.catalogue.pin([  # both served; "big" cannot be admitted (no scheduler)
        ModelEntry(id="big", max_model_len=8192, model_version="v", workers=1),
        ModelEntry(id="small", max_model_len=2048, model_version="v", workers=1)])
    assert_openai_error(await _post(client, "k-fallback", "big"), 503)  # "small" is refused too: no loop
    assert registry.get_sample_value(FALLBACKS, {"asked": "big", "served": "small", "reason": "down"}) == 1
    assert_openai_error(await _post(client, "k-strict", "big"), 503)
    assert registry.get_sample_value(FALLBACKS, {"asked": "big", "served": "small", "reason": "down"}) == 1
