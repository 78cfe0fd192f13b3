"""L2 hits with a verifier, on a real cross-encoder (goodput_testing's tiny one: what it says is arbitrary, so each
test sets the threshold on the side of its probability that the behaviour needs) and a real Redis: a verified hit
carries its verdict and probability, a refused candidate is a miss that says so, the guard still vetoes first, a
verifier over its time is a miss, and every verdict is counted."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from goodput_cache.cache import Answer
from goodput_cache.config import CacheSettings
from goodput_cache.verify import Verifier, load_verifier

from .conftest import ask  # type: ignore[import-not-found]

STORED = "How do I reset my password?"
ASKED = "How can I reset my password?"


def _verifier(path: Path, threshold: float) -> Verifier:
    verifier = load_verifier(CacheSettings(verifier_model=str(path), verify_threshold=threshold))
    assert verifier is not None
    return verifier


def test_auto_without_a_model_is_off_and_a_required_model_must_exist(tmp_path: Path, tiny_cross_encoder: Path) -> None:
    assert load_verifier(CacheSettings()) is None
    assert load_verifier(CacheSettings(verifier_model=str(tmp_path))) is None
    with pytest.raises(ValueError, match="goodput train verifier"):
        load_verifier(CacheSettings(verifier="cross-encoder", verifier_model=str(tmp_path)))
    assert load_verifier(CacheSettings(verifier_model=str(tiny_cross_encoder), semantic=False)) is None
    # the threshold comes from the model card unless set
    card_default = load_verifier(CacheSettings(verifier_model=str(tiny_cross_encoder)))
    assert card_default is not None and card_default.threshold == 0.5


async def test_a_verified_hit_says_so_and_a_refused_one_is_a_miss(make_cache: Any, tiny_cross_encoder: Path) -> None:
    probe = _verifier(tiny_cross_encoder, 0.5)
    p = float(probe.judge(ASKED, [STORED])[0])
    registry = CollectorRegistry()
    accepting = make_cache(registry, verifier=_verifier(tiny_cross_encoder, p * 0.99))
    await accepting.store(ask(STORED), Answer(text="Use 'Forgot password' on the sign-in page.", completion_tokens=9))
    r = await accepting.lookup(ask(ASKED))
    assert r.hit and r.layer == "l2" and r.verdict == "same" and r.verifier_probability == pytest.approx(p, abs=1e-4)
    assert r.answer is not None and r.answer.text.startswith("Use 'Forgot")
    other = CollectorRegistry()
    refusing = make_cache(other, verifier=_verifier(tiny_cross_encoder, min(p * 1.01, 0.999999)))
    await refusing.start()  # its index loads the entry from Redis
    r = await refusing.lookup(ask(ASKED))
    await refusing.stop()
    assert not r.hit and r.verdict == "different" and "verifier: not the same question" in r.reason
    assert r.verifier_probability == pytest.approx(p, abs=1e-4)
    assert registry.get_sample_value("goodput_cache_verifications_total", {"verdict": "same", "tenant": "acme"}) == 1
    assert other.get_sample_value("goodput_cache_verifications_total", {"verdict": "different", "tenant": "acme"}) == 1
    assert registry.get_sample_value("goodput_cache_verifier_seconds_count", {}) == 1


async def test_candidates_below_the_lower_bound_are_never_read(make_cache: Any, tiny_cross_encoder: Path) -> None:
    cache = make_cache(verifier=_verifier(tiny_cross_encoder, 1e-9), verify_min_similarity=0.999)
    await cache.store(ask(STORED), Answer(text="Use 'Forgot password'.", completion_tokens=5))
    r = await cache.lookup(ask(ASKED))
    assert not r.hit and r.verdict == ""  # nothing from 0.99 up: the model was not asked
    loose = make_cache(verifier=_verifier(tiny_cross_encoder, 1e-9), verify_min_similarity=0.6)
    await loose.start()
    assert (await loose.lookup(ask(ASKED))).hit
    await loose.stop()


async def test_the_guard_vetoes_before_the_model_reads(make_cache: Any, tiny_cross_encoder: Path) -> None:
    cache = make_cache(verifier=_verifier(tiny_cross_encoder, 1e-9))  # the model would accept anything
    await cache.store(ask("How do I turn on dark mode?"),
                      Answer(text="Settings > Display > Dark.", completion_tokens=5))
    r = await cache.lookup(ask("How do I turn off dark mode?"))
    assert not r.hit and r.reason.startswith("near miss") and r.verdict == ""
    unguarded = make_cache(verifier=_verifier(tiny_cross_encoder, 1e-9), verify_with_guard=False)
    await unguarded.start()
    assert (await unguarded.lookup(ask("How do I turn off dark mode?"))).verdict == "same"
    await unguarded.stop()


async def test_a_verifier_over_its_time_is_a_miss(make_cache: Any, tiny_cross_encoder: Path) -> None:
    registry = CollectorRegistry()
    cache = make_cache(registry, verifier=_verifier(tiny_cross_encoder, 1e-9), verify_timeout_s=1e-6)
    await cache.store(ask(STORED), Answer(text="Use 'Forgot password'.", completion_tokens=5))
    r = await cache.lookup(ask(ASKED))
    assert not r.hit and r.verdict == "skipped" and "verifier over its" in r.reason
    assert registry.get_sample_value("goodput_cache_verifications_total", {"verdict": "skipped", "tenant": "acme"}) == 1


async def test_another_tenant_is_never_verified_against(make_cache: Any, tiny_cross_encoder: Path) -> None:
    cache = make_cache(verifier=_verifier(tiny_cross_encoder, 1e-9))
    await cache.store(ask(STORED, tenant="tenant-b"), Answer(text="B's secret answer", completion_tokens=3))
    r = await cache.lookup(ask(STORED + " ", tenant="tenant-a"))
    assert not r.hit and r.verdict == ""
