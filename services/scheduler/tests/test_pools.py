"""Model pools: a worker's pool serves some priority classes (``ModelInfo.pool_classes``), the ``serves_class``
filter grants each class only there while such a pool is healthy, and falls back to any pool (counted) otherwise."""

from __future__ import annotations

from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2
from goodput.scheduler.v1 import scheduler_pb2
from prometheus_client import CollectorRegistry

from goodput_scheduler.config import SchedulerSettings
from goodput_scheduler.placement import CycleState, PlacementRequest, Profile, ServesClass, build_pipeline
from goodput_scheduler.registry import Worker

from .conftest import SchedulerHarness, StandInWorker, open_lease, scheduler_settings

P0, P1, P2 = types_pb2.PRIORITY_P0, types_pb2.PRIORITY_P1, types_pb2.PRIORITY_P2


def pool_worker(name: str, *classes: int, healthy: bool = True) -> Worker:
    info = inference_pb2.ModelInfo(served_model_name="m", pool=name, pool_classes=classes)  # type: ignore[arg-type]
    return Worker(worker_id=name, address=name, channel=None, healthy=healthy, model=info)


def kept(f: ServesClass, priority: int, workers: list[Worker]) -> list[str]:
    state = CycleState(PlacementRequest("r", "t", priority, "", 10, 10), workers)
    return [w.worker_id for w in f.filter(state, workers)]


def test_each_class_goes_to_the_pools_that_serve_it() -> None:
    fleet = [pool_worker("interactive", P0, P1), pool_worker("batch", P2), pool_worker("any")]
    f = ServesClass()
    assert kept(f, P0, fleet) == ["interactive", "any"]
    assert kept(f, P1, fleet) == ["interactive", "any"]
    assert kept(f, P2, fleet) == ["batch", "any"]
    # a worker that has not said (no ModelInfo yet, or an older worker) serves every class
    unknown = Worker(worker_id="old", address="old", channel=None, healthy=True)
    assert kept(f, P2, [fleet[0], unknown]) == ["old"]


def test_a_class_no_healthy_pool_serves_falls_back_to_any_pool_and_is_counted_once_per_grant() -> None:
    registry = CollectorRegistry()
    pipeline = build_pipeline(Profile.parse(""), SchedulerSettings(), registry=registry)
    assert [f.name for f in pipeline.filters][:3] == ["healthy", "serves_model", "serves_class"]
    # the interactive pool is down: P0 is still served, by the batch pool
    fleet = [pool_worker("interactive", P0, P1, healthy=False), pool_worker("batch", P2)]
    request = PlacementRequest("r1", "t", P0, "", 10, 10)
    for _ in range(3):  # placement cycles while it waits do not count; the grant does
        decision = pipeline.place(request, fleet)
    assert decision is not None and decision.worker.worker_id == "batch"
    pipeline.commit(request, decision)
    fallback = "goodput_scheduler_pool_fallback_total"
    assert registry.get_sample_value(fallback, {"priority": "P0"}) == 1.0
    # a P2 request on its own pool is no fallback
    p2 = PlacementRequest("r2", "t", P2, "", 10, 10)
    decision = pipeline.place(p2, fleet)
    assert decision is not None and decision.worker.worker_id == "batch"
    pipeline.commit(p2, decision)
    assert registry.get_sample_value(fallback, {"priority": "P2"}) in (None, 0.0)


def test_a_full_serving_pool_does_not_fall_back() -> None:
    """The interactive pool is healthy but full: P0 waits for it rather than land on the batch pool."""
    pipeline = build_pipeline(Profile.parse(""), SchedulerSettings(max_inflight_per_worker=1))
    fleet = [pool_worker("interactive", P0), pool_worker("batch", P2)]
    fleet[0].occupancy.hold(P0, prompt_tokens=10)
    assert pipeline.place(PlacementRequest("r1", "t", P0, "", 10, 10), fleet) is None


class PoolWorker(StandInWorker):
    def __init__(self, pool: str, classes: list[int]) -> None:
        super().__init__()
        self.pool, self.classes = pool, classes

    async def GetModelInfo(self, request, context):
        return inference_pb2.ModelInfo(served_model_name="m", max_model_len=2048, pool=self.pool,
                                       pool_classes=self.classes)


async def test_leases_follow_the_pools_over_grpc_and_list_workers_shows_them() -> None:
    interactive, batch = PoolWorker("interactive", [P0, P1]), PoolWorker("batch", [P2])
    for w in (interactive, batch):
        await w.server.start()
    try:
        async with SchedulerHarness(scheduler_settings([interactive.address, batch.address])) as h:
            await h.until(lambda: len(h.workers.healthy()) == 2)
            calls = []
            # (a P1 here would wait: the interactive worker is still prefilling the P0 prompt, see prefill_gate)
            for i, (priority, expected) in enumerate([(P0, interactive), (P2, batch), (P0, interactive),
                                                      (P2, batch)]):
                call, event = await open_lease(h, f"r{i}", priority=priority)
                calls.append(call)
                assert event.granted.address == expected.address
            listed = await h.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
            pools = {w.address: (w.model.pool, list(w.model.pool_classes)) for w in listed.workers}
            assert pools == {interactive.address: ("interactive", [P0, P1]), batch.address: ("batch", [P2])}
            for call in calls:
                call.cancel()
    finally:
        for w in (interactive, batch):
            await w.server.stop(None)


def test_a_batch_pool_keeps_no_headroom_for_p0_and_the_latency_guard_leaves_it_alone() -> None:
    """The class protections (P2's share of the slots, the guard's P1/P2 limit, the decode-only reserve) exist for
    P0, so they apply only on workers whose pool serves P0."""
    from goodput_scheduler.placement import HasCapacity, PrefillGate

    interactive, batch, shared = pool_worker("interactive", P0, P1), pool_worker("batch", P2), pool_worker("any")
    cap = HasCapacity(max_inflight=4, shares={P2: 0.5}, low_limit=lambda: 1.0)
    for w in (interactive, batch, shared):
        w.occupancy.hold(P2, prompt_tokens=10)
        w.occupancy.hold(P2, prompt_tokens=10)
    p2 = PlacementRequest("r", "t", P2, "", 10, 10)
    # two P2 leases each: the guard (1) and the share (0.5 x 4) stop the shared worker, not the batch pool's
    assert [w.worker_id for w in cap.filter(CycleState(p2, [batch, shared]), [batch, shared])] == ["batch"]
    # the decode-only reserve for P0 is kept on the interactive pool; a batch worker may start a batch prefill
    gate = PrefillGate(100, p0_reserve=lambda: 2)
    fleet = [pool_worker("interactive", P0, P1), pool_worker("batch-1", P2), pool_worker("batch-2", P2)]
    fleet[1].occupancy.hold(P2, prompt_tokens=100)  # its step budget is full
    assert [w.worker_id for w in gate.filter(CycleState(p2, fleet), fleet[1:])] == ["batch-2"]
    # one shared pool of the same workers: two of three are kept decode-only for P0, so none may start one
    same = [pool_worker(f"any-{i}") for i in range(3)]
    same[1].occupancy.hold(P2, prompt_tokens=100)
    assert gate.filter(CycleState(p2, same), same[1:]) == []
