"""The gateway's front half, shared by REST and gRPC: authenticate, validate, open the pipeline.

Example:
    >>> stream = await service.begin(authorization="Bearer k", request=req, route="chat")
    >>> async for event in stream: ...
"""

from __future__ import annotations

import time
from dataclasses import replace

from goodput_core.context import new_request_id, tenant_id_var
from goodput_core.errors import Unimplemented

from goodput_gateway.auth import ApiKeyStore, Principal
from goodput_gateway.caching import CachedStream, CacheStatus, GatewayCache
from goodput_gateway.config import GatewaySettings
from goodput_gateway.knowledge import Knowledge
from goodput_gateway.pipeline import GatewayMetrics, GenerationStream, Pipeline
from goodput_gateway.rag import Source, augment
from goodput_gateway.requests import GenerationRequest, apply_model_limits, validate_shape


class GatewayService:
    def __init__(self, settings: GatewaySettings, *, keys: ApiKeyStore, pipeline: Pipeline,
                 metrics: GatewayMetrics, knowledge: Knowledge | None = None,
                 cache: GatewayCache | None = None) -> None:
        self.settings = settings
        self.cache = cache
        self.knowledge = knowledge
        self.keys = keys
        self.pipeline = pipeline
        self.metrics = metrics

    def authenticate(self, authorization: str | None) -> Principal:
        started = time.monotonic()
        principal = self.keys.authenticate(authorization)
        tenant_id_var.set(principal.tenant)
        self.metrics.stage.labels("auth").observe(time.monotonic() - started)
        return principal

    async def begin(self, principal: Principal, request: GenerationRequest, *, request_id: str | None = None,
                    arrived: float | None = None, timeout_s: float | None = None,
                    knowledge_base: str = "", cache_control: str = "") -> GenerationStream:
        arrived = arrived or time.monotonic()
        started = time.monotonic()
        # Priority is checked before anything is spent on the request.
        request = replace(request, priority=principal.resolve_priority(request.priority))
        validate_shape(request, self.settings)
        model = await self.pipeline.resolve_model(request.model)
        request_id = request_id or new_request_id()
        timeout = min(timeout_s, self.settings.request_timeout_s) if timeout_s else self.settings.request_timeout_s
        cached: CachedStream | CacheStatus | None = None
        if self.cache is not None:  # before retrieval and scheduling: a hit needs neither
            cached = await self.cache.lookup(self.pipeline, principal, request, model, knowledge_base=knowledge_base,
                                             cache_control=cache_control, request_id=request_id, arrived=arrived,
                                             deadline=arrived + timeout)
            if isinstance(cached, CachedStream):
                return cached
        sources: list[Source] = []
        if knowledge_base:  # RAG: retrieval before scheduling
            if self.knowledge is None or not self.knowledge.retrieval_enabled:
                raise Unimplemented("knowledge_base needs the retriever service, which this gateway is not "
                                    "configured with")
            retrieve_started = time.monotonic()
            request, sources = await augment(self.knowledge, self.settings, tenant=principal.tenant,
                                             kb=knowledge_base, request=request, max_model_len=model.max_model_len)
            self.metrics.stage.labels("retrieve").observe(time.monotonic() - retrieve_started)
        request = apply_model_limits(request, self.settings, max_model_len=model.max_model_len)
        self.metrics.stage.labels("validate").observe(time.monotonic() - started)
        stream = await self.pipeline.open(principal, request, request_id=request_id,
                                          model=model.id, arrived=arrived, deadline=arrived + timeout)
        stream.sources = sources
        if self.cache is not None and isinstance(cached, CacheStatus):
            return self.cache.record(stream, cached)
        return stream
