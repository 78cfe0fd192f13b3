"""The gateway's request metrics, and the wrapper that times a token stream (TTFT, ITL, end to end).

Example: the service wraps a live stream as ``timed(stream.events(), metrics, priority="P0", arrived=arrived)``;
the events pass unchanged, and the first token is one time-to-first-token sample.

    >>> import asyncio
    >>> registry = CollectorRegistry()
    >>> metrics = GatewayMetrics(registry)
    >>> async def answer() -> AsyncIterator[TextDelta | StreamEnd]:
    ...     yield TextDelta("Hi")
    ...     yield TextDelta(" there")
    ...     yield StreamEnd(finish_reason="stop", prompt_tokens=3, completion_tokens=2)
    >>> async def consume() -> list[TextDelta | StreamEnd]:
    ...     return [event async for event in timed(answer(), metrics, priority="P0", arrived=time.monotonic())]
    >>> [type(event).__name__ for event in asyncio.run(consume())]
    ['TextDelta', 'TextDelta', 'StreamEnd']
    >>> [registry.get_sample_value(f"goodput_gateway_{name}_seconds_count", {"priority": "P0"})
    ...  for name in ("ttft", "itl", "e2e")]
    [1.0, 1.0, 1.0]
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from prometheus_client import CollectorRegistry, Counter, Histogram

from goodput_core.metrics import LATENCY_BUCKETS

from goodput_gateway.events import StreamEnd, TextDelta

__all__ = ["GatewayMetrics", "timed"]

ITL_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.02, 0.035, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)


class GatewayMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter("goodput_gateway_requests_total", "Requests by route, status and priority.",
                                ["route", "code", "priority"], registry=registry)
        self.ttft = Histogram("goodput_gateway_ttft_seconds", "Time to first token, from arrival.", ["priority"],
                              buckets=LATENCY_BUCKETS, registry=registry)
        self.itl = Histogram("goodput_gateway_itl_seconds", "Time between streamed chunks.", ["priority"],
                             buckets=ITL_BUCKETS, registry=registry)
        self.e2e = Histogram("goodput_gateway_e2e_seconds", "Request duration, arrival to last token.",
                             ["priority"], buckets=LATENCY_BUCKETS, registry=registry)
        self.stage = Histogram("goodput_gateway_hop_seconds", "Latency of the gateway's own steps (auth, validate, "
                               "cache, retrieve, schedule); the per-class breakdown is goodput_gateway_stage_seconds.",
                               ["stage"], buckets=LATENCY_BUCKETS, registry=registry)
        self.model_fallbacks = Counter("goodput_gateway_model_fallbacks_total", "Requests answered by the lighter "
                                       "model MODEL_FALLBACKS names, by the model asked for, the one that answered "
                                       "and why (saturated, down).", ["asked", "served", "reason"], registry=registry)
        self.auto_choices = Counter("goodput_gateway_auto_choices_total", 'Requests for model "auto", by the model '
                                    "and pool chosen and why (cheapest_meeting_slo, none_meets_slo).",
                                    ["model", "pool", "reason"], registry=registry)
        self.auto_prediction = Histogram("goodput_gateway_auto_prediction_ratio", 'Model "auto": actual / predicted '
                                         "TTFT (from arrival) and TPOT of the answers it routed: the predictor's "
                                         "error (1 = exact).", ["quantity"],
                                         buckets=(0.25, 0.5, 0.67, 0.8, 0.9, 1.0, 1.1, 1.25, 1.5, 2.0, 4.0, 10.0),
                                         registry=registry)
        self.speculative_starts = Counter(
            "goodput_gateway_speculative_starts_total", "Worker calls started while their lease was being granted "
            "(SPECULATIVE_START), by result: hit (granted on that worker), miss (granted elsewhere: cancelled), "
            "queued (the lease waited in the scheduler's queue: cancelled then), refused (the lease was not "
            "granted: cancelled).", ["result"], registry=registry)
        self.token_gate_parked = Counter(
            "goodput_gateway_token_gate_parked_total", "Later tokens (after a stream's first) relayed in a later "
            "event-loop turn than the one they came in, behind a turn's share of others (goodput_gateway.tokengate).",
            registry=registry)
        self.worker_failures = Counter("goodput_gateway_worker_failures_total",
                                       "Worker calls lost (before or after the first token).", ["phase"],
                                       registry=registry)
        self.poison_requests = Counter(
            "goodput_gateway_poison_requests_total", "Requests suspected of crashing their inference worker "
            "(goodput_gateway.quarantine), by event: crashed_alone (its worker was lost after accepting it, holding "
            "no other request), crashed_again (the second worker lost with the same request within QUARANTINE__TTL_S) "
            "- each ended with 422 request_quarantined, not retried nor parked, and quarantined; refused (a "
            "quarantined request sent again, refused before reaching a worker).", ["event"], registry=registry)
        self.preempted = Counter("goodput_gateway_preempted_total", "Requests whose lease the scheduler took back "
                                 "(fair share), by when: before_first_token (admitted and started again) or mid_stream "
                                 "(admitted again, the answer continued from the tokens sent); never lost.", ["stage"],
                                 registry=registry)


async def timed(events: AsyncIterator[TextDelta | StreamEnd], metrics: GatewayMetrics, *, priority: str,
                arrived: float) -> AsyncIterator[TextDelta | StreamEnd]:
    """``events`` unchanged, observing time to first token, time between tokens and time to the end."""
    itl = metrics.itl.labels(priority)  # once per request, not per token
    last: float | None = None
    async for event in events:
        now = time.monotonic()
        if isinstance(event, TextDelta):
            if last is None:
                metrics.ttft.labels(priority).observe(now - arrived)
            else:
                itl.observe(now - last)
            last = now
        else:
            metrics.e2e.labels(priority).observe(now - arrived)
        yield event
