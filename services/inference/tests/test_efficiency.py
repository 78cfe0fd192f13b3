"""Runtime-level efficiency: goodput_worker_peak_tokens_per_second, the best output-token rate the worker sustained
over any 10-second window, against which a dashboard reads rate(goodput_worker_generated_tokens_total). Time is an
injected clock that the stand-in engine moves as it streams."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2
from prometheus_client import CollectorRegistry

from goodput_inference.engine import Delta, Finished, GenEvent, GenRequest, Load, Started
from goodput_inference.servicer import InferenceServicer, PeakRate, WorkerMetrics

PEAK = "goodput_worker_peak_tokens_per_second"


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


class ScriptedEngine:
    """Plays each request's script of (time, event), moving the clock to each event's time before it yields it."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.scripts: dict[str, list[tuple[float, GenEvent]]] = {}

    def load(self) -> Load:
        return Load(running=0, waiting=0, kv_cache_usage=0.0, gpu_utilization=-1.0, max_num_seqs=8, aborted_total=0,
                    finished_total=0, ready=True)

    def numerics(self) -> dict[str, str]:
        return {}

    async def generate(self, request: GenRequest) -> AsyncIterator[GenEvent]:
        for at, event in self.scripts[request.request_id]:
            self.clock.t = at
            yield event


def streaming(start: float, seconds: int, per_second: int, *, finish_at: float) -> list[tuple[float, GenEvent]]:
    """A request that streams ``per_second`` tokens a second (one delta a second) and then finishes."""
    script: list[tuple[float, GenEvent]] = [(start, Started(prompt_tokens=10))]
    script += [(start + k + 0.5, Delta(text="x", completion_tokens=per_second * (k + 1))) for k in range(seconds)]
    return [*script, (finish_at, Finished(reason="length", prompt_tokens=10, completion_tokens=per_second * seconds))]


async def generate(servicer: InferenceServicer, request_id: str) -> None:
    request = inference_pb2.GenerateRequest(request_id=request_id, prompt="hi",
                                            sampling=types_pb2.SamplingParams(max_tokens=1000))
    context: Any = None  # the servicer does not read it
    async for _ in servicer.Generate(request, context):
        pass


async def test_the_peak_is_the_rate_the_tokens_were_streamed_at_not_when_requests_finished() -> None:
    clock, registry = Clock(), CollectorRegistry()
    engine = ScriptedEngine(clock)
    metrics = WorkerMetrics(registry, engine, clock=clock)  # type: ignore[arg-type]
    servicer = InferenceServicer(engine, worker_id="w1", metrics=metrics)  # type: ignore[arg-type]
    # 40 tokens a second for 20 s; the generated-token counter gets all 800 when the request finishes.
    engine.scripts["steady"] = streaming(0.0, 20, 40, finish_at=20.2)
    await generate(servicer, "steady")
    clock.t = 21.0
    assert registry.get_sample_value("goodput_worker_generated_tokens_total") == 800
    assert registry.get_sample_value(PEAK) == 40  # not 80: the 800 tokens took 20 s, not one
    # Output only the final event reports (no delta carried it) counts when it comes: 600 tokens in second 30.
    engine.scripts["held"] = [(30.0, Started(prompt_tokens=10)),
                              (30.5, Finished(reason="stop", prompt_tokens=10, completion_tokens=600))]
    await generate(servicer, "held")
    clock.t = 41.0
    assert registry.get_sample_value(PEAK) == 60  # 600 tokens in any window that holds second 30
    assert registry.get_sample_value("goodput_worker_generated_tokens_total") == 1400


def test_the_peak_reads_zero_until_a_whole_window_has_passed() -> None:
    clock = Clock()
    peak = PeakRate(window_s=10, now=clock)
    for second in range(10):
        clock.t = second + 0.5
        peak.add(30)
    assert peak.rate() == 0  # at 9.5 s: seconds 0 to 9 are not all over yet
    clock.t = 10.0
    assert peak.rate() == 30


def test_a_burst_counts_averaged_over_its_window_and_the_peak_never_falls() -> None:
    clock = Clock()
    peak = PeakRate(window_s=10, now=clock)
    clock.t = 3.2
    peak.add(1000)  # 1000 tokens within one second
    clock.t = 20.0
    assert peak.rate() == 100  # sustained over 10 s, that is 100 a second
    clock.t = 25.5
    peak.add(600)
    clock.t = 35.5
    peak.add(600)  # seconds 25 and 35 never share a window: 60 a second at best
    clock.t = 36.0
    assert peak.rate() == 100
    clock.t = 44.5
    peak.add(600)  # seconds 35 and 44 share the window of seconds 35 to 44: 1200 tokens in 10 s
    clock.t = 500.0
    assert peak.rate() == 120  # long after, and idle since: still the best the worker has shown
