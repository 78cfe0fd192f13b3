"""Many generations over one ``GenerateBatches`` stream, against the real servicer (simulated engine) on a localhost
socket: each generation reads as its own Generate call would, a cancel or the stream's end aborts in the engine, and
every refusal is that generation's error alone."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from grpc import aio
from prometheus_client import CollectorRegistry

from goodput_core.errors import ErrorInterceptor
from goodput_testing import async_wait_until

from goodput_inference.config import InferenceSettings
from goodput_inference.servicer import InferenceServicer, WorkerMetrics
from goodput_inference.sim_engine import SimEngine, SimParams

Mux = inference_pb2.GenerateMuxRequest


class Worker:
    def __init__(self, stub: inference_pb2_grpc.InferenceStub, servicer: InferenceServicer,
                 engine: SimEngine) -> None:
        self.stub, self.servicer, self.engine = stub, servicer, engine


@pytest.fixture
async def worker() -> AsyncIterator[Worker]:
    engine = SimEngine(InferenceSettings(engine="sim", max_model_len=4096, max_num_seqs=64),
                       params=SimParams(time_scale=0.05))
    servicer = InferenceServicer(engine, worker_id="w1", metrics=WorkerMetrics(CollectorRegistry(), engine),
                                 mux_max_generations=4, mux_max_batch=8)
    server = aio.server(interceptors=[ErrorInterceptor()])
    inference_pb2_grpc.add_InferenceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await engine.start()
    await server.start()
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield Worker(inference_pb2_grpc.InferenceStub(channel), servicer, engine)
    finally:
        await channel.close()
        await server.stop(None)
        await engine.shutdown()


def _request(i: int, max_tokens: int = 6, prompt: str = "") -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(request_id=f"r{i}", prompt=prompt or f"question number {i}", tenant="acme",
                                         sampling=types_pb2.SamplingParams(max_tokens=max_tokens, temperature=0.0))


class Stream:
    """One GenerateBatches call: send batches, read each generation's events by stream id."""

    def __init__(self, stub: inference_pb2_grpc.InferenceStub) -> None:
        self.out: asyncio.Queue[inference_pb2.GenerateMuxBatch | None] = asyncio.Queue()
        self.call = stub.GenerateBatches(self._requests())
        self.events: dict[str, list[inference_pb2.GenerateMuxEvent]] = {}
        self.messages = 0
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _requests(self) -> AsyncIterator[inference_pb2.GenerateMuxBatch]:
        while (batch := await self.out.get()) is not None:
            yield batch

    async def _read(self) -> None:
        async for batch in self.call:
            self.messages += 1
            for event in batch.events:
                self.events.setdefault(event.stream_id, []).append(event)

    def send(self, *requests: inference_pb2.GenerateMuxRequest) -> None:
        self.out.put_nowait(inference_pb2.GenerateMuxBatch(requests=list(requests)))

    def ended(self, stream_id: str) -> bool:
        events = self.events.get(stream_id, [])
        return bool(events) and (events[-1].WhichOneof("kind") in ("error", "end")
                                 or events[-1].chunk.HasField("finished"))

    async def wait_ended(self, *stream_ids: str) -> None:
        await async_wait_until(lambda: all(self.ended(s) for s in stream_ids), timeout=20, interval=0.01,
                               message=f"generations {stream_ids} ended")

    def error(self, stream_id: str) -> inference_pb2.GenerateError:
        last = self.events[stream_id][-1]
        assert last.WhichOneof("kind") == "error", last
        return last.error


async def test_generations_on_one_stream_read_as_their_own_generate_calls_would(worker: Worker) -> None:
    direct = [[c async for c in worker.stub.Generate(_request(i))] for i in range(3)]
    stream = Stream(worker.stub)
    try:
        stream.send(*(Mux(stream_id=f"g{i}", start=_request(i), timeout_s=30) for i in range(3)))
        await stream.wait_ended("g0", "g1", "g2")
        for i in range(3):
            chunks = [e.chunk for e in stream.events[f"g{i}"]]
            assert [c.WhichOneof("kind") for c in chunks] == [c.WhichOneof("kind") for c in direct[i]]
            assert "".join(c.delta.text for c in chunks) == "".join(c.delta.text for c in direct[i])
            assert chunks[-1].finished.usage.completion_tokens == 6
        # the three generations' chunks shared messages (one write carries what queued up behind the previous)
        assert stream.messages < sum(len(v) for v in stream.events.values())
    finally:
        stream.out.put_nowait(None)
        await stream.reader


async def test_a_cancel_and_the_streams_end_abort_in_the_engine(worker: Worker) -> None:
    stream = Stream(worker.stub)
    aborted = worker.engine.load().aborted_total
    stream.send(*(Mux(stream_id=f"long{i}", start=_request(i, max_tokens=2000), timeout_s=60) for i in range(3)))
    await async_wait_until(lambda: all(len(stream.events.get(f"long{i}", [])) > 2 for i in range(3)), timeout=20,
                           interval=0.01, message="three generations streaming")
    stream.send(Mux(stream_id="long0", cancel=inference_pb2.GenerateCancel()))
    await async_wait_until(lambda: worker.engine.load().aborted_total == aborted + 1, timeout=10, interval=0.01,
                           message="the cancelled generation aborted")
    assert worker.engine.load().running == 2
    # the caller goes away: both generations still open are aborted, nothing left running
    stream.call.cancel()
    await async_wait_until(lambda: worker.engine.load().running == 0, timeout=10, interval=0.01,
                           message="nothing running once the stream ended")
    assert worker.engine.load().aborted_total == aborted + 3


async def test_every_refusal_is_its_generations_error_alone(worker: Worker) -> None:
    stream = Stream(worker.stub)
    try:
        stream.send(Mux(stream_id="", start=_request(0)),
                    Mux(stream_id="too-long", start=_request(1, prompt="word " * 20_000), timeout_s=30),
                    Mux(stream_id="nan", start=_request(2), timeout_s=float("nan")),
                    Mux(stream_id="late", start=_request(3, max_tokens=2000), timeout_s=0.05),
                    Mux(stream_id="ok", start=_request(4), timeout_s=30))
        await stream.wait_ended("", "too-long", "nan", "late", "ok")
        assert stream.error("").status == "INVALID_ARGUMENT" and stream.error("").param == "stream_id"
        too_long = stream.error("too-long")
        assert too_long.status == "INVALID_ARGUMENT" and too_long.code == "context_length_exceeded"
        assert stream.error("nan").param == "timeout_s"
        assert stream.error("late").status == "DEADLINE_EXCEEDED"
        assert stream.events["ok"][-1].chunk.finished.usage.completion_tokens == 6

        # a generation's id is unique among the open ones; the open ones are bounded (4 here)
        stream.send(*(Mux(stream_id=f"held{i}", start=_request(i, max_tokens=2000), timeout_s=60) for i in range(4)))
        stream.send(Mux(stream_id="held0", start=_request(9)), Mux(stream_id="fifth", start=_request(9)))
        await stream.wait_ended("fifth")
        assert stream.error("fifth").status == "RESOURCE_EXHAUSTED"
        assert stream.error("fifth").code == "too_many_generations"
        assert any(e.WhichOneof("kind") == "error" and e.error.param == "stream_id" for e in stream.events["held0"])
        for i in range(4):
            stream.send(Mux(stream_id=f"held{i}", cancel=inference_pb2.GenerateCancel()))

        # a draining worker starts nothing new (the gateway tries another)
        worker.servicer.draining = True
        stream.send(Mux(stream_id="drained", start=_request(5)))
        await stream.wait_ended("drained")
        assert stream.error("drained").status == "UNAVAILABLE"
    finally:
        stream.out.put_nowait(None)
        await stream.reader


async def test_a_batch_over_the_bound_ends_the_stream(worker: Worker) -> None:
    stream = Stream(worker.stub)
    stream.send(*(Mux(stream_id=f"g{i}", start=_request(i)) for i in range(9)))  # the bound is 8
    with pytest.raises(grpc.RpcError) as err:
        await stream.reader
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "MUX_MAX_BATCH" in err.value.details()
