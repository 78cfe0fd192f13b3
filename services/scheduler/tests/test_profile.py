"""The placement profile: the format users already write still reads, and step parameters set in it take effect."""

from __future__ import annotations

import pytest
from goodput.common.v1 import types_pb2

from goodput_scheduler.config import SchedulerSettings
from goodput_scheduler.placement import (
    CycleState,
    PlacementRequest,
    PrefillGate,
    PrefixAffinity,
    Profile,
    build_pipeline,
)
from goodput_scheduler.registry import Worker

P2 = types_pb2.PRIORITY_P2


def test_the_documented_profile_reads_unchanged() -> None:
    p = Profile.parse('{"filters": ["healthy", "serves_model", "has_capacity", "prefill_gate"], '
                      '"scorers": [{"name": "least_loaded", "weight": 1.0}, {"name": "prefix_affinity", "weight": 2}, '
                      '"session_affinity"], "picker": "max_score"}')
    assert p.scorers == (("least_loaded", 1.0), ("prefix_affinity", 2.0), ("session_affinity", 1.0))
    assert p.parameters == {} and Profile.parse("") == Profile()


def test_a_steps_parameters_come_from_the_profile_only(monkeypatch: pytest.MonkeyPatch) -> None:
    # the settings these parameters once defaulted from are gone: set in the environment, they change nothing
    monkeypatch.setenv("GOODPUT_SCHEDULER_LOW_PREFILL_BUDGET_TOKENS", "1000")
    monkeypatch.setenv("GOODPUT_SCHEDULER_PREFIX_BLOCK_CHARS", "8")
    monkeypatch.setenv("GOODPUT_SCHEDULER_P0_PREFILL_EXCLUSIVE", "false")
    settings = SchedulerSettings()
    profile = Profile.parse('{"filters": [{"name": "prefill_gate", "parameters": {"budget_tokens": 500}}], '
                            '"scorers": [{"name": "prefix_affinity", "weight": 2, '
                            '"parameters": {"block_chars": 16}}]}')
    pipeline = build_pipeline(profile, settings)
    (gate,) = pipeline.filters
    (_, affinity), = pipeline.scorers
    assert isinstance(gate, PrefillGate) and gate.budget_tokens == 500
    assert isinstance(affinity, PrefixAffinity) and affinity.index.block_chars == 16
    # a parameter the profile leaves out is the step's own default
    assert gate.p0_exclusive is True and affinity.balance_slack == 0.1
    (default_affinity,) = (s for _, s in build_pipeline(Profile.parse(""), settings).scorers
                           if isinstance(s, PrefixAffinity))
    assert default_affinity.index.block_chars == 128
    # and the budget decides: a second 300-token batch prompt no longer fits next to one being prefilled
    w = Worker(worker_id="w", address="w", channel=None, healthy=True)  # type: ignore[arg-type]
    w.occupancy.hold(P2, prompt_tokens=300)
    batch = PlacementRequest("b", "t", P2, "", 300, 10)
    assert gate.filter(CycleState(batch, [w]), [w]) == []
    (default_gate,) = (f for f in build_pipeline(Profile.parse(""), settings).filters if f.name == "prefill_gate")
    assert default_gate.filter(CycleState(batch, [w]), [w]) == [w]
    # the fifo baseline keeps no classes apart, so its gate holds nothing back
    (fifo_gate,) = build_pipeline(profile, SchedulerSettings(queue_policy="fifo")).filters
    assert fifo_gate.filter(CycleState(batch, [w]), [w]) == [w]


@pytest.mark.parametrize(("text", "message"), [
    ('{"scorers": [{"name": "prefix_affinity", "parameters": {"block_size": 16}}]}', "block_size"),
    ('{"scorers": [{"name": "prefix_affinity", "parameters": {"block_chars": 2}}]}', "block_chars"),
    ('{"filters": [{"name": "healthy", "parameters": {"strict": true}}]}', "strict"),
    ('{"picker": {"name": "round_robin", "parameters": "fast"}}', "are an object"),
    ('{"scorers": [{"name": "least_loaded", "parameters": {"kv_weight": 1}}, '
     '{"name": "least_loaded", "parameters": {"kv_weight": 2}}]}', "listed twice"),
    ('{"filters": ["least_loaded"]}', "unknown filter"),
])
def test_a_bad_profile_is_refused_naming_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        Profile.parse(text)
