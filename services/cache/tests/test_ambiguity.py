"""Two cached answers that fit a question about equally well: the cache does not guess between them (real Redis and
embedding model)."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry

from goodput_cache.cache import Answer

from .conftest import ask

STORED_A = "How do I reset my password?"
STORED_B = "How can I reset my password?"
BETWEEN = "how to reset my password?"  # similarity 0.993 to A, 0.989 to B
ANSWER_A = Answer(text="Open Settings, then Security, then Reset password.", completion_tokens=12)
ANSWER_B = Answer(text="Use the 'Forgot password' link on the sign-in page.", completion_tokens=12)


async def _store_both(cache: Any, answer_b: Answer = ANSWER_B) -> None:
    assert (await cache.store(ask(STORED_A), ANSWER_A)).stored
    assert (await cache.store(ask(STORED_B), answer_b)).stored


async def test_a_question_two_different_answers_fit_about_equally_is_a_miss(make_cache: Any) -> None:
    registry = CollectorRegistry()
    cache = make_cache(registry)
    await _store_both(cache)
    result = await cache.lookup(ask(BETWEEN))
    assert not result.hit and not result.degraded
    assert result.reason.startswith("ambiguous"), result.reason
    assert registry.get_sample_value("goodput_cache_lookups_total",
                                     {"layer": "l2", "result": "ambiguous", "tenant": "acme"}) == 1.0
    # the question asked as stored still hits its own answer exactly
    exact = await cache.lookup(ask(STORED_B))
    assert exact.hit and exact.layer == "l1" and exact.answer is not None and exact.answer.text == ANSWER_B.text


async def test_margin_zero_serves_the_closest(make_cache: Any) -> None:
    cache = make_cache(ambiguity_margin=0.0)
    await _store_both(cache)
    hit = await cache.lookup(ask(BETWEEN))
    assert hit.hit and hit.layer == "l2" and hit.matched_query == STORED_A
    assert hit.answer is not None and hit.answer.text == ANSWER_A.text


async def test_two_entries_with_the_same_answer_are_not_ambiguous(make_cache: Any) -> None:
    cache = make_cache()
    await _store_both(cache, answer_b=Answer(text=ANSWER_A.text + "  ", completion_tokens=12))
    hit = await cache.lookup(ask(BETWEEN))
    assert hit.hit and hit.layer == "l2" and hit.answer is not None and hit.answer.text == ANSWER_A.text


async def test_a_runner_up_below_the_threshold_still_counts(make_cache: Any) -> None:
    # 0.965 to A, 0.959 to B: only A reaches 0.96, but B fits almost as well and answers otherwise
    cache = make_cache()
    await _store_both(cache)
    result = await cache.lookup(ask("How should I reset my password?"), threshold=0.96)
    assert not result.hit and result.reason.startswith("ambiguous"), result.reason


async def test_a_runner_up_the_guard_vetoes_does_not_make_it_ambiguous(make_cache: Any) -> None:
    cache = make_cache(ambiguity_margin=0.1)  # wide enough that "off" (0.930) is within it of "on" (0.994)
    await cache.store(ask("How do I turn on dark mode?"), Answer(text="Settings > Display > Dark: On."))
    await cache.store(ask("How do I turn off dark mode?"), Answer(text="Settings > Display > Dark: Off."))
    hit = await cache.lookup(ask("How can I turn on dark mode?"), threshold=0.9)
    assert hit.hit and hit.matched_query == "How do I turn on dark mode?"
