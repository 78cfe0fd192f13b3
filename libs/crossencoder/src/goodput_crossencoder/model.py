"""A cross-encoder: reads two texts together and scores how well the second fits the first.

The retriever reranks (query, passage) pairs with one; the cache asks one whether a new question asks the same thing
as a cached one. Any Hugging Face sequence-classification folder loads: what ``goodput train`` writes, or what a user
brings in production (a bge or ms-marco reranker). Two backends:

- ``onnx``: an exported model (``onnx/model_quantized.onnx`` or ``onnx/model.onnx`` in the folder, as
  ``goodput train`` and Optimum write them) through onnxruntime on CPU; no torch.
- ``torch``: the folder's weights through ``transformers``, on CPU or a GPU (``device="cuda"``).

``backend="auto"`` takes onnx on CPU when the folder has an export, torch otherwise. A model with one output gives the
sigmoid of its logit; with two, the softmax probability of the second class (``label 1``: relevant, paraphrase).

Pairs are tokenized together, sorted by length and cut into batches of at most ``max_batch_tokens`` padded tokens
(a batch is padded to its longest pair). Scoring has a deadline: a call that cannot finish in time (judged from the
cost per token measured on earlier calls) raises :class:`DeadlineExceeded` before it starts, and one that runs late
stops between batches, so a caller falls back to its first-stage order instead of waiting.

Example (a tiny model trained by the test suite stands in for a real one)::

    ce = CrossEncoder.load("models/goodput-verifier-minilm")
    ce.score([("how do I reset my password?", "how can I reset my password?")]).probabilities  # array([0.97])
    ce.score(pairs, deadline=time.monotonic() + 0.05)   # or DeadlineExceeded
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

__all__ = ["BLEND_K", "CrossEncoder", "DeadlineExceeded", "Scores", "blend_ranks", "find_onnx", "load_configured"]

log = logging.getLogger("goodput.crossencoder")

Backend = Literal["auto", "onnx", "torch"]
Truncation = Literal["longest_first", "only_first", "only_second"]
BLEND_K = 10.0
ONNX_FILES = ("onnx/model_quantized.onnx", "onnx/model.onnx", "model_quantized.onnx", "model.onnx")


class DeadlineExceeded(Exception):
    """Scoring could not finish before the caller's deadline (nothing, or not everything, was scored)."""

    def __init__(self, message: str, *, scored: int, total: int) -> None:
        super().__init__(message)
        self.scored = scored
        self.total = total


@dataclass(frozen=True)
class Scores:
    probabilities: np.ndarray  # one per pair, 0..1
    logits: np.ndarray  # the model's raw score of label 1 (the margin over label 0 with two outputs)
    tokens: int  # padded tokens computed
    seconds: float


def find_onnx(folder: Path) -> Path | None:
    for name in ONNX_FILES:
        if (folder / name).is_file():
            return folder / name
    return None


class _PairTokenizer:
    """Pairs as word pieces, grouped into batches of similar length (the minilm library's grouping, for pairs)."""

    def __init__(self, folder: Path, max_length: int, truncation: Truncation) -> None:
        from tokenizers import Tokenizer

        path = folder / "tokenizer.json"
        if path.is_file():
            tok = Tokenizer.from_file(str(path))
        else:  # a folder with slow-tokenizer files only: transformers converts them to a fast one
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True).backend_tokenizer
        tok.no_padding()
        tok.enable_truncation(max_length=max_length, strategy=truncation)
        self._tok = tok
        self.pad_id = _pad_id(folder, tok)

    def encode(self, pairs: Sequence[tuple[str, str]]) -> list[Any]:
        return list(self._tok.encode_batch([(a, b) for a, b in pairs]))

    def groups(self, enc: list[Any], max_batch_tokens: int) -> list[tuple[list[int], np.ndarray, np.ndarray,
                                                                         np.ndarray]]:
        lengths = [len(e.ids) for e in enc]
        order = sorted(range(len(enc)), key=lengths.__getitem__)
        out = []
        i = 0
        while i < len(order):
            j = i + 1
            while j < len(order) and lengths[order[j]] * (j - i + 1) <= max_batch_tokens:
                j += 1
            rows = order[i:j]
            width = lengths[order[j - 1]]
            ids = np.full((len(rows), width), self.pad_id, dtype=np.int64)
            types = np.zeros_like(ids)
            mask = np.zeros_like(ids)
            for r, k in enumerate(rows):
                n = lengths[k]
                ids[r, :n] = enc[k].ids
                types[r, :n] = enc[k].type_ids
                mask[r, :n] = 1
            out.append((rows, ids, types, mask))
            i = j
        return out


def _pad_id(folder: Path, tok: Any) -> int:
    try:
        config = json.loads((folder / "config.json").read_text())
        if isinstance(config.get("pad_token_id"), int):
            return int(config["pad_token_id"])
    except (OSError, ValueError):
        pass
    for token in ("[PAD]", "<pad>"):
        found = tok.token_to_id(token)
        if found is not None:
            return int(found)
    return 0


def _probabilities(logits: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(probability of label 1, its logit) from (n, 1) or (n, 2) logits."""
    logits = logits.astype(np.float64)
    if logits.ndim == 1 or logits.shape[1] == 1:
        z = logits.reshape(-1)
    else:
        z = logits[:, -1] - logits[:, 0]  # two classes: softmax(l)[1] = sigmoid(l1 - l0)
    return 1.0 / (1.0 + np.exp(-z)), z


class CrossEncoder:
    """A loaded cross-encoder. Thread-safe: one scoring call at a time per instance (a model call already uses the
    CPU threads it is given; two at once would only share them)."""

    def __init__(self, folder: Path, *, backend: Literal["onnx", "torch"], device: str, max_length: int,
                 max_batch_tokens: int, threads: int, truncation: Truncation) -> None:
        self.folder = folder
        self.backend = backend
        self.device = device
        self.max_length = max_length
        self.max_batch_tokens = max_batch_tokens
        self.name = folder.name
        self._tokenizer = _PairTokenizer(folder, max_length, truncation)
        self._lock = threading.Lock()
        self._seconds_per_token = 0.0  # EWMA over calls, for the deadline check
        self._session: Any = None
        self._model: Any = None
        self._torch: Any = None
        if backend == "onnx":
            import onnxruntime as ort

            path = find_onnx(folder)
            if path is None:
                raise FileNotFoundError(f"no ONNX export in {folder} (looked for {', '.join(ONNX_FILES)})")
            opts = ort.SessionOptions()
            if threads:
                opts.intra_op_num_threads = threads
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
            self._session = ort.InferenceSession(str(path), opts, providers=["CPUExecutionProvider"])
            self._inputs = {i.name for i in self._session.get_inputs()}
            self.name = f"{folder.name}:{path.name}"
        else:
            import torch
            from transformers import AutoModelForSequenceClassification

            if threads:
                torch.set_num_threads(threads)
            self._torch = torch
            self._model = AutoModelForSequenceClassification.from_pretrained(
                str(folder), local_files_only=True).to(device).eval()
            self._inputs = {"input_ids", "attention_mask", "token_type_ids"}

    @classmethod
    def load(cls, folder: str | Path, *, backend: Backend = "auto", device: str = "cpu", max_length: int = 256,
             max_batch_tokens: int = 4096, threads: int = 0,
             truncation: Truncation = "longest_first") -> CrossEncoder:
        """Loads a Hugging Face sequence-classification folder (``config.json``, weights and/or an ONNX export,
        ``tokenizer.json``). ``max_length``: tokens of one pair (both texts, truncated ``truncation``-wise)."""
        path = Path(folder).expanduser()
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model folder (no config.json)")
        chosen: Literal["onnx", "torch"]
        if backend == "auto":
            chosen = "onnx" if device == "cpu" and find_onnx(path) is not None else "torch"
        else:
            chosen = backend
        model = cls(path, backend=chosen, device=device, max_length=max_length, max_batch_tokens=max_batch_tokens,
                    threads=threads, truncation=truncation)
        log.info("cross-encoder loaded", extra={"model": model.name, "backend": chosen, "device": device})
        return model

    def estimate_s(self, pairs: Sequence[tuple[str, str]]) -> float:
        """Predicted seconds to score these pairs (0 until a call has been measured)."""
        if not self._seconds_per_token:
            return 0.0
        chars = sum(len(a) + len(b) for a, b in pairs)
        return self._seconds_per_token * min(chars / 4 + 3 * len(pairs), self.max_length * len(pairs))

    def score(self, pairs: Sequence[tuple[str, str]], *, deadline: float | None = None) -> Scores:
        """Scores of the pairs, in order. ``deadline``: a ``time.monotonic()`` instant; raises
        :class:`DeadlineExceeded` when the work cannot be done by then."""
        started = time.perf_counter()
        n = len(pairs)
        if not n:
            return Scores(np.zeros(0), np.zeros(0), 0, 0.0)
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0 or self.estimate_s(pairs) > left:
                raise DeadlineExceeded(f"scoring {n} pairs needs ~{self.estimate_s(pairs) * 1000:.0f} ms, "
                                       f"{max(left, 0) * 1000:.0f} ms left", scored=0, total=n)
        logits = np.zeros((n, 1), dtype=np.float64)
        tokens = 0
        with self._lock:
            groups = self._tokenizer.groups(self._tokenizer.encode(pairs), self.max_batch_tokens)
            done = 0
            for rows, ids, types, mask in groups:
                if deadline is not None and done and time.monotonic() > deadline:
                    raise DeadlineExceeded(f"deadline passed after {done} of {n} pairs", scored=done, total=n)
                out = self._run(ids, types, mask)
                if logits.shape[1] != out.shape[1]:
                    logits = np.zeros((n, out.shape[1]), dtype=np.float64)
                    if done:  # pragma: no cover - a model's output width does not change between batches
                        raise RuntimeError("the model's output width changed between batches")
                logits[rows] = out
                done += len(rows)
                tokens += ids.size
        seconds = time.perf_counter() - started
        per_token = seconds / max(tokens, 1)
        self._seconds_per_token = per_token if not self._seconds_per_token else (
            0.8 * self._seconds_per_token + 0.2 * per_token)
        probs, z = _probabilities(logits)
        return Scores(probs, z, tokens, seconds)

    def _run(self, ids: np.ndarray, types: np.ndarray, mask: np.ndarray) -> np.ndarray:
        if self._session is not None:
            feeds: dict[str, Any] = {"input_ids": ids, "attention_mask": mask}
            if "token_type_ids" in self._inputs:
                feeds["token_type_ids"] = types
            return np.asarray(self._session.run(None, feeds)[0])
        torch = self._torch
        with torch.inference_mode():
            kwargs = {"input_ids": torch.from_numpy(ids).to(self.device),
                      "attention_mask": torch.from_numpy(mask).to(self.device)}
            if getattr(self._model.config, "type_vocab_size", 0) > 1:
                kwargs["token_type_ids"] = torch.from_numpy(types).to(self.device)
            return np.asarray(self._model(**kwargs).logits.float().cpu().numpy())

    def warm_up(self) -> None:
        """One call on a typical pair, so the first request does not pay for allocation and the deadline check has a
        cost per token to go by."""
        self.score([("warm up the model", "a short passage to score against the query " * 4)])


def blend_ranks(n: int, logits: np.ndarray, weight: float, k: float = BLEND_K) -> np.ndarray:
    """The order of ``n`` first-stage candidates (given best first) after the cross-encoder: reciprocal-rank fusion
    of the model's ranking (``weight``) and the first stage's (``1 - weight``); weight 1 = the model alone."""
    ce_rank = np.empty(n)
    ce_rank[np.argsort(-logits, kind="stable")] = np.arange(n)
    score = weight / (k + ce_rank) + (1 - weight) / (k + np.arange(n))
    return np.argsort(-score, kind="stable")


def load_configured(mode: str, folder: str, *, kind: str, setting: str, backend: Backend = "auto",
                    device: str = "cpu", threads: int = 0, max_length: int = 0,
                    truncation: Truncation = "longest_first") -> tuple[CrossEncoder, Any] | None:
    """What a service's settings ask for: ``mode`` ``none`` → None; ``auto`` → the model in ``folder`` if there is
    one, else None; ``cross-encoder`` → the model, or ValueError naming ``setting`` and the command that makes one.
    Returns the warmed-up model and its card (None for a folder ``goodput train`` did not write); ``max_length`` 0 =
    the card's, else 256."""
    from goodput_crossencoder.card import read_card

    if mode == "none":
        return None
    path = Path(folder).expanduser() if folder else None
    if path is None or not (path / "config.json").is_file():
        if mode == "cross-encoder":
            raise ValueError(f"{kind}=cross-encoder needs a model folder in {setting} (got {folder!r}); "
                             f"`goodput train {kind}` makes one")
        log.info("no %s model configured", kind, extra={"path": folder})
        return None
    card = read_card(path)
    model = CrossEncoder.load(path, backend=backend, device=device, threads=threads, truncation=truncation,
                              max_length=max_length or (card.max_length if card else 256))
    model.warm_up()
    return model, card
