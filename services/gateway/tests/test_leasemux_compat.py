"""A gateway of this release against a scheduler of an earlier one (a rolling upgrade that reached the gateways first):
the scheduler answers LeaseBatches with UNIMPLEMENTED, and the gateway's lease stream goes on with Leases, one lease
message per gRPC message, without failing the admissions that were waiting.

The earlier scheduler is a stand-in over gRPC on localhost: the generated servicer with only ``Leases`` implemented
(every other method UNIMPLEMENTED, as a scheduler that predates them answers), granting every admit on one worker.
The batched conversation against the real scheduler is tested in services/scheduler/tests/test_mux.py and, through
this same LeaseStream, in tests/integration/test_lease_stream.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
from goodput.common.v1 import types_pb2
from goodput.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc

from goodput_gateway.leasemux import LeaseStream

WORKER = "127.0.0.1:1"


class EarlierScheduler(scheduler_pb2_grpc.SchedulerServicer):
    """Leases only: admit -> granted, release -> released."""

    def __init__(self) -> None:
        self.streams = 0
        self.held: set[str] = set()

    async def Leases(self, request_iterator: AsyncIterator[scheduler_pb2.LeaseMuxRequest],
                     context: grpc.aio.ServicerContext) -> AsyncIterator[scheduler_pb2.LeaseMuxEvent]:
        self.streams += 1
        async for msg in request_iterator:
            kind = msg.WhichOneof("kind")
            if kind == "admit":
                self.held.add(msg.lease_id)
                yield scheduler_pb2.LeaseMuxEvent(lease_id=msg.lease_id, granted=scheduler_pb2.Granted(
                    worker_id="w0", address=WORKER))
            elif kind in ("release", "cancel"):
                self.held.discard(msg.lease_id)
                yield scheduler_pb2.LeaseMuxEvent(lease_id=msg.lease_id, released=scheduler_pb2.Released())


async def test_an_earlier_scheduler_without_lease_batches_is_served_on_leases() -> None:
    earlier = EarlierScheduler()
    server = grpc.aio.server()
    scheduler_pb2_grpc.add_SchedulerServicer_to_server(earlier, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    leases = LeaseStream(scheduler_pb2_grpc.SchedulerStub(channel))
    admit = scheduler_pb2.Admit(request_id="r", tenant="t", priority=types_pb2.PRIORITY_P0)
    try:
        # admissions waiting when the UNIMPLEMENTED comes are admitted again on Leases, not failed
        granted = await asyncio.gather(*(leases.acquire(f"a{i}", admit, timeout_s=10) for i in range(3)))
        assert [g.address for g in granted] == [WORKER] * 3
        assert earlier.held == {"a0", "a1", "a2"}
        leases.first_token("a0", 0.01)
        await leases.release("a0", scheduler_pb2.Release(outcome=scheduler_pb2.OUTCOME_OK))
        assert earlier.held == {"a1", "a2"}
        # later admissions go straight to Leases, on the same stream
        assert (await leases.acquire("b", admit, timeout_s=10)).worker_id == "w0"
        assert earlier.streams == 1
    finally:
        await leases.close()
        await channel.close()
        await server.stop(None)
