"""Thin gRPC servicer: proto <-> engine types. No engine-specific code here."""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import asdict

from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from grpc import aio
from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, InfoMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from goodput_core.context import request_context
from goodput_core.errors import Unavailable
from goodput_core.sampling import logprobs_to_proto, sampling_from_proto

from goodput_inference.engine import ChatTurn, Delta, Engine, Finished, GenRequest, Started, ToolCall
from goodput_inference.progress import Progress

log = logging.getLogger("goodput.inference")

_FINISH = {"stop": types_pb2.FINISH_REASON_STOP, "length": types_pb2.FINISH_REASON_LENGTH,
           "abort": types_pb2.FINISH_REASON_ABORT}


def to_gen_request(req: inference_pb2.GenerateRequest) -> GenRequest:
    messages = tuple(ChatTurn(m.role, m.content, m.name, tool_call_id=m.tool_call_id,
                              tool_calls=tuple(ToolCall(c.id, c.name, c.arguments) for c in m.tool_calls))
                     for m in req.messages)
    return GenRequest(request_id=req.request_id, messages=messages, prompt=req.prompt,
                      sampling=sampling_from_proto(req.sampling), priority=int(req.priority), model=req.model,
                      tenant=req.tenant, tools=req.tools, parallel_tool_calls=req.parallel_tool_calls,
                      continuation=tuple(req.continue_token_ids))


PEAK_WINDOW_S = 10.0  # goodput_worker_peak_tokens_per_second: the best rate sustained over this long


class WorkerMetrics:
    """The worker's metrics. ``clock`` (monotonic seconds) times the engine's busy time and the token rate; tests
    pass their own."""

    def __init__(self, registry: CollectorRegistry, engine: Engine, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.requests = Counter("goodput_worker_requests_total", "Generate calls by outcome.", ["outcome"],
                                registry=registry)
        self.prompt_tokens = Counter("goodput_worker_prompt_tokens_total", "Prompt tokens processed.",
                                     registry=registry)
        self.generated_tokens = Counter("goodput_worker_generated_tokens_total", "Tokens generated.", registry=registry)
        # What finished requests' usage reported as cached (the sum of Usage.cached_tokens, as the gateway meters
        # it); goodput_worker_prefix_cache_hits_total is the engine's own count of lookups, aborted requests' too.
        self.cached_prompt_tokens = Counter(
            "goodput_worker_cached_prompt_tokens_total",
            "Prompt tokens of finished requests whose KV came from the prefix cache (reported in their usage).",
            registry=registry)
        for name, doc, attr in (
            ("goodput_worker_running_requests", "Sequences being decoded.", "running"),
            ("goodput_worker_waiting_requests", "Sequences waiting in the engine.", "waiting"),
            ("goodput_worker_kv_cache_usage_ratio", "Fraction of KV-cache blocks in use.", "kv_cache_usage"),
            ("goodput_worker_gpu_utilization_ratio", "GPU utilisation (NVML), -1 without a GPU.",
             "gpu_utilization"),
        ):
            Gauge(name, doc, registry=registry).set_function(_load_reader(engine, attr))
        registry.register(_EngineInfo(engine))
        self.busy = BusyClock(now=clock)
        registry.register(_Counters(engine, self.busy))
        # Runtime efficiency: rate(goodput_worker_generated_tokens_total) over the best rate this worker has shown.
        self.peak = PeakRate(window_s=PEAK_WINDOW_S, now=clock)
        Gauge("goodput_worker_peak_tokens_per_second",
              f"Highest output tokens per second the worker sustained over any {PEAK_WINDOW_S:g}-second window since "
              "it started (tokens counted as they are generated, by each request's stream, aborted requests' too; "
              "windows on whole seconds since start; 0 until the first window has passed). "
              "rate(goodput_worker_generated_tokens_total) / this is the runtime efficiency.",
              registry=registry).set_function(self.peak.rate)

    def generated(self, tokens_so_far: int, counted: int) -> int:
        """A request's stream reports ``tokens_so_far`` output tokens, ``counted`` of which the token rate has seen:
        the rest count now. Returns what is counted for the request from now on."""
        if tokens_so_far > counted:
            self.peak.add(tokens_so_far - counted)
            return tokens_so_far
        return counted


class _EngineInfo(Collector):
    """``goodput_worker_engine_info``: the engine's numerics (device, dtype, KV-cache dtype, CPU vendor/model/ISA,
    AMX and AVX-512 present, attention kernel) as labels, read at scrape time, so a report or a dashboard can say
    what a number was measured on. Absent until the engine has started."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def describe(self) -> list[Metric]:
        return []  # labels are known only once the engine has started

    def collect(self) -> Iterator[Metric]:
        labels = self.engine.numerics()
        if labels:
            family = InfoMetricFamily("goodput_worker_engine", "What the engine computes with.")
            family.add_metric([], labels)
            yield family


class _Counters(Collector):
    """Counters read at scrape time: ``goodput_worker_prefix_cache_queries_total`` and ``..._hits_total``, prompt
    tokens the engine looked up in its prefix cache since start, and those it found (reuse is per tenant: a hit is
    always the tenant's own prefix or its sharing group's); ``goodput_worker_engine_busy_seconds_total``."""

    def __init__(self, engine: Engine, busy: BusyClock) -> None:
        self.engine = engine
        self.busy = busy

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        load = self.engine.load()
        yield CounterMetricFamily("goodput_worker_prefix_cache_queries", "Prompt tokens looked up in the prefix "
                                  "cache.", value=load.prefix_cache_queries)
        yield CounterMetricFamily("goodput_worker_prefix_cache_hits", "Prompt tokens found in the prefix cache "
                                  "(their prefill was skipped).", value=load.prefix_cache_hits)
        yield CounterMetricFamily("goodput_worker_engine_busy_seconds", "Seconds the engine had at least one "
                                  "request (goodput per engine-second divides by this).", value=self.busy.seconds())


class BusyClock:
    """Engine-seconds with at least one request in the engine: the denominator of goodput per engine-second (and,
    against the scheduler's queue, of the time the engine idled while work waited).

    >>> now = iter([1.0, 3.0, 5.0, 6.0]).__next__
    >>> busy = BusyClock(now=now)
    >>> busy.enter(); busy.enter(); busy.leave(); busy.leave()  # two requests overlapping: busy from 1.0 to 3.0
    >>> busy.seconds(), busy.enter(), busy.seconds()  # a third from 5.0, still running at 6.0
    (2.0, None, 3.0)
    """

    def __init__(self, now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._active = 0
        self._since = 0.0
        self._total = 0.0

    def enter(self) -> None:
        if self._active == 0:
            self._since = self._now()
        self._active += 1

    def leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._total += self._now() - self._since

    def seconds(self) -> float:
        return self._total + (self._now() - self._since if self._active else 0.0)


class PeakRate:
    """The highest rate a growing count sustained over any ``window_s`` since start. The count is tallied in
    ``step_s`` buckets as it grows; each time a bucket closes, the last ``window_s / step_s`` closed buckets are
    summed, so every window of whole steps since start is looked at once, and only whole windows: the rate reads 0
    until ``window_s`` has passed. No task samples anything: buckets close when the count grows or the rate is read,
    on the clock ``now``. (A counter sampled at scrape time could not see a 10-second window, and one that grows when
    requests finish would read a burst of completions as speed.)

    >>> t = [0.0]
    >>> peak = PeakRate(window_s=10, now=lambda: t[0])
    >>> for second in range(30):   # 100 tokens a second for 10 s, 300 a second for 5 s, then nothing
    ...     t[0] = second + 0.5
    ...     peak.add(100 if second < 10 else 300 if second < 15 else 0)
    >>> peak.rate()                # up to 29 s: the best 10 s were five at 100 and five at 300
    200.0
    >>> t[0] = 1000.0
    >>> peak.add(50); peak.rate()  # an idle stretch and a little work change nothing
    200.0
    """

    def __init__(self, *, window_s: float = 10.0, step_s: float = 1.0,
                 now: Callable[[], float] = time.monotonic) -> None:
        self._now = now
        self._step = step_s
        self._slots = max(round(window_s / step_s), 1)
        self.window_s = self._slots * step_s
        self._start = now()
        self._bucket = 0  # the open bucket: [start + bucket * step, start + (bucket + 1) * step)
        self._open = 0
        self._closed: collections.deque[int] = collections.deque()  # the last ``slots`` closed buckets
        self._sum = 0  # of _closed
        self._peak = 0  # the best sum of ``slots`` consecutive closed buckets
        self._lock = threading.Lock()  # a scrape may read from another thread

    def add(self, count: int) -> None:
        with self._lock:
            self._roll()
            self._open += count

    def rate(self) -> float:
        """The best count per second over a whole window so far."""
        with self._lock:
            self._roll()
            return self._peak / self.window_s

    def _roll(self) -> None:
        bucket = int((self._now() - self._start) // self._step)
        if bucket <= self._bucket:
            return
        self._close(self._open)
        for _ in range(min(bucket - self._bucket - 1, self._slots)):  # buckets in which nothing came
            self._close(0)
        self._bucket, self._open = bucket, 0

    def _close(self, count: int) -> None:
        self._closed.append(count)
        self._sum += count
        if len(self._closed) > self._slots:
            self._sum -= self._closed.popleft()
        if len(self._closed) == self._slots:
            self._peak = max(self._peak, self._sum)


def _load_reader(engine: Engine, attr: str) -> Callable[[], float]:
    return lambda: float(getattr(engine.load(), attr))


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, engine: Engine, *, worker_id: str, metrics: WorkerMetrics, pool: str = "default",
                 pool_classes: str = "", aliases: str = "", cost_per_hour: float = 0.0,
                 progress: Progress | None = None) -> None:
        self.engine = engine
        self.worker_id = worker_id
        self.metrics = metrics
        self.pool = pool  # reported in ModelInfo: the scheduler's serves_class filter reads it
        self.pool_classes = [f"PRIORITY_{c}" for c in pool_classes.split(",") if c]  # "P0,P1" -> enum names
        self.aliases = [a.strip() for a in aliases.split(",") if a.strip()]  # other names of the model (ModelInfo)
        self.cost_per_hour = cost_per_hour  # the pool's price (ModelInfo): what model "auto" weighs
        self.progress = progress or Progress(stall_after_s=0.0)  # tokens coming, or a hung engine
        self.draining = False

    async def Generate(self, request: inference_pb2.GenerateRequest,
                       context: aio.ServicerContext) -> AsyncIterator[inference_pb2.GenerateChunk]:
        """One request's chunks (``started``, deltas, ``finished``)."""
        if self.draining:
            raise Unavailable("worker is draining")
        gen = to_gen_request(request)
        outcome = "aborted"
        # of this request's output tokens, those the peak token rate has seen (a continuation's earlier ones were, by
        # the worker that generated them)
        counted = len(gen.continuation)
        with request_context(request_id=gen.request_id, tenant=gen.tenant or None):
            self.metrics.busy.enter()
            self.progress.begin()
            try:
                async for event in self.engine.generate(gen):
                    if not isinstance(event, Started):  # the adapter's, before the engine sees it: no progress
                        self.progress.advance()
                    if isinstance(event, Delta):
                        counted = self.metrics.generated(event.completion_tokens, counted)
                        yield inference_pb2.GenerateChunk(delta=inference_pb2.Delta(
                            text=event.text, completion_tokens=event.completion_tokens,
                            logprobs=logprobs_to_proto(event.logprobs), index=event.index,
                            prompt_logprobs=logprobs_to_proto(event.prompt_logprobs), token_ids=event.token_ids))
                    elif isinstance(event, Started):
                        self.metrics.prompt_tokens.inc(event.prompt_tokens)
                        yield inference_pb2.GenerateChunk(started=inference_pb2.Started(
                            prompt_tokens=event.prompt_tokens, worker_id=self.worker_id))
                    elif isinstance(event, Finished):
                        outcome = "finished"
                        counted = self.metrics.generated(event.completion_tokens, counted)
                        self.metrics.generated_tokens.inc(event.completion_tokens - len(gen.continuation))
                        # a continuation's hits beyond the prompt are on the answer's own tokens: not the caller's
                        cached = min(event.cached_tokens, event.prompt_tokens)
                        self.metrics.cached_prompt_tokens.inc(cached)
                        usage = types_pb2.Usage(prompt_tokens=event.prompt_tokens,
                                                completion_tokens=event.completion_tokens,
                                                total_tokens=event.prompt_tokens + event.completion_tokens,
                                                cached_tokens=cached)
                        yield inference_pb2.GenerateChunk(finished=inference_pb2.Finished(
                            finish_reason=_FINISH[event.reason], usage=usage,
                            choice_finish_reasons=[_FINISH[r] for r in event.reasons],
                            tool_calls=[types_pb2.ToolCall(id=c.id, name=c.name, arguments=c.arguments)
                                        for c in event.tool_calls],
                            timing=inference_pb2.EngineTiming(**asdict(event.timing)) if event.timing else None))
            except Exception:
                outcome = "error"
                raise
            finally:
                self.progress.end()
                self.metrics.busy.leave()
                self.metrics.requests.labels(outcome).inc()
                if outcome == "aborted":
                    log.info("generation aborted: the caller went away")

    async def GetLoad(self, request: inference_pb2.GetLoadRequest,
                      context: aio.ServicerContext) -> inference_pb2.WorkerLoad:
        load = self.engine.load()
        return inference_pb2.WorkerLoad(
            running=load.running, waiting=load.waiting, kv_cache_usage=load.kv_cache_usage,
            gpu_utilization=load.gpu_utilization, max_num_seqs=load.max_num_seqs,
            aborted_total=load.aborted_total, finished_total=load.finished_total,
            ready=load.ready and not self.draining, stalled_s=self.progress.stalled_s())

    async def GetModelInfo(self, request: inference_pb2.GetModelInfoRequest,
                           context: aio.ServicerContext) -> inference_pb2.ModelInfo:
        d = self.engine.describe()
        return inference_pb2.ModelInfo(served_model_name=d.served_model_name, model=d.model,
                                       max_model_len=d.max_model_len, max_prompt_tokens=d.max_prompt_tokens,
                                       engine=d.engine, model_version=d.model_version,
                                       max_num_batched_tokens=d.max_num_batched_tokens,
                                       tool_call_parser=d.tool_call_parser, pool=self.pool,
                                       pool_classes=self.pool_classes, aliases=self.aliases,
                                       cost_per_hour=self.cost_per_hour, continues=d.continues)
