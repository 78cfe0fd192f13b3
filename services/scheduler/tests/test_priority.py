"""Priority classes, tenant fairness, deadlines, overload shedding with retry-after, and placement affinity, driven
over the scheduler's real gRPC API against stand-in and simulated workers."""

from __future__ import annotations

import typing

import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc
from goodput.scheduler.v1 import scheduler_pb2

from goodput_core.clients import make_channel
from goodput_core.errors import DeadlineExceeded, ResourceExhausted

from goodput_scheduler.clock import ManualClock
from goodput_scheduler.config import SchedulerSettings
from goodput_scheduler.guard import LatencyGuard
from goodput_scheduler.leases import DISPATCH_INTERVAL_S
from goodput_scheduler.placement import CycleState, PlacementRequest, PrefillGate, PrefixIndex, Profile, step_budget
from goodput_scheduler.queues import QUEUE_POLICIES, Ticket
from goodput_scheduler.registry import Worker

from .conftest import SchedulerHarness, open_lease, profile_with, scheduler_settings

P0, P1, P2 = types_pb2.PRIORITY_P0, types_pb2.PRIORITY_P1, types_pb2.PRIORITY_P2


def req(request_id: str, priority: int = P1, tenant: str = "t", prefix: str = "", session: str = "") \
        -> PlacementRequest:
    return PlacementRequest(request_id=request_id, tenant=tenant, priority=priority, model="", prompt_tokens=10,
                            max_tokens=10, prefix_hint=prefix, session_id=session)


async def test_overload_sheds_p2_before_p1_and_never_p0_below_its_cap(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    # One slot, so each queued request adds 1.0 to the saturation: P2 is shed from 1.0, P1 from 2.0.
    settings = scheduler_settings([a.address], max_inflight_per_worker=1, p0_max_queue=3, shed_p2_at=1.0,
                                  shed_p1_at=2.0, shed_hysteresis=0.5)
    async with SchedulerHarness(settings) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        holder, _ = await open_lease(h, "hold", priority=P1)
        waiting = []
        call, event = await open_lease(h, "p1-a", priority=P1, skip_queued=False)
        assert event.HasField("queued")
        waiting.append(call)
        with pytest.raises(ResourceExhausted):
            await open_lease(h, "p2-a", priority=P2)
        # P1 is still admitted at this saturation...
        call, event = await open_lease(h, "p1-b", priority=P1, skip_queued=False)
        assert event.HasField("queued")
        waiting.append(call)
        # ...but not any more now.
        with pytest.raises(ResourceExhausted):
            await open_lease(h, "p1-c", priority=P1)
        # P0 is admitted whatever the saturation, up to its own queue depth.
        for i in range(3):
            call, event = await open_lease(h, f"p0-{i}", priority=P0, skip_queued=False)
            assert event.HasField("queued")
            waiting.append(call)
        with pytest.raises(ResourceExhausted):
            await open_lease(h, "p0-3", priority=P0)
        assert h.metric("goodput_scheduler_shed_total", {"priority": "P2", "reason": "overload"}) == 1
        assert h.metric("goodput_scheduler_shed_total", {"priority": "P1", "reason": "overload"}) == 1
        assert h.metric("goodput_scheduler_shed_total", {"priority": "P0", "reason": "overload"}) == 0
        assert h.metric("goodput_scheduler_shed_total", {"priority": "P0", "reason": "queue_full"}) == 1
        assert h.metric("goodput_scheduler_queue_depth", {"priority": "P0"}) == 3
        # Capacity frees up: the three P0 go first, then the P1.
        order: list[str] = []
        calls = dict(zip(["p1-a", "p1-b", "p0-0", "p0-1", "p0-2"], waiting, strict=True))
        current = holder
        for _ in range(5):
            await current.release()
            await h.until(lambda: len(set(h.leases.leases) - set(order)) == 1)
            (granted,) = set(h.leases.leases) - set(order)
            order.append(granted)
            current = calls[granted]
            assert (await current.read()).HasField("granted")
        # (Inside a class the order is by deadline, and these deadlines are equal within gRPC's jitter.)
        assert set(order[:3]) == {"p0-0", "p0-1", "p0-2"} and set(order[3:]) == {"p1-a", "p1-b"}
        await current.release()
        # The queue drained: at the dispatcher's next tick saturation is below the thresholds minus the
        # hysteresis, and P2 is admitted again.
        await h.clock.advance(DISPATCH_INTERVAL_S)
        await h.until(lambda: not h.leases.overload.shedding[P2])
        call, event = await open_lease(h, "p2-b", priority=P2)
        assert event.HasField("granted")
        call.cancel()


async def test_retry_after_follows_the_observed_drain_rate(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    settings = scheduler_settings([a.address], max_inflight_per_worker=1, p1_max_queue=2, shed_p2_at=50,
                                  shed_p1_at=60)
    async with SchedulerHarness(settings) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        # Ten requests served back to back, 0.5 s each: the drain rate is observed, not assumed.
        for i in range(10):
            call, _ = await open_lease(h, f"warm-{i}", priority=P1)
            await h.clock.advance(0.5)
            await call.release()
        holder, _ = await open_lease(h, "hold", priority=P1)
        queued = [(await open_lease(h, f"q{i}", priority=P1, skip_queued=False))[0] for i in range(2)]
        with pytest.raises(ResourceExhausted) as exc:
            await open_lease(h, "shed", priority=P1)
        retry_after = exc.value.retry_after_s or 0.0
        rate = h.leases.drain.rate(h.clock.now())
        assert rate == pytest.approx(2.0)  # ten releases in five seconds
        # Three requests are ahead of a retry (two queued + itself) at the observed rate, within the clamp.
        expected = 3 / rate
        assert max(0.5, expected * 0.5) <= retry_after <= max(expected * 2, 0.5) + 0.01
        for c in [holder, *queued]:
            c.cancel()


async def test_expired_requests_never_reach_a_worker(sim_workers) -> None:  # type: ignore[no-untyped-def]
    (w,) = await sim_workers(1)
    settings = scheduler_settings([w.address], max_inflight_per_worker=1, p1_timeout_s=0.3)
    async with SchedulerHarness(settings) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        holder, _ = await open_lease(h, "hold", priority=P0)
        late, event = await open_lease(h, "late", timeout=20, priority=P0, skip_queued=False)
        assert event.HasField("queued")
        await h.clock.advance(21)  # its own deadline (before P0's 30 s queue timeout) passes while it waits
        with pytest.raises(DeadlineExceeded):
            await late.read()
        slow, event = await open_lease(h, "slow", timeout=60, priority=P1, skip_queued=False)
        assert event.HasField("queued")
        await h.clock.advance(0.4)  # P1's queue timeout is 0.3 s here
        with pytest.raises(DeadlineExceeded) as class_timeout:
            await slow.read()
        assert "queue timeout" in class_timeout.value.message
        assert h.metric("goodput_scheduler_admissions_total", {"priority": "P0"}) == 1  # only the holder
        assert h.metric("goodput_scheduler_admissions_total", {"priority": "P1"}) == 0
        assert h.metric("goodput_scheduler_shed_total", {"priority": "P1", "reason": "timeout"}) == 1
        holder.cancel()
        await h.until(lambda: h.workers.all()[0].inflight == 0)
        assert w.engine.load().finished_total == 0 and w.engine.prompt_tokens_total == 0


async def test_tenants_take_turns_inside_a_class_and_deadlines_order_each_tenant(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    settings = scheduler_settings([a.address], max_inflight_per_worker=1, shed_p2_at=100, shed_p1_at=100)
    async with SchedulerHarness(settings) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        lm = h.leases
        holder = await lm.acquire(req("hold"), deadline=None)
        now = h.clock.now()
        tickets: list[Ticket] = []
        for i in range(8):  # tenant "big" bursts first...
            tickets.append(lm.enqueue(req(f"big-{i}", tenant="big"), deadline=now + 50 - i))  # later ones due sooner
        for i in range(2):  # ...then "small" sends two
            tickets.append(lm.enqueue(req(f"small-{i}", tenant="small"), deadline=now + 50))
        order: list[str] = []
        lease = holder
        for _ in range(len(tickets)):
            lm.release(lease, scheduler_pb2.OUTCOME_OK)
            granted = [t for t in tickets if t.done and t.request.request_id not in order]
            assert len(granted) == 1
            lease = await lm.wait(granted[0])
            order.append(granted[0].request.request_id)
        lm.release(lease, scheduler_pb2.OUTCOME_OK)
        # The small tenant is not starved behind the burst: the tenants alternate while both have work.
        assert order[:4] == ["big-7", "small-0", "big-6", "small-1"]
        # Inside one tenant, the earliest deadline goes first.
        assert [r for r in order if r.startswith("big")] == [f"big-{i}" for i in range(7, -1, -1)]


async def test_strict_priority_between_classes(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    settings = scheduler_settings([a.address], max_inflight_per_worker=1, shed_p2_at=100, shed_p1_at=100)
    async with SchedulerHarness(settings) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        lm = h.leases
        lease = await lm.acquire(req("hold", P2), deadline=None)
        tickets = [lm.enqueue(req("p2", P2), deadline=None), lm.enqueue(req("p1", P1), deadline=None),
                   lm.enqueue(req("p0", P0), deadline=None)]
        order = []
        for _ in range(3):
            lm.release(lease, scheduler_pb2.OUTCOME_OK)
            (t,) = [t for t in tickets if t.done and t.request.request_id not in order]
            lease = await lm.wait(t)
            order.append(t.request.request_id)
        lm.release(lease, scheduler_pb2.OUTCOME_OK)
        assert order == ["p0", "p1", "p2"]


async def test_headroom_keeps_slots_for_p0(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    settings = scheduler_settings([a.address], max_inflight_per_worker=4, p2_max_share=0.5, p1_max_share=0.75,
                                  shed_p2_at=100, shed_p1_at=100)
    async with SchedulerHarness(settings) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        lm = h.leases
        p2 = [lm.enqueue(req(f"p2-{i}", P2), deadline=None) for i in range(3)]
        assert [t.done for t in p2] == [True, True, False]  # P2 may hold half the slots
        p1 = [lm.enqueue(req(f"p1-{i}", P1), deadline=None) for i in range(2)]
        assert [t.done for t in p1] == [True, False]  # P1 three quarters
        p0 = lm.enqueue(req("p0", P0), deadline=None)
        assert p0.done  # P0 gets the last slot at once
        await lm.stop()


async def test_prefill_gate_lets_batch_prompts_in_a_budget_at_a_time_and_never_during_a_p0_prefill(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    settings = scheduler_settings([a.address], max_inflight_per_worker=8, shed_p2_at=100, shed_p1_at=100,
                                  profile=profile_with(prefill_gate={"budget_tokens": 1000}))
    async with SchedulerHarness(settings) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        worker = h.workers.healthy()[0]
        first, event = await open_lease(h, "p2-a", priority=P2, prompt_tokens_estimate=800)
        assert event.HasField("granted")
        # a second long batch prompt would push the worker's pending prefill past the budget: it waits
        second, event = await open_lease(h, "p2-b", priority=P2, prompt_tokens_estimate=800, skip_queued=False)
        assert event.HasField("queued")
        # P0 is never gated
        p0, event = await open_lease(h, "p0", priority=P0, prompt_tokens_estimate=300)
        assert event.HasField("granted")
        assert worker.p0_prefilling == 1 and worker.low_prefill_tokens == 800
        # the first batch prompt is prefilled, but a P0 prompt still is: the queued one keeps waiting
        first.first_token()
        await h.until(lambda: worker.low_prefill_tokens == 0)
        await h.clock.advance(0.2)  # the dispatcher ticks: still gated
        assert h.metric("goodput_scheduler_queue_depth", {"priority": "P2"}) == 1
        # P0's first token: the gate opens
        p0.first_token()
        event = await second.read()
        assert event.HasField("granted")
        assert worker.p0_prefilling == 0 and worker.low_prefill_tokens == 800
        # a release without a first token (the request failed in prefill) frees its prefill tokens too
        await second.release()
        await h.until(lambda: worker.low_prefill_tokens == 0)
        for call in (first, p0):
            await call.release()
        assert worker.inflight == 0


async def test_while_p0_traffic_is_present_one_worker_stays_free_of_batch_prefill_for_it(workers) -> None:  # type: ignore[no-untyped-def]
    a, b = await workers(2)
    settings = scheduler_settings([a.address, b.address], max_inflight_per_worker=8, guard={"p0_ready_workers": 1},
                                  shed_p2_at=100, shed_p1_at=100,
                                  profile=profile_with(prefill_gate={"budget_tokens": 1000},
                                                       least_prefill={"budget_tokens": 1000}))
    async with SchedulerHarness(settings) as h:
        await h.until(lambda: len(h.workers.healthy()) == 2)
        lm = h.leases

        def batch(i: int) -> PlacementRequest:
            return PlacementRequest(request_id=f"p2-{i}", tenant="t", priority=P2, model="", prompt_tokens=900,
                                    max_tokens=10, prefix_hint=f"system prompt {i} " * 40)
        # no P0 seen yet: batch prompts prefill on both workers
        first = [lm.enqueue(batch(i), deadline=None) for i in range(2)]
        assert all(t.done for t in first)
        assert {t.future.result().worker.worker_id for t in first} == {w.worker_id for w in h.workers.healthy()}
        for t in first:
            lease = await lm.wait(t)
            lm.first_token(lease, 0.1)
            lm.release(lease, scheduler_pb2.OUTCOME_OK)
        # P0 arrives: from now on one worker only decodes, and the next P0 goes to it
        p0 = await lm.wait(lm.enqueue(req("p0-a", P0), deadline=None))
        lm.first_token(p0, 0.1)
        lm.release(p0, scheduler_pb2.OUTCOME_OK)
        second = [lm.enqueue(batch(i), deadline=None) for i in range(2, 4)]
        assert [t.done for t in second] == [True, False]
        busy = second[0].future.result().worker
        # even a P0 whose prompt prefix the busy worker holds goes to the worker that is only decoding: a batch
        # prompt's chunk steps cost more than the prefix cache saves
        prefix = next(batch(i).prefix_hint for i in range(2) if first[i].future.result().worker is busy)
        p0_lease = await lm.wait(lm.enqueue(req("p0-b", P0, prefix=prefix + "question"), deadline=None))
        assert p0_lease.worker is not busy and p0_lease.reason == "prefill_gate"
        lm.release(p0_lease, scheduler_pb2.OUTCOME_OK)
        # the batch prompt's first token frees its worker for the next one
        lease = await lm.wait(second[0])
        lm.first_token(lease, 0.1)
        await h.until(lambda: second[1].done)
        await lm.stop()


async def test_prefix_affinity_keeps_a_prefix_on_one_worker_while_load_is_balanced(workers) -> None:  # type: ignore[no-untyped-def]
    ws = await workers(3)
    async with SchedulerHarness(scheduler_settings([w.address for w in ws], max_inflight_per_worker=4)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 3)
        lm = h.leases
        system = {name: f"system: you are the {name} assistant. " * 20 for name in ("alpha", "beta", "gamma")}
        placed: dict[str, set[str]] = {name: set() for name in system}
        reasons = set()
        for i in range(12):
            for name, prompt in system.items():
                lease = await lm.acquire(req(f"{name}-{i}", prefix=prompt + f"user question {i}"), deadline=None)
                placed[name].add(lease.worker.worker_id)
                reasons.add(lease.reason)
                lm.release(lease, scheduler_pb2.OUTCOME_OK)  # load stays balanced: nothing is held
        assert all(len(w) == 1 for w in placed.values()), placed
        assert "prefix_affinity" in reasons
        # Load still wins when the affine worker is full: the prefix spills to other workers.
        held = [await lm.acquire(req(f"alpha-burst-{i}", prefix=system["alpha"]), deadline=None) for i in range(6)]
        assert len({lease.worker.worker_id for lease in held}) > 1
        for lease in held:
            lm.release(lease, scheduler_pb2.OUTCOME_OK)
        assert h.metric("goodput_scheduler_placements_total",
                        {"worker": next(iter(placed["alpha"])), "reason": "prefix_affinity"}) >= 1


async def test_session_affinity_and_round_robin_profile(workers) -> None:  # type: ignore[no-untyped-def]
    ws = await workers(3)
    profile = '{"scorers": [{"name": "least_loaded", "weight": 1}], "picker": "round_robin"}'
    async with SchedulerHarness(scheduler_settings([w.address for w in ws], profile=profile)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 3)
        seen = []
        for i in range(6):
            lease = await h.leases.acquire(req(f"r{i}", prefix="same prefix " * 30), deadline=None)
            seen.append(lease.worker.worker_id)
            h.leases.release(lease, scheduler_pb2.OUTCOME_OK)
        assert seen[:3] == seen[3:] and len(set(seen)) == 3  # round-robin ignores affinity
    async with SchedulerHarness(scheduler_settings([w.address for w in ws])) as h:
        await h.until(lambda: len(h.workers.healthy()) == 3)
        first = await h.leases.acquire(req("s1", session="chat-42"), deadline=None)
        h.leases.release(first, scheduler_pb2.OUTCOME_OK)
        for i in range(4):
            again = await h.leases.acquire(req(f"s{i + 2}", session="chat-42"), deadline=None)
            assert again.worker is first.worker and again.reason == "session_affinity"
            h.leases.release(again, scheduler_pb2.OUTCOME_OK)


def test_profile_parsing_and_prefix_index_bounds() -> None:
    p = Profile.parse('{"filters": ["healthy"], "scorers": ["least_loaded"], "picker": "random"}')
    assert p.filters == ("healthy",) and p.scorers == (("least_loaded", 1.0),) and p.picker == "random"
    with pytest.raises(ValueError, match="unknown scorer"):
        Profile.parse('{"scorers": [{"name": "nope"}]}')
    idx = PrefixIndex(block_chars=8, max_entries=10)
    for i in range(50):
        idx.record(idx.hashes(f"{i:08d}" * 4), f"w{i % 3}")
    assert len(idx) == 10  # bounded: least recently used hashes are forgotten
    assert idx.match(idx.hashes(f"{49:08d}" * 4)) == {"w1": 4}
    assert idx.match(idx.hashes(f"{0:08d}" * 4)) == {}


@pytest.mark.parametrize(("policy", "ahead", "served", "shed"), [
    # the most urgent class first, whatever the arrival order; P2 is shed once the queue saturates
    ("priority", {"p2-a": 2, "p1": 1, "p0": 0}, ["p0", "p1", "p2-a"], ["p2-b"]),
    # one arrival-order queue across the classes, and no class is shed (the benchmarks' baseline)
    ("fifo", {"p2-a": 0, "p1": 1, "p0": 2, "p2-b": 3}, ["p2-a", "p1", "p0", "p2-b"], []),
])
async def test_the_queue_policy_decides_the_order_and_what_is_shed(  # type: ignore[no-untyped-def]
        workers, policy: str, ahead: dict[str, int], served: list[str], shed: list[str]) -> None:
    (a,) = await workers(1)
    # one slot, so each waiting request adds 1.0 to the saturation: P2 is shed from 2.0 (P1 too, by default)
    settings = scheduler_settings([a.address], max_inflight_per_worker=1, queue_policy=policy, shed_p2_at=2.0)
    async with SchedulerHarness(settings) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        lm = h.leases
        lease = await lm.acquire(req("hold", P2), deadline=None)
        tickets, refused = [], []
        for request_id, priority in [("p2-a", P2), ("p1", P1), ("p0", P0), ("p2-b", P2)]:
            try:
                tickets.append(lm.enqueue(req(request_id, priority), deadline=None))
            except ResourceExhausted as exc:
                assert "are shed for now" in str(exc)
                refused.append(request_id)
        assert {t.request.request_id: lm.position(t) for t in tickets} == ahead
        assert h.metric("goodput_scheduler_queue_depth", {"priority": "P2"}) == 2 - len(refused)
        assert h.metric("goodput_scheduler_shed_total", {"priority": "P2", "reason": "overload"}) == len(refused)
        order: list[str] = []
        for _ in tickets:
            lm.release(lease, scheduler_pb2.OUTCOME_OK)
            (t,) = [t for t in tickets if t.done and t.request.request_id not in order]
            lease = await lm.wait(t)
            order.append(t.request.request_id)
        lm.release(lease, scheduler_pb2.OUTCOME_OK)
        assert (order, refused) == (served, shed)


def test_the_setting_names_every_queue_policy() -> None:
    assert set(typing.get_args(SchedulerSettings.model_fields["queue_policy"].annotation)) == set(QUEUE_POLICIES)


async def test_a_granted_sim_worker_generates_with_the_request_priority(sim_workers) -> None:  # type: ignore[no-untyped-def]
    (w,) = await sim_workers(1)
    async with SchedulerHarness(scheduler_settings([w.address])) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        call, event = await open_lease(h, "r1", priority=P0)
        channel = make_channel(event.granted.address, None)
        stub = inference_pb2_grpc.InferenceStub(channel)
        chunks = [c async for c in stub.Generate(inference_pb2.GenerateRequest(
            request_id="r1", prompt="hello " * 40, priority=P0,
            sampling=types_pb2.SamplingParams(max_tokens=5)))]
        await channel.close()
        assert chunks[0].HasField("started") and chunks[-1].finished.usage.completion_tokens == 5
        await call.release()
        assert h.metric("goodput_scheduler_releases_total", {"outcome": "ok"}) == 1
        # the worker reports its engine's per-step token budget, which sizes the prefill gate by default
        worker = h.workers.healthy()[0]
        assert worker.model is not None and worker.model.max_num_batched_tokens == 2048
        assert step_budget(worker) == 2048 and step_budget(worker, 512) == 512


async def test_a_caller_gone_while_queued_leaks_no_capacity(workers) -> None:  # type: ignore[no-untyped-def]
    (a,) = await workers(1)
    async with SchedulerHarness(scheduler_settings([a.address], max_inflight_per_worker=1)) as h:
        await h.until(lambda: len(h.workers.healthy()) == 1)
        holder, _ = await open_lease(h, "hold", priority=P0)
        gone, event = await open_lease(h, "gone", priority=P0, skip_queued=False)
        assert event.HasField("queued")
        gone.cancel()  # the client vanishes while its request waits
        await h.until(lambda: h.leases.queued() == 0)
        await holder.release()
        worker = h.workers.all()[0]
        await h.until(lambda: worker.inflight == 0)
        call, event = await open_lease(h, "next", priority=P0)
        assert event.HasField("granted")
        await call.release()


def test_latency_guard_cuts_lower_class_concurrency_when_p0_slows_and_restores_it() -> None:
    clock = ManualClock(start=1000.0)
    guard = LatencyGuard(SchedulerSettings(max_inflight_per_worker=20, guard={"interval_s": 1, "min_samples": 4}),
                         clock=clock)
    assert guard.current() == 18  # P1's share of the cap
    now = clock.now()
    for _ in range(4):
        guard.observe(0.10)  # unloaded: the baseline
    guard.maybe_adjust(now + 1)
    assert guard.baseline == 0.10 and guard.target() == 0.10 * 1.5
    for _ in range(4):
        guard.observe(0.40)  # P0 slowed down by lower-class work
    guard.maybe_adjust(now + 2)
    assert guard.current() == 9
    guard.observe(0.40)
    guard.maybe_adjust(now + 3)  # one sample is not a verdict yet
    assert guard.current() == 9
    for _ in range(3):
        guard.observe(0.11)
    guard.maybe_adjust(now + 4)
    assert guard.current() == 4  # the window's p95 was still slow
    for _ in range(4):
        guard.observe(0.11)
    guard.maybe_adjust(now + 5)
    assert guard.current() == 5  # back within target: additive increase


async def test_more_workers_stay_free_of_batch_prefill_as_p0_traffic_grows() -> None:
    clock = ManualClock(start=1000.0)
    guard = LatencyGuard(SchedulerSettings(guard={"p0_ready_workers": 1, "p0_recent_s": 30}), clock=clock)
    assert guard.p0_reserve() == 0  # no P0 traffic: no reserve
    guard.baseline = 0.2  # the learned unloaded P0 TTFT
    now = clock.now()
    guard.note_p0(now)
    assert guard.p0_reserve() == 1  # a trickle of P0: the configured minimum
    for i in range(20):  # 2 P0/s over the rate window: 2 x 0.2 s x 3 (P0_READY_PER_TTFT) = 1.2 expected
        guard.note_p0(now - i * 0.4)
    assert guard.p0_reserve() == 2
    await clock.advance(30)
    assert guard.p0_reserve() == 0  # P0 traffic stopped P0_RECENT_S ago: the reserve is given back

    # the gate keeps that many of the healthy workers free of batch prefill (never all of them)
    workers = [Worker(worker_id=f"w{i}", address=f"w{i}", channel=None, healthy=True)  # type: ignore[arg-type]
               for i in range(3)]
    batch = PlacementRequest(request_id="b", tenant="t", priority=P2, model="", prompt_tokens=900, max_tokens=10)
    reserve = 2
    gate = PrefillGate(1000, p0_reserve=lambda: reserve)

    def admitted(request: PlacementRequest) -> list[bool]:
        kept = gate.filter(CycleState(request, workers), workers)
        return [w in kept for w in workers]

    assert all(admitted(batch))  # three ready, two kept: one may start a batch prompt
    workers[0].occupancy.hold(P2, prompt_tokens=900)  # w0 was granted a batch prompt, still prefilling
    assert not any(admitted(batch))  # the other two are the reserve; w0's step budget is full
    reserve = 1
    assert admitted(batch) == [False, True, True]
    # a P0 prompt goes to a worker free of batch prefill
    assert admitted(req("p0", P0)) == [False, True, True]
