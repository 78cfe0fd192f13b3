from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def tiny_model(tiny_cross_encoder: Path) -> Path:
    """goodput_testing's one-layer cross-encoder (an untrained head: these tests are about loading, batching and
    deadlines, not about verdicts)."""
    return tiny_cross_encoder


@pytest.fixture(scope="session")
def two_label_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder shaped like many published rerankers and paraphrase models: two output labels."""
    from goodput_crossencoder.training import make_untrained

    return make_untrained(tmp_path_factory.mktemp("ce") / "two", num_labels=2)
