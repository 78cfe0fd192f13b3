"""The pluggable reranker step: the fused top candidates in, the best ``top_n`` out.

No cross-encoder weights ship offline, so the only built-in choice is ``none``; a deployment with a cross-encoder
(an ONNX file, a Triton model) implements :class:`Reranker` and is selected by ``GOODPUT_RETRIEVER_RERANKER``.
When a request asks for rerank and none is configured, the search still succeeds and says "rerank skipped".

Example:
    >>> class MyCrossEncoder:
    ...     name = "my-ce"
    ...     def rerank(self, query: str, hits: list[Hit], top_n: int) -> list[Hit]: ...
"""

from __future__ import annotations

from typing import Protocol

from goodput_retriever.fusion import Hit

__all__ = ["Reranker", "load_reranker"]


class Reranker(Protocol):
    name: str

    def rerank(self, query: str, hits: list[Hit], top_n: int) -> list[Hit]:
        ...


def load_reranker(name: str) -> Reranker | None:
    if name == "none":
        return None
    raise ValueError(f"unknown reranker {name!r}")
