"""Each of the scheduler's abstractions documents its use with an example (pytest's --doctest-modules runs them)."""

from __future__ import annotations

import doctest
import importlib

import pytest

ABSTRACTIONS = ("clock", "queues", "overload", "guard", "leasebook", "placement", "placement.plugins",
                "placement.filters", "placement.scorers", "placement.pickers", "placement.pipeline",
                "placement.profile")


@pytest.mark.parametrize("name", ABSTRACTIONS)
def test_the_abstraction_has_examples(name: str) -> None:
    module = importlib.import_module(f"goodput_scheduler.{name}")
    examples = sum(len(t.examples) for t in doctest.DocTestFinder().find(module))
    assert examples > 0, name
