"""Cross-encoders shared by the retriever (a reranker) and the cache (a paraphrase verifier): loading any Hugging Face
sequence-classification folder, batched scoring under a deadline, and ``goodput train`` to make Goodput's own from
the MiniLM checkpoint."""

from goodput_crossencoder.card import ModelCard, read_card
from goodput_crossencoder.model import CrossEncoder, DeadlineExceeded, Scores, load_configured

__all__ = ["CrossEncoder", "DeadlineExceeded", "ModelCard", "Scores", "load_configured", "read_card"]
