"""Hybrid search over real stores: fusion, tenant isolation, degraded legs, bad input, rebuild alias swaps."""

from __future__ import annotations

import asyncio
import os
import uuid

import pytest

from goodput_core.errors import InvalidArgument, NotFound, Unavailable

from goodput_retriever.fusion import Hit, normalise, rrf, weighted
from goodput_retriever.search import Retriever, SearchQuery

from .conftest import chunks  # type: ignore[import-not-found]

DOCS = {
    "tea": "Green tea contains catechins, antioxidants linked to heart health.",
    "coffee": "Coffee beans are roasted seeds; caffeine is the main stimulant in espresso.",
    "bikes": "A bicycle chain should be cleaned and lubricated every few hundred kilometres.",
    "tax": "Form 1040 is the US individual income tax return, due in April.",
}


async def load(retriever: Retriever, model, tenant: str, kb: str, docs: dict[str, str]) -> None:  # type: ignore[no-untyped-def]
    await retriever.open(tenant, kb)
    await retriever.write(tenant, kb, upserts=chunks(model, docs), delete_chunk_ids=[], delete_document_ids=[],
                          generation="", kb_version=1)


def test_rrf_and_weighted_fusion() -> None:
    dense = [Hit("a", "A", 0.9), Hit("b", "B", 0.8), Hit("c", "C", 0.1)]
    lexical = [Hit("c", "C", 12.0), Hit("b", "B", 3.0)]
    fused = rrf([dense, lexical], k=60)
    assert [h.chunk_id for h in fused] == ["c", "b", "a"]  # c: 1/63+1/61 just beats b: 1/62+1/62
    assert fused[0].score == pytest.approx(1 / 63 + 1 / 61) and fused[2].score == pytest.approx(1 / 61)
    assert normalise(dense) == {"a": 1.0, "b": pytest.approx(0.875), "c": 0.0}
    assert [h.chunk_id for h in weighted(dense, lexical, dense_weight=1.0)][:2] == ["a", "b"]
    assert [h.chunk_id for h in weighted(dense, lexical, dense_weight=0.0)][0] == "c"


async def test_hybrid_search_finds_by_meaning_and_by_words(retriever: Retriever, model) -> None:  # type: ignore[no-untyped-def]
    await load(retriever, model, "acme", "kb", DOCS)
    r = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="what keeps my heart healthy to drink?"))
    assert r.hits[0].document_id == "tea" and not r.degraded and r.kb_version == 1
    assert {t.leg for t in r.timings} == {"dense", "lexical", "fusion"}
    r = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="1040", fusion="weighted", dense_weight=0.2))
    assert r.hits[0].document_id == "tax"
    r = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="espresso", fusion="lexical", top_k=1))
    assert [h.document_id for h in r.hits] == ["coffee"] and [t.leg for t in r.timings] == ["lexical", "fusion"]


async def test_tenant_a_never_retrieves_tenant_b(retriever: Retriever, model) -> None:  # type: ignore[no-untyped-def]
    secret = "The launch code of tenant B is PINEAPPLE-7781."
    await load(retriever, model, "tenant-a", "shared-name", DOCS)
    await load(retriever, model, "tenant-b", "shared-name", {"secret": secret, **DOCS})
    await load(retriever, model, "tenant-a", "other", {"secret-a": "nothing to see"})
    for query in (secret, "PINEAPPLE-7781 launch code", "tenant B", "*", "secret"):
        for fusion in ("rrf", "weighted", "dense", "lexical"):
            r = await retriever.search(SearchQuery(tenant="tenant-a", kb="shared-name", query=query, fusion=fusion,
                                                   top_k=50, recall_k=200))
            assert all(h.document_id != "secret" and "PINEAPPLE" not in h.text for h in r.hits)
    # Names that try to escape their scope are refused, not interpreted.
    for tenant, kb in (("tenant-a", "shared-name/../x"), ("tenant-a*", "shared-name"), ("tenant-a", "*")):
        with pytest.raises(InvalidArgument):
            await retriever.search(SearchQuery(tenant=tenant, kb=kb, query="secret"))
    with pytest.raises(NotFound):
        await retriever.search(SearchQuery(tenant="tenant-c", kb="shared-name", query="secret"))


async def test_one_leg_down_gives_degraded_results_not_an_error(retriever: Retriever, model, embedder) -> None:  # type: ignore[no-untyped-def]
    await load(retriever, model, "acme", "kb", DOCS)
    embedder.fail = True
    r = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="bicycle chain"))
    assert r.degraded and r.hits[0].document_id == "bikes"
    assert any("dense leg failed" in n for n in r.notes)
    embedder.fail, embedder.delay_s = False, 2.0  # slower than leg_timeout_s
    r = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="bicycle chain"))
    assert r.degraded and any("timed out" in n for n in r.notes) and r.hits
    embedder.delay_s = 0.0

    def broken(*a, **k):  # type: ignore[no-untyped-def]
        raise RuntimeError("index corrupted")

    retriever.lexical.search = broken  # type: ignore[method-assign]
    r = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="bicycle chain"))
    assert r.degraded and r.hits[0].document_id == "bikes" and any("lexical leg failed" in n for n in r.notes)
    embedder.fail = True
    with pytest.raises(Unavailable):
        await retriever.search(SearchQuery(tenant="acme", kb="kb", query="bicycle chain"))


@pytest.mark.parametrize("query, message", [
    (SearchQuery(tenant="acme", kb="kb", query=""), "query"),
    (SearchQuery(tenant="acme", kb="kb", query="   "), "query"),
    (SearchQuery(tenant="acme", kb="kb", query="x" * 5000), "query"),
    (SearchQuery(tenant="acme", kb="kb", query="ok", dense_weight=1.5, fusion="weighted"), "dense_weight"),
    (SearchQuery(tenant="acme", kb="kb", query="ok", dense_weight=float("nan")), "dense_weight"),
    (SearchQuery(tenant="acme", kb="kb", query="ok", top_k=51), "top_k"),
    (SearchQuery(tenant="acme", kb="kb", query="ok", fusion="magic"), "fusion"),
    (SearchQuery(tenant="acme", kb="", query="ok"), "knowledge_base"),
])
async def test_bad_queries_are_invalid_argument(retriever: Retriever, model, query, message) -> None:  # type: ignore[no-untyped-def]
    await load(retriever, model, "acme", "kb", DOCS)
    with pytest.raises(InvalidArgument) as info:
        await retriever.search(query)
    assert info.value.param == message


async def test_rerank_without_a_reranker_is_skipped_with_a_note(retriever: Retriever, model) -> None:  # type: ignore[no-untyped-def]
    await load(retriever, model, "acme", "kb", DOCS)
    r = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="tea", rerank=True))
    assert "rerank skipped: no reranker model configured" in r.notes and r.hits and not r.degraded
    assert (r.rerank.status, r.rerank.reason) == ("skipped", "no model")


async def test_rebuild_is_invisible_until_the_alias_switch(retriever: Retriever, model) -> None:  # type: ignore[no-untyped-def]
    await load(retriever, model, "acme", "kb", DOCS)
    gen = await retriever.begin_rebuild("acme", "kb")
    await retriever.write("acme", "kb", upserts=chunks(model, {"new": "Sourdough bread needs a starter."}),
                          delete_chunk_ids=[], delete_document_ids=[], generation=gen, kb_version=0)
    r = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="sourdough starter bread", top_k=10))
    assert "new" not in {h.document_id for h in r.hits} and len(r.hits) == 4
    await retriever.commit_rebuild("acme", "kb", gen, 2)
    r = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="sourdough starter bread", top_k=10))
    assert [h.document_id for h in r.hits] == ["new"] and r.kb_version == 2
    with pytest.raises(NotFound):
        await retriever.commit_rebuild("acme", "kb", "nonexistent", 3)


async def test_tantivy_on_disk_survives_a_restart_and_the_pointer_switch_is_atomic(tmp_path, model) -> None:  # type: ignore[no-untyped-def]
    from goodput_retriever.tantivy_index import TantivyIndex

    idx = TantivyIndex(str(tmp_path))
    idx.ensure("acme", "kb")
    idx.upsert("acme", "kb", chunks(model, DOCS))
    idx.close()
    again = TantivyIndex(str(tmp_path))
    assert again.search("acme", "kb", "espresso", 5)[0].document_id == "coffee"
    again.begin_rebuild("acme", "kb", "g2")
    again.upsert("acme", "kb", chunks(model, {"x": "espresso machine manual"}), generation="g2")
    assert again.search("acme", "kb", "espresso", 5)[0].document_id == "coffee"
    again.commit_rebuild("acme", "kb", "g2")
    assert [h.document_id for h in again.search("acme", "kb", "espresso", 5)] == ["x"]
    dirs = [p.name for p in next(tmp_path.iterdir()).iterdir()]
    assert sorted(dirs) == ["CURRENT", "g2"]  # the old generation is gone, no temp files left


ES_URL = os.environ.get("GOODPUT_TEST_ELASTICSEARCH_URL", "")
QDRANT_URL = os.environ.get("GOODPUT_TEST_QDRANT_URL", "")


@pytest.mark.skipif(not ES_URL, reason="needs an Elasticsearch cluster: set GOODPUT_TEST_ELASTICSEARCH_URL (none can "
                                       "run on this machine); the same tests then run against it")
async def test_elasticsearch_backend_behaves_like_the_embedded_one(embedder, model) -> None:  # type: ignore[no-untyped-def]
    from goodput_retriever.config import RetrieverSettings
    from goodput_retriever.elastic_index import ElasticsearchIndex
    from goodput_retriever.qdrant_store import QdrantStore

    retriever = Retriever(RetrieverSettings(), vectors=QdrantStore(location=":memory:"),
                          lexical=ElasticsearchIndex(url=ES_URL, api_key=os.environ.get(
                              "GOODPUT_TEST_ELASTICSEARCH_API_KEY", ""), replicas=0), embedder=embedder)
    kb = f"t{uuid.uuid4().hex[:8]}"
    await load(retriever, model, "acme", kb, DOCS)
    r = await retriever.search(SearchQuery(tenant="acme", kb=kb, query="espresso", fusion="lexical"))
    assert r.hits[0].document_id == "coffee"
    gen = await retriever.begin_rebuild("acme", kb)
    await retriever.write("acme", kb, upserts=chunks(model, {"x": "espresso manual"}), delete_chunk_ids=[],
                          delete_document_ids=[], generation=gen, kb_version=0)
    await retriever.commit_rebuild("acme", kb, gen, 2)
    r = await retriever.search(SearchQuery(tenant="acme", kb=kb, query="espresso", fusion="lexical"))
    assert [h.document_id for h in r.hits] == ["x"]
    await load(retriever, model, "other", kb, {"secret": "espresso secret"})
    r = await retriever.search(SearchQuery(tenant="acme", kb=kb, query="espresso secret", fusion="lexical"))
    assert "secret" not in {h.document_id for h in r.hits}


@pytest.mark.skipif(not QDRANT_URL, reason="needs a Qdrant server: set GOODPUT_TEST_QDRANT_URL (none can run on this "
                                           "machine); local mode runs the same code in every other test")
async def test_qdrant_server_backend(embedder, model) -> None:  # type: ignore[no-untyped-def]
    from goodput_retriever.config import RetrieverSettings
    from goodput_retriever.qdrant_store import QdrantStore
    from goodput_retriever.tantivy_index import TantivyIndex

    retriever = Retriever(RetrieverSettings(), vectors=QdrantStore(url=QDRANT_URL, api_key=os.environ.get(
        "GOODPUT_TEST_QDRANT_API_KEY", "")), lexical=TantivyIndex(":memory:"), embedder=embedder)
    kb = f"t{uuid.uuid4().hex[:8]}"
    await load(retriever, model, "acme", kb, DOCS)
    r = await retriever.search(SearchQuery(tenant="acme", kb=kb, query="heart healthy drink", fusion="dense"))
    assert r.hits[0].document_id == "tea"
    gen = await retriever.begin_rebuild("acme", kb)
    await retriever.commit_rebuild("acme", kb, gen, 2)
    r = await retriever.search(SearchQuery(tenant="acme", kb=kb, query="tea", fusion="dense"))
    assert r.hits == []


async def test_concurrent_searches_share_nothing_mutable(retriever: Retriever, model) -> None:  # type: ignore[no-untyped-def]
    await load(retriever, model, "acme", "kb", DOCS)
    results = await asyncio.gather(*(retriever.search(SearchQuery(tenant="acme", kb="kb", query=q))
                                     for q in ("tea", "coffee", "bicycle", "tax") * 5))
    assert [r.hits[0].document_id for r in results] == ["tea", "coffee", "bikes", "tax"] * 5


async def test_a_foreign_chunk_planted_in_a_collection_is_never_returned(retriever: Retriever, model) -> None:  # type: ignore[no-untyped-def]
    from qdrant_client import models

    from goodput_retriever.stores import base_name

    await load(retriever, model, "tenant-a", "kb", DOCS)
    vector = model.embed(["green tea heart"])[0].tolist()
    retriever.vectors.client.upsert(base_name("tenant-a", "kb"), points=[models.PointStruct(  # type: ignore[attr-defined]
        id=str(uuid.uuid4()), vector=vector, payload={"tenant": "tenant-b", "kb": "kb", "chunk_id": "planted",
                                                      "document_id": "planted", "text": "tenant B data"})])
    r = await retriever.search(SearchQuery(tenant="tenant-a", kb="kb", query="green tea heart", fusion="dense"))
    assert r.hits and "planted" not in {h.document_id for h in r.hits}


async def test_each_leg_and_the_rerank_run_under_the_callers_budget(retriever: Retriever, model, embedder) -> None:  # type: ignore[no-untyped-def]
    """The gateway's budgets per leg and for rerank (and the call's deadline) bound each part of the search: a leg
    over its budget is dropped (degraded, noted), a rerank over its budget leaves the fused order (noted)."""
    import time

    await load(retriever, model, "acme", "kb", DOCS)
    embedder.delay_s = 0.3  # under the retriever's own 0.5 s, over the caller's 0.1 s
    r = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="bicycle chain", leg_budget_s=0.1))
    assert r.degraded and any("dense leg timed out after 0.1 s" in n for n in r.notes) and r.hits
    r = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="bicycle chain",
                                           deadline=time.monotonic() + 0.1))  # the call's time left, likewise
    assert r.degraded and any("dense leg timed out" in n for n in r.notes)
    embedder.delay_s = 0.0

    class SlowReranker:
        name = "slow"

        def rerank(self, query, hits, top_n, *, deadline=None):  # type: ignore[no-untyped-def]
            time.sleep(0.3)
            return list(reversed(hits))[:top_n]

    retriever.reranker = SlowReranker()  # type: ignore[assignment]
    fused = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="bicycle chain"))
    r = await retriever.search(SearchQuery(tenant="acme", kb="kb", query="bicycle chain", rerank=True,
                                           rerank_budget_s=0.05))
    assert [h.chunk_id for h in r.hits] == [h.chunk_id for h in fused.hits]
    assert any("rerank skipped: over its budget" in n for n in r.notes)
    assert [t.ok for t in r.timings if t.leg == "rerank"] == [False]
