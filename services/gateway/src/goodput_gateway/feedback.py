"""Program-level goodput: ``POST /v1/feedback`` tells the platform what became of an answer (``used``,
``discarded``, ``regenerated``); an answer thrown away was no goodput after all, whatever its latency.

Each answered request is remembered for ``feedback_ttl_s`` (tenant, model, class, and its goodput tokens: its
output tokens when it met its SLO, else 0) in this process (bounded) and, when Redis is configured, in Redis too, so
feedback may reach any replica: written every ``feedback_flush_s`` in one pipeline with the others answered
meanwhile, off the response path (a write per answer cost every request a Redis round trip of the event loop).
Answers kept in Redis count against their tenant's ``feedback`` storage quota (:mod:`goodput_gateway.storage`),
reserved with the flush (one round trip for all of them); past it, an answer is kept on its own replica only.
Feedback is tenant-scoped (another tenant's request id is unknown, 404) and counted once per request: a discarded
answer's tokens go to ``goodput_gateway_goodput_discarded_tokens_total``. An answer is named by its request id
(``X-Request-Id``: ``req-…``) or by the id the client holds, which names the same request: ``chatcmpl-…``,
``cmpl-…`` or ``resp_…``.

    >>> import asyncio
    >>> from goodput_gateway.config import GatewaySettings
    >>> from goodput_gateway.profile import LatencyProfile
    >>> from goodput_gateway.timing import TimingMetrics
    >>> store = FeedbackStore(GatewaySettings(), redis=None, metrics=TimingMetrics(None, LatencyProfile()))
    >>> store.keep(_Answer(request_id="r1", tenant="acme", model="m", priority=1, tokens=42))
    >>> asyncio.run(store.record("acme", "r1", "discarded"))
    {'object': 'feedback', 'request_id': 'r1', 'verdict': 'discarded', 'goodput_tokens_withdrawn': 42}
    >>> asyncio.run(store.record("acme", "r1", "discarded"))["goodput_tokens_withdrawn"]  # once per answer
    0
    >>> request_ids("chatcmpl-9f2c"), request_ids("req-9f2c")
    (['chatcmpl-9f2c', 'req-9f2c'], ['req-9f2c'])
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, Literal

from cachetools import TTLCache
from pydantic import Field
from redis.exceptions import RedisError

from goodput_core.errors import NotFound, Unavailable
from goodput_core.priority import priority_name

from goodput_gateway.config import GatewaySettings
from goodput_gateway.schemas import Body
from goodput_gateway.storage import DEFAULT_STORAGE, AsyncStorageLedger, StorageQuota, storage_prefix
from goodput_gateway.timing import TimingMetrics

__all__ = ["FeedbackRequest", "FeedbackStore", "request_ids"]

log = logging.getLogger("goodput.gateway.feedback")

Verdict = Literal["used", "discarded", "regenerated"]
# The ids of an answer as the OpenAI SDK returns them: the prefix, then the request id's own part (after "req-").
ANSWER_PREFIXES = ("chatcmpl-", "cmpl-", "resp_")


def request_ids(answer_id: str) -> list[str]:
    """The request ids an id of ``POST /v1/feedback`` may name: itself, and for an answer's id its request's."""
    for prefix in ANSWER_PREFIXES:
        if answer_id.startswith(prefix) and len(answer_id) > len(prefix):
            return [answer_id, f"req-{answer_id.removeprefix(prefix)}"]
    return [answer_id]


class FeedbackRequest(Body):
    """``POST /v1/feedback``."""

    request_id: str = Field(min_length=1, max_length=128)
    verdict: Verdict


@dataclass(frozen=True)
class _Answer:
    request_id: str
    tenant: str
    model: str
    priority: int
    tokens: int  # goodput tokens: its output when it met its SLO, else 0


class FeedbackStore:
    def __init__(self, settings: GatewaySettings, *, redis: Any, metrics: TimingMetrics,
                 ledger: AsyncStorageLedger | None = None,
                 quota_of: Callable[[str], StorageQuota] = lambda tenant: DEFAULT_STORAGE) -> None:
        self.settings = settings
        self.redis = redis
        self.metrics = metrics
        self.ledger = ledger or AsyncStorageLedger(redis, prefix=storage_prefix(settings))
        self.quota_of = quota_of  # a tenant's storage quotas (its feedback limit)
        self._local: TTLCache[str, _Answer] = TTLCache(maxsize=settings.feedback.max_local,
                                                       ttl=settings.feedback.ttl_s)
        # key -> its JSON, on its way to Redis with the next flush (a verdict taken meanwhile replaces it)
        self._pending: dict[str, str] = {}
        self._tenants: dict[str, str] = {}  # key -> its tenant, for its place in the ledger
        self._flush: asyncio.Task[None] | None = None

    def _key(self, tenant: str, request_id: str) -> str:
        return f"{self.settings.feedback.prefix}:{tenant}:{request_id}"

    def remember(self, opened: Any, *, tokens: int) -> None:
        """An answered request (the service's Opened), kept for its feedback (off the response path)."""
        self.keep(_Answer(request_id=opened.request_id, tenant=opened.tenant, model=opened.model,
                          priority=opened.priority, tokens=tokens))

    def keep(self, answer: _Answer) -> None:
        """Kept here (this replica answers its own callers at once) and, with the next flush, in Redis (for every
        other replica)."""
        key = self._key(answer.tenant, answer.request_id)
        self._local[key] = answer
        if self.redis is None:
            return
        if len(self._pending) >= self.settings.feedback.max_local:  # Redis is far behind: the oldest goes local-only
            self._pending.pop(next(iter(self._pending)))
        self._pending[key] = json.dumps(asdict(answer))
        self._tenants[key] = answer.tenant
        if self._flush is None or self._flush.done():
            self._flush = asyncio.get_running_loop().create_task(self._write())

    async def _write(self) -> None:
        """Writes what was kept since the last flush, every ``feedback_flush_s`` while there is any."""
        while self._pending:
            await asyncio.sleep(self.settings.feedback.flush_s)
            batch, self._pending = self._pending, {}
            tenants, self._tenants = self._tenants, {}
            try:
                batch = await self._admitted(batch, tenants)
                async with self.redis.pipeline(transaction=False) as pipe:
                    for key, value in batch.items():
                        pipe.set(key, value, ex=int(self.settings.feedback.ttl_s))
                    await pipe.execute()
            except RedisError as err:
                log.warning("could not keep answers for feedback", extra={"answers": len(batch), "error": repr(err)})

    async def _admitted(self, batch: dict[str, str], tenants: dict[str, str]) -> dict[str, str]:
        """The answers of ``batch`` that have a place in their tenants' feedback quotas (one round trip); the
        others stay on this replica only."""
        fresh = [k for k in batch if k in tenants]
        expires_at = time.time() + self.settings.feedback.ttl_s
        granted = await self.ledger.reserve_many(
            [(tenants[k], "feedback", k, expires_at, self.quota_of(tenants[k])) for k in fresh])
        refused = {k for k, ok in zip(fresh, granted, strict=True) if not ok}
        if refused:
            log.warning("answers kept for feedback on this replica only: their tenants' feedback quotas are full",
                        extra={"answers": len(refused)})
        return {k: v for k, v in batch.items() if k not in refused}

    async def settle(self) -> None:
        """Waits (up to 5 s) for the answers still to be written (at shutdown)."""
        if self._flush is not None and not self._flush.done():
            await asyncio.wait({self._flush}, timeout=5)

    async def _take(self, tenant: str, request_id: str) -> tuple[bool, _Answer | None]:
        """(known, the answer if its goodput is still to be judged); a second verdict finds it taken."""
        key = self._key(tenant, request_id)
        local = self._local.get(key)
        if local is not None:
            if local.tokens:
                self._local[key] = _Answer(**{**asdict(local), "tokens": 0})
            if key in self._pending:  # not in Redis yet: it goes there taken
                self._pending[key] = json.dumps({"taken": True})
            elif self.redis is not None:  # taken for the other replicas too
                await self._redis_take(key)
            return True, local if local.tokens else None
        if self.redis is None:
            return False, None
        raw = await self._redis_take(key)
        if raw is None:
            return False, None
        data = json.loads(raw)
        return True, (None if data.get("taken") else _Answer(**data))

    async def _redis_take(self, key: str) -> Any:
        try:
            return await self.redis.set(key, json.dumps({"taken": True}), xx=True, get=True, keepttl=True)
        except RedisError as err:
            raise Unavailable(f"the feedback store is unavailable: {err}", code="store_unavailable") from None

    async def record(self, tenant: str, request_id: str, verdict: Verdict) -> dict[str, Any]:
        """The verdict on the answer ``request_id`` names (its request id, or the answer's own id)."""
        known, answer = False, None
        for candidate in request_ids(request_id):
            known, answer = await self._take(tenant, candidate)
            if known:
                break
        if not known:
            raise NotFound(f"no answer {request_id!r} of this tenant in the last {self.settings.feedback.ttl_s:g} s",
                           param="request_id")
        self.metrics.feedback.labels(verdict).inc()
        withdrawn = 0
        if answer is not None and verdict != "used" and answer.tokens:
            withdrawn = answer.tokens
            self.metrics.discarded_tokens.labels(priority_name(answer.priority), self.metrics.tenant_label(tenant),
                                                 answer.model).inc(withdrawn)
        return {"object": "feedback", "request_id": request_id, "verdict": verdict,
                "goodput_tokens_withdrawn": withdrawn}
