"""The models this gateway can serve, as the scheduler lists its healthy workers (:class:`Catalogue`): cached for
``models_cache_s`` and refreshed in the background, names and aliases resolved, and model ``"auto"`` routed to the
cheapest pool predicted to meet the request's SLO (:mod:`goodput_gateway.autoroute`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from goodput_core.breaker import CircuitBreaker
from goodput_core.errors import InvalidArgument, Unavailable

from goodput_gateway.autoroute import AutoChoice, QueueWaits, choose, pools_from
from goodput_gateway.config import GatewaySettings

__all__ = ["Catalogue", "ModelEntry"]


@dataclass(frozen=True)
class ModelEntry:
    id: str
    max_model_len: int
    model_version: str
    workers: int
    tool_call_parser: str = ""  # what gives the model tool_choice "auto" (on every worker); empty = none
    aliases: tuple[str, ...] = ()  # other names the model's workers answer to (SERVED_MODEL_ALIASES)


class Catalogue:
    def __init__(self, settings: GatewaySettings, *, scheduler: scheduler_pb2_grpc.SchedulerStub,
                 breaker: CircuitBreaker) -> None:
        self.settings = settings
        self.scheduler = scheduler
        self.breaker = breaker  # the scheduler's: open, a model list is refused at once (503 + retry-after)
        self._models: tuple[float, list[ModelEntry]] = (0.0, [])
        self._workers: list[scheduler_pb2.WorkerStatus] = []  # the same ListWorkers answer, for model "auto"
        self.queue_waits = QueueWaits()  # measured per (model, class): what model "auto" expects to wait
        self._models_refresh: asyncio.Task[list[ModelEntry]] | None = None

    def pin(self, models: Sequence[ModelEntry], workers: Sequence[scheduler_pb2.WorkerStatus] = ()) -> None:
        """Serves ``models`` (and ``workers`` for model "auto") from now on without asking the scheduler: what a
        gateway's tests give it instead of a scheduler."""
        self._models, self._workers = (float("inf"), list(models)), list(workers)

    async def models(self) -> list[ModelEntry]:
        """Models served by healthy workers. Cached for ``models_cache_s``; a stale list is served while one
        refresh runs in the background, so no request waits for the scheduler once a list is known."""
        cached_at, cached = self._models
        fresh = time.monotonic() - cached_at < self.settings.models_cache_s
        if cached and fresh:
            return cached
        if self._models_refresh is None or self._models_refresh.done():
            self._models_refresh = asyncio.get_running_loop().create_task(self._fetch_models())
            # A failed background refresh keeps the old list; its error is consumed here, not logged as lost.
            self._models_refresh.add_done_callback(lambda t: None if t.cancelled() else t.exception())
        if cached:
            return cached
        return await asyncio.shield(self._models_refresh)

    async def _fetch_models(self) -> list[ModelEntry]:
        try:
            async with self.breaker.guard():
                # a refresh behind a known list (no request waits for it) waits out a scheduler failover (no replica
                # leads for a few seconds) instead of failing at once and opening the scheduler's breaker; the first
                # fetch, which a request waits for, fails fast
                resp = await self.scheduler.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5,
                                                        wait_for_ready=bool(self._models[1]))
        except grpc.RpcError as err:
            raise Unavailable(f"scheduler unavailable: {err.details() if hasattr(err, 'details') else err}") \
                from None
        by_name: dict[str, ModelEntry] = {}
        for w in resp.workers:
            if not w.healthy or not w.model.served_model_name:
                continue
            name = w.model.served_model_name
            prev = by_name.get(name)
            # "auto" tools only where every worker of the model has a parser (a request may land on any of them)
            parser = w.model.tool_call_parser if prev is None or prev.tool_call_parser == w.model.tool_call_parser \
                else ""
            # an alias counts where every worker of the model declares it (a request may land on any of them)
            aliases = tuple(sorted(set(w.model.aliases) if prev is None else set(prev.aliases) & set(w.model.aliases)))
            by_name[name] = ModelEntry(id=name, max_model_len=w.model.max_model_len,
                                       model_version=w.model.model_version,
                                       workers=(prev.workers if prev else 0) + 1, tool_call_parser=parser,
                                       aliases=aliases)
        models = sorted(by_name.values(), key=lambda m: m.id)
        self._workers = list(resp.workers)
        self._models = (time.monotonic(), models)
        return models

    def inflight(self, address: str) -> int:
        """The leases of the worker at ``address``, all gateways', as the scheduler last listed them (0: unlisted)."""
        return max((w.inflight for w in self._workers if w.address == address), default=0)

    async def route_auto(self, *, priority: int, prompt_tokens: int, output_tokens: int, ttft_slo_s: float,
                         tpot_slo_s: float, models: Sequence[str] = ()) -> AutoChoice:
        """``model: "auto"``: the cheapest pool predicted to meet the SLO (:mod:`goodput_gateway.autoroute`)."""
        await self.models()  # the worker list comes with the models' (cached for models_cache_s)
        pools = pools_from(self._workers, priority=priority, models=models)
        if not pools:
            raise Unavailable("model 'auto': no healthy worker serves a model it may choose"
                              + (f" ({', '.join(models)})" if models else ""), retry_after_s=5.0)
        choice = choose(pools, prompt_tokens=prompt_tokens, output_tokens=output_tokens, ttft_slo_s=ttft_slo_s,
                        tpot_slo_s=tpot_slo_s, queue_wait=lambda model: self.queue_waits.get(model, priority))
        if choice is None:
            longest = max(p.max_model_len for p in pools)
            raise InvalidArgument(f"model 'auto': the prompt (~{prompt_tokens} tokens) and max_tokens "
                                  f"({output_tokens}) fit no model's context window (the largest: {longest})",
                                  param="messages", code="context_length_exceeded")
        return choice

    async def resolve_model(self, name: str) -> ModelEntry:
        models = await self.models()
        if not models:
            raise Unavailable("no healthy inference worker is serving a model yet", retry_after_s=5.0)
        if not name:
            return models[0]
        for m in models:
            if m.id == name:
                return m
        for m in models:  # an alias answers as the model it names (the response carries m.id)
            if name in m.aliases:
                return m
        raise InvalidArgument(f"model {name!r} does not exist; available: {', '.join(m.id for m in models)}",
                              param="model", code="model_not_found")
