"""The examples in the scheduler's docstrings run, so they cannot go stale."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import goodput_scheduler

MODULES = sorted(m.name for m in pkgutil.walk_packages(goodput_scheduler.__path__, "goodput_scheduler.")
                 if m.name != "goodput_scheduler.__main__")


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name: str) -> None:
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0


def test_the_abstractions_have_examples() -> None:
    examples = {name: doctest.testmod(importlib.import_module(name), report=False).attempted for name in MODULES}
    for name in ("clock", "queues", "overload", "guard", "leasebook", "placement", "placement.plugins",
                 "placement.filters", "placement.scorers", "placement.pickers", "placement.pipeline",
                 "placement.profile"):
        assert examples[f"goodput_scheduler.{name}"] > 0, name
