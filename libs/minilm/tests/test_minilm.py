"""The shared all-MiniLM-L6-v2 model (the embedder serves it, the cache runs it in-process)."""

from __future__ import annotations

import numpy as np
import pytest

from goodput_minilm import OnnxMiniLM


@pytest.fixture(scope="module")
def model() -> OnnxMiniLM:
    return OnnxMiniLM(threads=1)


def test_vectors_are_unit_length_and_similar_questions_are_close(model: OnnxMiniLM) -> None:
    v = model.embed(["How do I reset my password?", "I forgot my password, how can I change it?",
                     "What is the capital of France?"])
    assert v.shape == (3, 384) and v.dtype == np.float32
    assert np.allclose(np.linalg.norm(v, axis=1), 1.0, atol=1e-4)
    assert v[0] @ v[1] > 0.7 > v[0] @ v[2]
    assert model.count_tokens(["hello world"]) == 4  # [CLS] hello world [SEP]


def test_a_batch_of_mixed_lengths_gives_each_text_its_own_vector(model: OnnxMiniLM) -> None:
    # the model runs the batch as several calls of similar lengths; none may mix up or pad away a text's vector
    texts = ["refund?", "How do I reset my password?", "word " * 400, "Is my data encrypted at rest or only in "
             "transit, and who holds the keys?", "refund?", "The quick brown fox " * 20]
    together = model.embed(texts)
    alone = np.vstack([model.embed([t]) for t in texts])
    np.testing.assert_allclose(together, alone, atol=1e-4)
    assert model.embed([]).shape == (0, 384)


def test_idle_threads_sleep_by_default_and_spinning_gives_the_same_vectors(model: OnnxMiniLM) -> None:
    def spins(m: OnnxMiniLM) -> bool:  # onnxruntime spins unless told otherwise (no entry)
        try:
            return m._session.get_session_options().get_session_config_entry("session.intra_op.allow_spinning") != "0"
        except RuntimeError:  # no entry
            return True

    spinning = OnnxMiniLM(threads=2, spin=True)
    assert not spins(model) and spins(spinning)
    texts = ["How do I reset my password?", "Is my data encrypted at rest?"]
    np.testing.assert_allclose(spinning.embed(texts), model.embed(texts), atol=1e-5)
