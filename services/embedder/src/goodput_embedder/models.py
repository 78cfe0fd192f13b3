"""The embedding model this service runs, chosen by settings (``GOODPUT_EMBEDDER_MODEL``).

The models themselves live in the shared ``goodput_minilm`` library (the cache runs the same one in-process):
``minilm-onnx-int8`` is :class:`goodput_minilm.OnnxMiniLM`, ``minilm-torch`` :class:`goodput_minilm.TorchMiniLM`.

Example::

    model = load_model(settings)
    vectors = model.embed(["what is goodput?"])   # numpy array (1, 384), float32
"""

from __future__ import annotations

from goodput_minilm import Embedder, OnnxMiniLM, TorchMiniLM

from goodput_embedder.config import EmbedderSettings

__all__ = ["Embedder", "load_model"]


def load_model(settings: EmbedderSettings) -> Embedder:
    if settings.model == "minilm-torch":
        return TorchMiniLM(model_path=settings.model_path, device=settings.device,
                           max_tokens=settings.max_seq_tokens, threads=settings.intra_op_threads,
                           max_batch_tokens=settings.max_batch_tokens)
    return OnnxMiniLM(model_path=settings.model_path, max_tokens=settings.max_seq_tokens,
                      threads=settings.intra_op_threads, max_batch_tokens=settings.max_batch_tokens,
                      spin=settings.intra_op_spin)
