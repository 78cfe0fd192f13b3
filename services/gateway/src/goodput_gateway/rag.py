"""Retrieval-augmented generation: a chat (or completion) request that names a knowledge base gets the best chunks
of that knowledge base (searched with the last user message, scoped to the caller's tenant) put in front of the
conversation, within the model's context budget, and the sources used go back to the caller.

Budget: the context may take what is left of the model's window after the answer (``max_tokens``, or the
default) and the conversation, in the gateway's one token estimate (``requests.estimate_tokens``),
capped by ``rag_max_context_chars`` and by ``max_prompt_chars``. Chunks go in rank order; one that does not fit
is left out with everything after it, so the sources returned are exactly the chunks the model saw.

The knowledge base is ``GenerationRequest.knowledge_base``: the REST body field ``knowledge_base`` or the header
``X-Goodput-Knowledge-Base``; gRPC ``GenerateRequest.knowledge_base``.

Example: ``knowledge`` is a :class:`goodput_gateway.knowledge.Knowledge` (a retriever behind it); here a stand-in
answers the search with two chunks, and both fit the budget:

    >>> import asyncio
    >>> from goodput.retriever.v1 import retriever_pb2
    >>> class Handbook:
    ...     async def search(self, tenant: str, kb: str, query: str, *, top_k: int) -> retriever_pb2.SearchResponse:
    ...         return retriever_pb2.SearchResponse(hits=[
    ...             retriever_pb2.Hit(chunk_id="c1", document_id="d1", score=0.9, text="Refunds take 5 days."),
    ...             retriever_pb2.Hit(chunk_id="c2", document_id="d2", score=0.7, text="Ask support.")])
    >>> req = GenerationRequest(messages=(Message("user", "How long do refunds take?"),), knowledge_base="handbook")
    >>> request, sources = asyncio.run(augment(Handbook(), GatewaySettings(), tenant="acme", request=req,
    ...                                        max_model_len=2048))
    >>> [s.chunk_id for s in sources]
    ['c1', 'c2']
    >>> print(request.messages[0].content.split("Context:")[1].strip())
    [1] Refunds take 5 days.
    <BLANKLINE>
    [2] Ask support.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from goodput_core.errors import InvalidArgument

from goodput_gateway.config import GatewaySettings
from goodput_gateway.profile import ClassProfile
from goodput_gateway.requests import CHARS_PER_TOKEN, GenerationRequest, Message, estimate_tokens

__all__ = ["KB_HEADER", "Retrieval", "Source", "augment", "retrieval_for"]

KB_HEADER = "x-goodput-knowledge-base"
INSTRUCTION = ("Answer the question using the context below. Each context passage starts with its number; cite "
               "the numbers you used, like [1]. If the context does not contain the answer, say so.")


@dataclass(frozen=True)
class Source:
    chunk_id: str
    document_id: str
    score: float
    text: str


@dataclass(frozen=True)
class Retrieval:
    """How one request retrieves: chunks asked for (0 = rag_top_k), rerank, and the share of the context budget
    it may fill (the degradation ladder's fewer_chunks step halves both)."""

    top_k: int = 0
    rerank: bool = False
    context_share: float = 1.0
    leg_budget_s: float = 0.0  # each leg's budget (the class's retrieval_leg), 0 = the retriever's own
    rerank_budget_s: float = 0.0
    legs: dict[str, float] = field(default_factory=dict, compare=False)  # filled: each leg's seconds
    # filled: what the retriever did with the rerank asked for ("applied", "skipped: deadline", ...)
    outcome: dict[str, str] = field(default_factory=dict, compare=False)


def retrieval_for(cls: ClassProfile, settings: GatewaySettings, *, steps: Sequence[str],
                  remaining_s: float) -> tuple[Retrieval, list[str]]:
    """How a request of class ``cls`` retrieves, and the ladder steps that takes: the RAG steps in force
    (``steps``), or taken for this request alone when the time it has left cannot cover its retrieval and prefill
    budgets."""
    at_risk = remaining_s < cls.budgets.retrieval + cls.budgets.ttft
    take = {s for s in ("skip_rerank", "fewer_chunks") if s in cls.ladder and (s in steps or at_risk)}
    rerank, taken = settings.rag.rerank, []
    if rerank and "skip_rerank" in take:
        rerank = False
        taken.append("skip_rerank")
    legs, rerank_s = cls.budgets.retrieval_leg, cls.budgets.rerank
    if "fewer_chunks" in take:
        taken.append("fewer_chunks")
        return Retrieval(top_k=max(settings.rag.top_k // 2, 1), rerank=rerank, context_share=0.5,
                         leg_budget_s=legs, rerank_budget_s=rerank_s), taken
    return Retrieval(rerank=rerank, leg_budget_s=legs, rerank_budget_s=rerank_s), taken


def _query(request: GenerationRequest) -> str:
    for m in reversed(request.messages):
        if m.role == "user" and m.content.strip():
            return m.content
    return request.prompt


def context_budget(request: GenerationRequest, settings: GatewaySettings, max_model_len: int) -> int:
    answer = request.sampling.max_tokens or settings.default_max_tokens
    left_tokens = max_model_len - answer - estimate_tokens(request.prompt_chars()) - 64
    return max(0, min(left_tokens * CHARS_PER_TOKEN, settings.rag.max_context_chars,
                      settings.limits.prompt_chars - request.prompt_chars() - len(INSTRUCTION) - 64))


async def augment(knowledge: Any, settings: GatewaySettings, *, tenant: str, request: GenerationRequest,
                  max_model_len: int, timeout_s: float | None = None,
                  how: Retrieval = Retrieval()) -> tuple[GenerationRequest, list[Source]]:
    """The request with the best chunks of ``request.knowledge_base`` in front, and the chunks used."""
    query = _query(request)
    if not query.strip():
        raise InvalidArgument("a RAG request needs a user message to search with", param="messages",
                              code="invalid_value")
    extra: dict[str, Any] = {"timeout_s": timeout_s} if timeout_s else {}
    if how.rerank:
        extra["rerank"] = True
    if how.leg_budget_s or how.rerank_budget_s:
        extra.update(leg_budget_s=how.leg_budget_s, rerank_budget_s=how.rerank_budget_s)
    result = await knowledge.search(tenant, request.knowledge_base, query[:settings.rag.max_query_chars],
                                    top_k=how.top_k or settings.rag.top_k, **extra)
    how.legs.update({t.leg: t.seconds for t in getattr(result, "timings", ())})
    rerank = getattr(result, "rerank", None)
    if how.rerank and rerank is not None and rerank.status:
        how.outcome["rerank"] = rerank.status + (f": {rerank.reason}" if rerank.reason else "")
    budget = int(context_budget(request, settings, max_model_len) * how.context_share)
    sources: list[Source] = []
    parts: list[str] = []
    used = 0
    for hit in result.hits:
        passage = f"[{len(sources) + 1}] {hit.text.strip()}"
        if used + len(passage) + 2 > budget:
            break
        parts.append(passage)
        used += len(passage) + 2
        sources.append(Source(chunk_id=hit.chunk_id, document_id=hit.document_id, score=float(hit.score),
                              text=hit.text))
    if not sources:
        return request, []
    context = f"{INSTRUCTION}\n\nContext:\n" + "\n\n".join(parts)
    if request.messages:
        return replace(request, messages=(Message(role="system", content=context), *request.messages)), sources
    return replace(request, prompt=f"{context}\n\n{request.prompt}"), sources
