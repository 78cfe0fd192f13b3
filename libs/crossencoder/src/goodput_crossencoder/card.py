"""The model card written beside a trained cross-encoder: what it was trained on, how, how long, and what it scored on
the validation part of the data. ``goodput_card.json`` is read back by the services (the verifier's threshold) and by
``goodput train`` (a folder with a card is a finished model, never retrained); ``README.md`` says the same to people.

Example::

    card = read_card(Path("models/goodput-verifier-minilm"))
    card.threshold      # 0.83: the probability the cache accepts a verified hit at
"""

from __future__ import annotations

import json
import os
import platform
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["CARD_FILE", "MODEL_FOLDERS", "ModelCard", "default_model_dir", "machine_summary", "read_card", "write_card"]

CARD_FILE = "goodput_card.json"


@dataclass
class ModelCard:
    kind: str
    base_model: str
    layers: int
    max_length: int
    truncation: str
    seed: int
    epochs: int
    batch_size: int
    lr: float
    training: dict[str, Any]
    train_seconds: float
    validate_seconds: float
    validation: dict[str, Any]
    threshold: float | None
    machine: dict[str, Any]
    torch_threads: int
    created: str
    extra: dict[str, Any] = field(default_factory=dict)


def machine_summary() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": cpu, "cores": cores, "python": platform.python_version()}


def read_card(folder: Path) -> ModelCard | None:
    path = Path(folder) / CARD_FILE
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    known = {f for f in ModelCard.__dataclass_fields__}
    return ModelCard(**{k: v for k, v in data.items() if k in known})


def write_card(folder: Path, card: ModelCard) -> None:
    (folder / CARD_FILE).write_text(json.dumps(asdict(card), indent=2) + "\n")
    (folder / "README.md").write_text(_markdown(card))


def _markdown(card: ModelCard) -> str:
    what = {"reranker": "a query-passage reranker for the retriever (SciFact)",
            "verifier": "a paraphrase verifier for the semantic cache (QQP, PAWS, MRPC)"}.get(card.kind, card.kind)
    lines = [f"# Goodput {card.kind} (cross-encoder)", "",
             f"{what}, fine-tuned by `goodput train {card.kind}` from {card.base_model}, keeping its lower "
             f"{card.layers} layers, with a new one-logit head.", "",
             "## Training", "",
             f"- Data: {card.training.get('data', '')}",
             f"- Loss: {card.training.get('loss', '')}",
             f"- {card.epochs} epoch(s), {card.training.get('steps')} steps of {card.batch_size} pairs, learning rate "
             f"{card.lr:g} (linear warm-up and decay), seed {card.seed}, pairs cut to {card.max_length} tokens "
             f"({card.truncation}).",
             f"- Took {card.train_seconds:.0f} s on {card.machine.get('cpu')} ({card.machine.get('cores')} cores, "
             f"{card.torch_threads} torch threads); validation {card.validate_seconds:.0f} s.",
             "", "## Validation (data never trained on; measured on the int8 ONNX export that serves)", "",
             "```json", json.dumps(card.validation, indent=2), "```", ""]
    if card.threshold is not None:
        lines += [f"Threshold: **{card.threshold:.4f}** ({card.validation.get('threshold_rule', '')}).", ""]
    lines += ["The test part of the same data is kept for `loadtests.retrieval_eval` and `loadtests.cache_eval`; "
              "see `goodput_crossencoder.datasets` for the split.", ""]
    return "\n".join(lines)


MODEL_FOLDERS = {"reranker": "goodput-reranker-minilm", "verifier": "goodput-verifier-minilm"}


def default_model_dir(data_dir: Path, kind: str) -> Path:
    """Where ``goodput train <kind>`` writes its model: ``<data dir>/models/goodput-<kind>-minilm``."""
    return Path(data_dir) / "models" / MODEL_FOLDERS[kind]
