"""The gateway resolves a requested model by its served name or an alias its workers declare, over gRPC from the
scheduler's worker list (a stand-in scheduler serving only ListWorkers: the behaviour under test is the gateway's)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc
import pytest
from goodput.inference.v1 import inference_pb2
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from prometheus_client import CollectorRegistry

from goodput_core.errors import InvalidArgument

from goodput_gateway.config import GatewaySettings
from goodput_gateway.metrics import GatewayMetrics
from goodput_gateway.pipeline import Pipeline


class Workers(scheduler_pb2_grpc.SchedulerServicer):
    def __init__(self) -> None:
        self.workers = [
            scheduler_pb2.WorkerStatus(worker_id="small-1", healthy=True, model=inference_pb2.ModelInfo(
                served_model_name="qwen-0.5b", aliases=["chat-small", "default"], max_model_len=4096)),
            scheduler_pb2.WorkerStatus(worker_id="small-2", healthy=True, model=inference_pb2.ModelInfo(
                served_model_name="qwen-0.5b", aliases=["chat-small"], max_model_len=4096)),
            scheduler_pb2.WorkerStatus(worker_id="large-1", healthy=True, model=inference_pb2.ModelInfo(
                served_model_name="qwen-72b", aliases=["chat-large"], max_model_len=32768)),
        ]

    async def ListWorkers(self, request: scheduler_pb2.ListWorkersRequest,
                          context: grpc.aio.ServicerContext) -> scheduler_pb2.ListWorkersResponse:
        return scheduler_pb2.ListWorkersResponse(workers=self.workers)


@pytest.fixture
async def pipeline() -> AsyncIterator[Pipeline]:
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(Workers(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    yield Pipeline(GatewaySettings(), scheduler=scheduler_pb2_grpc.SchedulerStub(channel),
                   channel_factory=grpc.aio.insecure_channel, metrics=GatewayMetrics(CollectorRegistry()))
    await channel.close()
    await server.stop(None)


async def test_a_model_is_found_by_name_or_by_an_alias_every_worker_declares(pipeline: Pipeline) -> None:
    assert (await pipeline.catalogue.resolve_model("qwen-0.5b")).id == "qwen-0.5b"
    small = await pipeline.catalogue.resolve_model("chat-small")
    assert small.id == "qwen-0.5b" and small.workers == 2 and small.aliases == ("chat-small",)
    assert (await pipeline.catalogue.resolve_model("chat-large")).id == "qwen-72b"
    # "default" is declared by one of the two workers of its model only: a request could land on the other
    with pytest.raises(InvalidArgument) as err:
        await pipeline.catalogue.resolve_model("default")
    assert err.value.code == "model_not_found"
