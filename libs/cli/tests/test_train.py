"""`goodput train`: both cross-encoders train end to end on a tiny data folder in the shared data's format (a few
steps: the real runs and their numbers are in the loadtests reports), write a model card, load as cross-encoders,
and are never retrained once present."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from goodput_crossencoder import CrossEncoder, read_card

from goodput_cli.main import app, cross_encoder_env

TOPICS = ["insulin resistance and type 2 diabetes", "statins lower cholesterol", "vitamin D and bone density",
          "smoking raises lung cancer risk", "exercise improves heart health", "sleep loss impairs memory",
          "antibiotics and gut bacteria", "air pollution and asthma", "coffee and liver disease",
          "obesity and blood pressure"]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("data")
    (root / "scifact").mkdir()
    corpus = [{"_id": str(i), "title": f"A study of {t} in adults", "text": f"We report that {t}. " * 6,
               "metadata": {}} for i, t in enumerate(TOPICS)]
    (root / "scifact" / "corpus.jsonl.gz").write_bytes(gzip.compress(
        "".join(json.dumps(d) + "\n" for d in corpus).encode()))
    queries = [{"_id": str(100 + i), "text": f"claim {i}: {TOPICS[i % len(TOPICS)]}", "metadata": {}}
               for i in range(40)]
    (root / "scifact" / "queries.jsonl").write_text("".join(json.dumps(q) + "\n" for q in queries))
    (root / "scifact" / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + "".join(
        f"{100 + i}\t{i % len(TOPICS)}\t1\n" for i in range(40)))
    pairs = [(f"how do I {t}?", f"how can I {t}?", 1) for t in TOPICS] + \
            [(f"how do I {t}?", f"why does {TOPICS[(i + 1) % len(TOPICS)]} matter?", 0) for i, t in enumerate(TOPICS)]
    pairs = [(f"{a} ({k})", f"{b} ({k})", y) for k in range(4) for a, b, y in pairs]
    (root / "qqp").mkdir()
    (root / "qqp" / "pairs.jsonl.gz").write_bytes(gzip.compress("".join(
        json.dumps({"id": i, "text_a": a, "text_b": b, "label": y}) + "\n" for i, (a, b, y) in enumerate(pairs)
    ).encode()))
    for name in ("paws", "mrpc"):
        (root / name).mkdir()
        (root / name / "pairs.jsonl").write_text("".join(
            json.dumps({"id": i, "sentence1": a, "sentence2": b, "label": y}) + "\n"
            for i, (a, b, y) in enumerate(pairs)))
    return root


@pytest.mark.parametrize("kind", ["verifier", "reranker"])
def test_train_writes_a_loadable_model_with_its_card_and_never_retrains(data_dir: Path, kind: str) -> None:
    runner = CliRunner()
    args = ["train", kind, "--data-dir", str(data_dir), "--max-steps", "2", "--layers", "1", "--max-length", "64"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    out = data_dir / "models" / f"goodput-{kind}-minilm"
    card = read_card(out)
    assert card is not None and card.kind == kind and card.training["steps"] == 2 and card.layers == 1
    assert card.train_seconds > 0 and card.machine["cores"] >= 1 and (out / "README.md").is_file()
    if kind == "verifier":
        assert card.threshold is not None and 0 <= card.threshold <= 1
        assert set(card.validation["per_set"]) == {"qqp", "paws", "mrpc"}
    else:
        assert "ndcg@10_reranked" in card.validation and 0 <= card.extra["blend"] <= 1
    model = CrossEncoder.load(out)
    assert model.backend == "onnx" and model.score([("a question", "an answer")]).probabilities.shape == (1,)
    assert not (out.parent / f"goodput-{kind}-minilm.partial").exists()
    again = runner.invoke(app, args)
    assert again.exit_code == 0 and "not retraining" in again.output
    assert read_card(out).created == card.created  # type: ignore[union-attr]


def test_a_missing_data_folder_is_a_clear_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["train", "verifier", "--data-dir", str(tmp_path / "none")])
    assert result.exit_code == 2 and "no data folder" in result.output


def test_up_puts_the_trained_models_to_work(tmp_path: Path, tiny_cross_encoder: Path) -> None:
    import shutil

    shutil.copytree(tiny_cross_encoder, tmp_path / "goodput-reranker-minilm")
    env = cross_encoder_env(tmp_path, {})
    assert env == {"GOODPUT_RETRIEVER_RERANKER_MODEL": str((tmp_path / "goodput-reranker-minilm").resolve()),
                   "GOODPUT_GATEWAY_RAG__RERANK": "true"}
    shutil.copytree(tiny_cross_encoder, tmp_path / "goodput-verifier-minilm")
    assert "GOODPUT_CACHE_VERIFIER_MODEL" in cross_encoder_env(tmp_path, {})
    assert cross_encoder_env(tmp_path, {"GOODPUT_CACHE_VERIFIER_MODEL": "/elsewhere",
                                        "GOODPUT_RETRIEVER_RERANKER_MODEL": "/x"}) == {}
    assert set(cross_encoder_env(tmp_path, {}, use={"reranker"})) == {"GOODPUT_RETRIEVER_RERANKER_MODEL",
                                                                      "GOODPUT_GATEWAY_RAG__RERANK"}
    assert cross_encoder_env(tmp_path, {}, use={"none"}) == {}
