"""all-MiniLM-L6-v2 sentence embeddings, from installed packages only (nothing is downloaded).

Example:
    >>> from goodput_minilm import OnnxMiniLM
    >>> OnnxMiniLM(threads=1).embed(["what is goodput?"]).shape
    (1, 384)
"""

from goodput_minilm.models import Embedder, OnnxMiniLM, TorchMiniLM, tokenizer_dir

__all__ = ["Embedder", "OnnxMiniLM", "TorchMiniLM", "tokenizer_dir"]
