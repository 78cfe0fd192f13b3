"""Per-worker lease caps and speeds: each worker holds at most its own engine's batch (an interactive pool's 16, a
batch pool's 128), the scheduler learns how fast each worker serves from the leases it finished, and placement
sends a request where it is predicted to finish first (speculative load balancing), not only where fewer leases
are held."""

from __future__ import annotations

from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2
from goodput.scheduler.v1 import scheduler_pb2

from goodput_contracts.speed import SpeedEstimate

from goodput_scheduler.config import SchedulerSettings
from goodput_scheduler.placement import HasCapacity, PlacementRequest, Profile, build_pipeline
from goodput_scheduler.placement.plugins import CycleState
from goodput_scheduler.predict import WorkerSpeed
from goodput_scheduler.registry import Worker

from .conftest import SchedulerHarness, StandInWorker, open_lease, scheduler_settings

P0, P2 = types_pb2.PRIORITY_P0, types_pb2.PRIORITY_P2
A100_7B = SpeedEstimate(prefill_s_per_token=0.00012, tpot_base_s=0.012, tpot_per_seq_s=0.0003)


def worker(name: str, *, max_num_seqs: int = 0, speed: SpeedEstimate | None = None) -> Worker:
    w = Worker(worker_id=name, address=name, channel=None, healthy=True,
               load=inference_pb2.WorkerLoad(max_num_seqs=max_num_seqs))
    if speed is not None:
        w.speed = WorkerSpeed(speed)
    return w


def test_each_worker_holds_at_most_its_own_engines_batch_unless_one_cap_is_set() -> None:
    interactive, batch = worker("interactive", max_num_seqs=2), worker("batch", max_num_seqs=128)
    for w in (interactive, batch):
        for _ in range(2):
            w.occupancy.hold(P2, prompt_tokens=0)
    req = PlacementRequest("r", "t", P2, "", 10, 10)
    fleet = [interactive, batch]
    assert [w.worker_id for w in HasCapacity().filter(CycleState(req, fleet), fleet)] == ["batch"]
    for _ in range(62):  # far past the 64 every worker got before: the batch pool's engine takes 128
        batch.occupancy.hold(P2, prompt_tokens=0)
    assert [w.worker_id for w in HasCapacity().filter(CycleState(req, fleet), fleet)] == ["batch"]
    # MAX_INFLIGHT_PER_WORKER, when set, is one cap for every worker whatever its engine says
    kept = HasCapacity(max_inflight=64).filter(CycleState(req, fleet), fleet)
    assert [w.worker_id for w in kept] == ["interactive"]
    # a worker that has not reported its batch size yet gets 64
    assert worker("new").lease_cap() == 64


async def test_a_worker_is_granted_up_to_its_max_num_seqs_and_list_workers_says_so() -> None:
    small = StandInWorker()
    small.load = inference_pb2.WorkerLoad(max_num_seqs=2, ready=True)
    await small.server.start()
    try:
        async with SchedulerHarness(scheduler_settings([small.address])) as h:
            await h.until(lambda: len(h.workers.healthy()) == 1 and h.workers.healthy()[0].load.max_num_seqs == 2)
            calls = []
            for i in range(2):
                call, event = await open_lease(h, f"r{i}", priority=P0)
                assert event.HasField("granted")
                calls.append(call)
            third, event = await open_lease(h, "r2", priority=P0, skip_queued=False)
            assert event.HasField("queued")  # the engine's batch is full: it waits in the scheduler, not in vLLM
            listed = await h.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
            assert [(w.lease_cap, w.inflight) for w in listed.workers] == [(2, 2)]
            for call in (*calls, third):
                call.cancel()
    finally:
        await small.server.stop(None)


def test_the_speed_is_learned_per_worker_from_finished_leases() -> None:
    prior = SchedulerSettings().predict.speed_prior()
    slow = WorkerSpeed(prior)
    assert slow.estimate() == prior  # nothing finished yet: the priors
    for batch in (1, 4, 8, 16) * 5:  # a slow GPU: 40 ms + 1 ms per sequence, 0.5 ms per prompt token
        tpot = 0.040 + 0.001 * batch
        slow.observe(prompt_tokens=200, completion_tokens=65, ttft_s=0.1 + tpot, duration_s=0.1 + 65 * tpot,
                     batch=batch)
    est = slow.estimate()
    assert abs(est.tpot_base_s - 0.040) < 0.002 and abs(est.tpot_per_seq_s - 0.001) < 0.0002
    assert abs(est.prefill_s_per_token - 0.0005) < 0.00005 and est.samples == 20
    # one batch size seen: the level is learned and the prior's slope-to-base ratio kept
    steady = WorkerSpeed(prior)
    for _ in range(10):
        steady.observe(prompt_tokens=10, completion_tokens=11, ttft_s=0.05, duration_s=0.05 + 10 * 0.02, batch=4)
    assert abs(steady.estimate().tpot_at(4) - 0.02) < 1e-6


def test_placement_prefers_the_worker_predicted_to_finish_first_over_the_least_loaded() -> None:
    pipeline = build_pipeline(Profile.parse(""), SchedulerSettings())
    assert "predicted_finish" in [s.name for _, s in pipeline.scorers]
    fast, slow = worker("fast", max_num_seqs=64, speed=A100_7B), worker("slow", max_num_seqs=64,
                                                                        speed=A100_7B.scaled(3.0))
    for _ in range(3):  # the fast worker holds more leases, but finishes a new request sooner
        fast.occupancy.hold(P2, prompt_tokens=0)
    decision = pipeline.place(PlacementRequest("r1", "t", P2, "", 500, 200), [fast, slow])
    assert decision is not None and decision.worker.worker_id == "fast"
    # equal speeds (nothing learned yet): the least loaded wins, as before
    a, b = worker("a", max_num_seqs=64), worker("b", max_num_seqs=64)
    a.occupancy.hold(P2, prompt_tokens=0)
    decision = pipeline.place(PlacementRequest("r2", "t", P2, "", 500, 200), [a, b])
    assert decision is not None and decision.worker.worker_id == "b"
    # a long prompt still prefilling on the fast worker: a short request goes to the idle slow one
    busy = worker("fast", max_num_seqs=64, speed=A100_7B)
    busy.occupancy.hold(P2, prompt_tokens=30000)
    decision = pipeline.place(PlacementRequest("r3", "t", P2, "", 50, 4), [busy, slow])
    assert decision is not None and decision.worker.worker_id == "slow"


async def test_the_scheduler_learns_a_workers_speed_from_the_gateways_releases() -> None:
    w = StandInWorker()
    await w.server.start()
    try:
        async with SchedulerHarness(scheduler_settings([w.address])) as h:
            await h.until(lambda: len(h.workers.healthy()) == 1)
            for i in range(3):
                call, event = await open_lease(h, f"r{i}", prompt_tokens_estimate=100, max_tokens=50)
                await h.clock.advance(0.2)  # first token after 0.2 s
                call.first_token(0.2)
                await h.until(lambda: h.workers.healthy()[0].p0_prefilling == 0)
                await h.clock.advance(49 * 0.05)  # then 49 tokens, 50 ms each
                await call.release(prompt_tokens=100, completion_tokens=50, ttft_s=0.2)
                call.cancel()
            listed = await h.stub.ListWorkers(scheduler_pb2.ListWorkersRequest())
            speed = listed.workers[0].speed
            assert speed.samples == 3
            assert abs(speed.tpot_base_s + speed.tpot_per_seq_s - 0.05) < 1e-6  # tpot at a batch of one
            assert speed.prefill_s_per_token > 0
    finally:
        await w.server.stop(None)


def test_nothing_is_placed_on_a_worker_whose_engine_reports_a_stall() -> None:
    """A hung engine (no output while generating; the worker reports stalled_s and turns NOT_SERVING itself)."""
    w = worker("w", max_num_seqs=8)
    assert w.placeable
    w.load = inference_pb2.WorkerLoad(max_num_seqs=8, stalled_s=31.0)
    assert not w.placeable
