"""Rerank in the retriever with a real cross-encoder (goodput_testing's tiny one: its verdicts are arbitrary, the
behaviour under test is the step around it): the fused top-K is read, top-N kept, a deadline that is too short or
a missing model serves the fused order and says why."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from goodput_retriever.config import RetrieverSettings
from goodput_retriever.rerank import CrossEncoderReranker, load_reranker
from goodput_retriever.search import Retriever, SearchQuery

from .test_search import DOCS, load  # type: ignore[import-not-found]

MORE = {f"note-{i}": f"Maintenance note {i}: a bicycle chain wears out and needs replacing after {i} thousand km."
        for i in range(12)}


def test_auto_without_a_model_is_off_and_a_required_model_must_exist(tmp_path: Path) -> None:
    assert load_reranker(RetrieverSettings()) is None
    assert load_reranker(RetrieverSettings(reranker_model=str(tmp_path / "missing"))) is None
    with pytest.raises(ValueError, match="goodput train reranker"):
        load_reranker(RetrieverSettings(reranker="cross-encoder", reranker_model=str(tmp_path / "missing")))


async def test_rerank_reads_the_fused_top_k_and_keeps_top_n(retriever: Retriever, model,  # type: ignore[no-untyped-def]
                                                            tiny_cross_encoder: Path) -> None:
    await load(retriever, model, "acme", "kb", {**DOCS, **MORE})
    retriever.settings = retriever.settings.model_copy(update={"rerank_candidates": 6, "rerank_top_n": 3})
    reranker = load_reranker(retriever.settings.model_copy(update={"reranker_model": str(tiny_cross_encoder)}))
    assert isinstance(reranker, CrossEncoderReranker)
    retriever.reranker = reranker
    fused = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="bicycle chain", top_k=10))
    r = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="bicycle chain", top_k=10, rerank=True))
    assert r.rerank.status == "applied" and r.rerank.candidates == 6 and r.rerank.model == reranker.name
    assert len(r.hits) == 3  # min(top_k, rerank_top_n)
    assert {h.chunk_id for h in r.hits} <= {h.chunk_id for h in fused.hits[:6]}  # only the fused top-K is read
    assert all(0 < h.score < 1 and "fused_score" in h.metadata for h in r.hits)
    assert [t.ok for t in r.timings if t.leg == "rerank"] == [True]
    # blend 0 keeps the fused order; blend 1 is the model's order
    reranker.blend = 0.0
    r0 = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="bicycle chain", top_k=10, rerank=True))
    assert [h.chunk_id for h in r0.hits] == [h.chunk_id for h in fused.hits[:3]]
    reranker.blend = 1.0
    scores = reranker.model.score([("bicycle chain", h.text) for h in fused.hits[:6]]).probabilities
    best = sorted(range(6), key=lambda i: -scores[i])[:3]
    r1 = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="bicycle chain", top_k=10, rerank=True))
    assert [h.chunk_id for h in r1.hits] == [fused.hits[i].chunk_id for i in best]


async def test_a_deadline_too_short_for_the_model_serves_the_fused_order(retriever: Retriever, model,  # type: ignore[no-untyped-def]
                                                                        tiny_cross_encoder: Path) -> None:
    await load(retriever, model, "acme", "kb", {**DOCS, **MORE})
    retriever.reranker = load_reranker(retriever.settings.model_copy(
        update={"reranker_model": str(tiny_cross_encoder)}))
    fused = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="bicycle chain"))
    r = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="bicycle chain", rerank=True,
                                           rerank_budget_s=1e-6))
    assert r.rerank.status == "skipped" and r.rerank.reason == "budget"
    assert [h.chunk_id for h in r.hits] == [h.chunk_id for h in fused.hits]
    assert any(n.startswith("rerank skipped: over its budget") for n in r.notes)
    # the request's deadline reached by the time the rerank would start (the legs used it up)
    from goodput_retriever.search import SearchResult

    late = SearchQuery(tenant="acme", kb="kb", query="bicycle chain", rerank=True, deadline=time.monotonic() - 0.001)
    result = SearchResult(hits=[])
    kept = await retriever._rerank(late, list(fused.hits), 5, result)
    assert kept == list(fused.hits) and (result.rerank.status, result.rerank.reason) == ("skipped", "deadline")
    assert any(n.startswith("rerank skipped: over its deadline") for n in result.notes)


async def test_rerank_counts_its_outcomes(retriever: Retriever, model, tiny_cross_encoder: Path) -> None:  # type: ignore[no-untyped-def]
    from prometheus_client import CollectorRegistry

    from goodput_retriever.search import RetrieverMetrics

    registry = CollectorRegistry()
    retriever.metrics = RetrieverMetrics(registry)
    await load(retriever, model, "acme", "kb", DOCS)
    await retriever.search(SearchQuery(tenant="acme", kb="kb", query="tea", rerank=True))
    retriever.reranker = load_reranker(retriever.settings.model_copy(
        update={"reranker_model": str(tiny_cross_encoder)}))
    await retriever.search(SearchQuery(tenant="acme", kb="kb", query="tea", rerank=True))
    value = registry.get_sample_value
    assert value("goodput_retriever_rerank_total", {"outcome": "skipped_no_model"}) == 1
    assert value("goodput_retriever_rerank_total", {"outcome": "applied"}) == 1


async def test_the_grpc_answer_says_what_happened_to_the_rerank(retriever: Retriever, model,  # type: ignore[no-untyped-def]
                                                               tiny_cross_encoder: Path) -> None:
    import grpc
    from goodput.retriever.v1 import retriever_pb2, retriever_pb2_grpc

    from goodput_retriever.servicer import RetrievalServicer

    await load(retriever, model, "acme", "kb", {**DOCS, **MORE})
    server = grpc.aio.server()
    retriever_pb2_grpc.add_RetrievalServicer_to_server(RetrievalServicer(retriever), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = retriever_pb2_grpc.RetrievalStub(channel)
            ask = retriever_pb2.SearchRequest(tenant="acme", knowledge_base="kb", query="bicycle chain", rerank=True)
            r = await stub.Search(ask, timeout=30)
            assert (r.rerank.status, r.rerank.reason) == ("skipped", "no model") and r.hits
            retriever.reranker = load_reranker(retriever.settings.model_copy(
                update={"reranker_model": str(tiny_cross_encoder)}))
            r = await stub.Search(ask, timeout=30)
            assert r.rerank.status == "applied" and r.rerank.candidates > 0 and r.rerank.seconds > 0
            assert len(r.hits) == retriever.settings.rerank_top_n
            plain = await stub.Search(retriever_pb2.SearchRequest(tenant="acme", knowledge_base="kb",
                                                                  query="bicycle chain"), timeout=30)
            assert plain.rerank.status == ""  # not asked for
    finally:
        await server.stop(None)
