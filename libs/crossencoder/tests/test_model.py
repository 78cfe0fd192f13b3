"""The cross-encoder component: any sequence-classification folder loads on either backend, scores do not depend on
how pairs are batched, and scoring keeps a deadline."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from goodput_crossencoder import CrossEncoder, DeadlineExceeded

PAIRS = [("how do I reset my password?", "how can I reset my password?"),
         ("how do I turn on dark mode?", "how do I turn off dark mode?"),
         ("what is the refund window?", "a long passage about refunds " * 30),
         ("where are my invoices?", "invoices are under Billing")]


def test_the_onnx_export_and_the_torch_weights_give_the_same_scores(tiny_model: Path) -> None:
    onnx = CrossEncoder.load(tiny_model)  # auto on CPU: the int8 export
    torch = CrossEncoder.load(tiny_model, backend="torch")
    assert onnx.backend == "onnx" and torch.backend == "torch"
    a, b = onnx.score(PAIRS), torch.score(PAIRS)
    assert a.probabilities.shape == (4,) and np.all((a.probabilities > 0) & (a.probabilities < 1))
    np.testing.assert_allclose(a.logits, b.logits, atol=0.15)  # int8 weights against float ones


def test_a_folder_without_an_export_loads_through_torch(tiny_model: Path, tmp_path: Path) -> None:
    plain = tmp_path / "plain"
    shutil.copytree(tiny_model, plain, ignore=shutil.ignore_patterns("onnx"))
    model = CrossEncoder.load(plain)
    assert model.backend == "torch"
    assert model.score(PAIRS[:1]).probabilities.shape == (1,)


def test_scores_do_not_depend_on_batching_or_order(tiny_model: Path) -> None:
    model = CrossEncoder.load(tiny_model, max_batch_tokens=64)  # forces several batches
    together = model.score(PAIRS).logits
    alone = np.array([model.score([p]).logits[0] for p in PAIRS])
    # the int8 export quantizes activations per batch (dynamic range), so batch-mates move a score in the 4th digit
    np.testing.assert_allclose(together, alone, atol=2e-2)  # int8 kernels and their rounding differ by CPU
    reversed_ = model.score(PAIRS[::-1]).logits[::-1]
    np.testing.assert_allclose(together, reversed_, atol=1e-4)
    exact = CrossEncoder.load(tiny_model, backend="torch", max_batch_tokens=64)
    alone_exact = [exact.score([p]).logits[0] for p in PAIRS]
    np.testing.assert_allclose(exact.score(PAIRS).logits, alone_exact, rtol=0, atol=2e-6)  # float: padding rounding
    assert np.ptp(alone_exact) > 2e-5  # the pairs' scores differ by more than that: a row mix-up would show


def test_a_two_label_model_gives_the_probability_of_label_one(two_label_model: Path) -> None:
    model = CrossEncoder.load(two_label_model, backend="torch")
    scores = model.score(PAIRS)
    import torch
    from transformers import AutoModelForSequenceClassification

    ref = AutoModelForSequenceClassification.from_pretrained(str(two_label_model)).eval()
    tok = model._tokenizer
    for i, pair in enumerate(PAIRS):
        (rows, ids, types, mask), = tok.groups(tok.encode([pair]), 10_000)
        with torch.no_grad():
            logits = ref(input_ids=torch.from_numpy(ids), attention_mask=torch.from_numpy(mask),
                         token_type_ids=torch.from_numpy(types)).logits
        assert scores.probabilities[i] == pytest.approx(float(torch.softmax(logits, -1)[0, 1]), abs=1e-4)


def test_a_deadline_already_passed_scores_nothing(tiny_model: Path) -> None:
    model = CrossEncoder.load(tiny_model)
    with pytest.raises(DeadlineExceeded) as err:
        model.score(PAIRS, deadline=time.monotonic() - 0.001)
    assert err.value.scored == 0 and err.value.total == 4


def test_work_that_cannot_finish_in_time_is_refused_before_it_starts(tiny_model: Path) -> None:
    model = CrossEncoder.load(tiny_model)
    model.warm_up()  # now it knows its cost per token
    many = PAIRS * 50
    assert model.estimate_s(many) > 0
    started = time.perf_counter()
    with pytest.raises(DeadlineExceeded):
        model.score(many, deadline=time.monotonic() + model.estimate_s(many) / 20)
    assert time.perf_counter() - started < model.estimate_s(many) / 2  # refused, not computed
    assert model.score(many, deadline=time.monotonic() + 60).probabilities.shape == (200,)


def test_a_folder_that_is_not_a_model_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="not a model folder"):
        CrossEncoder.load(tmp_path)
