"""The simulated engine: the same Engine protocol as vLLM, with priority scheduling, KV capacity and prefix-cache
hits modelled (no timings asserted: the simulated clock is scaled down)."""

from __future__ import annotations

import asyncio

import pytest

from goodput_core.errors import InvalidArgument
from goodput_testing import async_wait_until

from goodput_inference.config import InferenceSettings
from goodput_inference.engine import Delta, Finished, GenRequest, Sampling, Started
from goodput_inference.sim_engine import SimEngine, SimParams


def engine(**kw: object) -> SimEngine:
    settings = InferenceSettings(engine="sim", max_model_len=4096, max_num_seqs=int(kw.pop("max_num_seqs", 8)))  # type: ignore[call-overload]
    return SimEngine(settings, params=SimParams(time_scale=0.01, **kw))  # type: ignore[arg-type]


async def run(e: SimEngine, request_id: str, prompt: str, *, priority: int = 2, max_tokens: int = 4) -> list[object]:
    return [ev async for ev in e.generate(GenRequest(request_id=request_id, prompt=prompt, priority=priority,
                                                     sampling=Sampling(max_tokens=max_tokens)))]


async def test_streams_started_deltas_and_finished_like_a_worker() -> None:
    e = engine(stream_every=2)
    await e.start()
    events = await run(e, "r1", "hello " * 100, max_tokens=5)
    assert isinstance(events[0], Started) and events[0].prompt_tokens == 150
    deltas = [ev for ev in events if isinstance(ev, Delta)]
    assert [d.completion_tokens for d in deltas] == [1, 3, 5]
    assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 5
    assert e.load().finished_total == 1 and e.load().running == 0
    with pytest.raises(InvalidArgument):
        await run(e, "r2", "x" * 40_000)
    await e.shutdown()


async def test_a_continuation_prefills_the_answer_so_far_and_generates_only_the_rest() -> None:
    e = engine()
    await e.start()
    whole = await run(e, "r1", "hello " * 100, max_tokens=6)
    sent = [t for ev in whole[:4] if isinstance(ev, Delta) for t in ev.token_ids]  # three tokens reached the caller
    assert len(sent) == 3
    rest = [ev async for ev in e.generate(GenRequest(request_id="r1-resumed", prompt="hello " * 100,
                                                     sampling=Sampling(max_tokens=6), continuation=tuple(sent)))]
    assert isinstance(rest[0], Started) and rest[0].prompt_tokens == 150  # the prompt's, as the first call said
    deltas = [ev for ev in rest if isinstance(ev, Delta)]
    assert [d.completion_tokens for d in deltas] == [4, 5, 6]  # the whole answer's count: nothing generated twice
    assert "".join(d.text for d in whole if isinstance(d, Delta)) == "".join(
        d.text for d in whole[1:4] if isinstance(d, Delta)) + "".join(d.text for d in deltas)
    end = rest[-1]
    assert isinstance(end, Finished) and (end.prompt_tokens, end.completion_tokens) == (150, 6)
    assert end.cached_tokens == 144  # the blocks the first call computed (prompt and answer) were cached
    with pytest.raises(InvalidArgument, match="continuation"):  # nothing left to generate
        await anext(aiter(e.generate(GenRequest(request_id="r2", prompt="hi", sampling=Sampling(max_tokens=3),
                                                continuation=(1, 1, 1)))))
    await e.shutdown()


async def test_prefix_cache_hits_skip_prefill_of_a_shared_prefix() -> None:
    e = engine()
    await e.start()
    system = "You are a helpful assistant. " * 60
    await run(e, "a", system + "question one")
    assert e.prefix_hit_tokens == 0
    await run(e, "b", system + "question two")
    assert e.prefix_hit_tokens >= 400  # the shared system prompt's full blocks
    await run(e, "c", "something else entirely " * 60)
    assert e.prefix_hit_tokens < 2 * 400
    await e.shutdown()


async def test_each_request_reports_the_prompt_tokens_it_found_in_the_prefix_cache() -> None:
    e = engine()
    await e.start()
    prompt = "abcd" * 16 * 10  # 160 tokens: exactly 10 blocks of 16
    first = (await run(e, "a", prompt))[-1]
    before = e.load().prefix_cache_hits
    second = (await run(e, "b", prompt))[-1]
    other = (await run(e, "c", "wxyz" * 16 * 10))[-1]
    await e.shutdown()
    assert isinstance(first, Finished) and isinstance(second, Finished) and isinstance(other, Finished)
    assert first.cached_tokens == 0 and other.cached_tokens == 0
    # The repeat hits every block but the last: as in vLLM, the prompt's last token is always computed.
    assert second.prompt_tokens == 160 and second.cached_tokens == 144
    assert second.cached_tokens == e.load().prefix_cache_hits - before  # what the request says, the engine counted


async def test_priority_policy_serves_urgent_requests_first_and_kv_capacity_bounds_admission() -> None:
    e = engine(max_num_seqs=1)
    await e.start()
    finished: list[str] = []

    async def go(rid: str, prio: int) -> None:
        await run(e, rid, f"{rid} " * 50, priority=prio, max_tokens=3)
        finished.append(rid)

    first = asyncio.create_task(go("first", 3))
    await async_wait_until(lambda: e.load().running == 1, timeout=5, interval=0)  # "first" holds the only slot
    tasks = [asyncio.create_task(go(rid, prio)) for rid, prio in (("batch", 3), ("interactive", 1))]
    await asyncio.gather(first, *tasks)
    assert finished == ["first", "interactive", "batch"]
    small = engine(kv_blocks=20, max_num_seqs=8)  # 20 blocks of 16 tokens: one 250-token request at a time
    await small.start()
    await asyncio.gather(*(run(small, f"k{i}", f"{i} " * 100, max_tokens=50) for i in range(3)))
    assert small.load().finished_total == 3 and small.load().kv_cache_usage == 0
    await e.shutdown()
    await small.shutdown()


async def test_vllm_extensions_it_can_honour_are_served_and_the_rest_refused_by_name() -> None:
    e = engine()
    await e.start()
    fixed = Sampling(max_tokens=6, ignore_eos=True, min_tokens=6, skip_special_tokens=False)
    events = [ev async for ev in e.generate(GenRequest(request_id="f", prompt="hello " * 100, sampling=fixed))]
    assert isinstance(events[-1], Finished) and events[-1].completion_tokens == 6  # its answers run to max_tokens
    cut = Sampling(max_tokens=2, truncate_prompt_tokens=40)
    events = [ev async for ev in e.generate(GenRequest(request_id="t", prompt="hello " * 100, sampling=cut))]
    assert isinstance(events[0], Started) and events[0].prompt_tokens == 40  # the prompt's last 40 tokens
    with pytest.raises(InvalidArgument, match="stop_token_ids"):  # placeholder text has no token ids
        await anext(e.generate(GenRequest(request_id="s", prompt="hi", sampling=Sampling(stop_token_ids=(2,)))))
    await e.shutdown()
