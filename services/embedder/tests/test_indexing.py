"""Indexing against real components: the ONNX model, Redis, and a real retriever (Qdrant local + tantivy)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from goodput_core.errors import InvalidArgument
from goodput_testing import async_wait_until

from goodput_embedder.indexer import Doc, Indexer
from goodput_retriever.search import SearchQuery

DOCS = [
    Doc(id="refunds", title="Refund policy", text="Refunds are issued within 14 days of purchase. "
        "Contact support with your order number to request a refund."),
    Doc(id="shipping", title="Shipping", text="Orders ship within two business days. Express shipping is "
        "available in the EU and the US."),
    Doc(id="faq", type="faq", text="Q: How do I reset my password?\nA: Use the 'forgot password' link.\n"
        "Q: Can I change my email?\nA: Yes, in account settings."),
]


async def search(retriever, kb: str, query: str, tenant: str = "acme", **kw):  # type: ignore[no-untyped-def]
    return await retriever.retriever.search(SearchQuery(tenant=tenant, kb=kb, query=query, top_k=10, **kw))


async def test_index_then_unchanged_is_zero_embeddings(indexer: Indexer, counting, retriever) -> None:
    first = await asyncio.to_thread(indexer.index_documents, "acme", "help", DOCS, [])
    assert first.chunks_embedded == 4 and first.documents_unchanged == 0 and first.kb_version >= 1
    embedded = counting.texts
    second = await asyncio.to_thread(indexer.index_documents, "acme", "help", DOCS, [])
    assert second.chunks_embedded == 0 and second.documents_unchanged == 3
    assert counting.texts == embedded  # the model was not called at all
    assert second.kb_version == first.kb_version + 1
    r = await search(retriever, "help", "how long do refunds take")
    assert r.hits[0].document_id == "refunds"
    assert r.kb_version == second.kb_version


async def test_changed_document_replaces_its_chunks_and_deleted_is_removed(indexer: Indexer, retriever) -> None:
    await asyncio.to_thread(indexer.index_documents, "acme", "help", DOCS, [])
    changed = Doc(id="faq", type="faq", text="Q: How do I reset my password?\nA: Use the 'forgot password' link.\n"
                  "Q: Do you offer gift cards?\nA: Gift cards are sold in every store.")
    r = await asyncio.to_thread(indexer.index_documents, "acme", "help", [changed], [])
    assert r.chunks_embedded == 1 and r.chunks_deleted == 1  # the unchanged entry is not re-embedded
    hits = (await search(retriever, "help", "change my email address", fusion="lexical")).hits
    assert all("email" not in h.text for h in hits)
    assert any("Gift cards" in h.text for h in (await search(retriever, "help", "gift cards")).hits)
    r = await asyncio.to_thread(indexer.index_documents, "acme", "help", [], ["shipping"])
    assert r.documents_deleted == 1 and r.chunks_deleted == 1
    hits = (await search(retriever, "help", "express shipping EU")).hits
    assert "shipping" not in {h.document_id for h in hits}


@pytest.mark.parametrize("doc, code", [
    (Doc(id="empty", text="   \n "), "empty_document"),
    (Doc(id="big", text="x" * (50 << 20)), "document_too_large"),
    (Doc(id="bin", text=bytes(range(256)).decode("latin-1") * 4), "binary_document"),
    (Doc(id="", text="no id"), "invalid_value"),
    (Doc(id="t", text="text", type="spreadsheet"), "invalid_value"),
])
async def test_bad_documents_are_rejected_and_nothing_is_written(indexer: Indexer, retriever, doc: Doc,
                                                                 code: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        await asyncio.to_thread(indexer.index_documents, "acme", "bad-kb", [DOCS[0], doc], [])
    assert info.value.code == code
    assert not await retriever.retriever.exists("acme", "bad-kb")  # not even the good document was written
    assert indexer.version("acme", "bad-kb") == 0


async def test_bad_names_and_empty_requests(indexer: Indexer) -> None:
    for tenant, kb in (("acme", ""), ("acme", "../etc"), ("", "kb"), ("acme", "a" * 65)):
        with pytest.raises(InvalidArgument):
            await asyncio.to_thread(indexer.index_documents, tenant, kb, DOCS, [])
    with pytest.raises(InvalidArgument):
        await asyncio.to_thread(indexer.index_documents, "acme", "kb", [], [])


async def test_a_job_killed_halfway_and_rerun_has_no_duplicates_and_nothing_missing(indexer: Indexer, counting,
                                                                                   retriever) -> None:
    docs = [Doc(id=f"d{i}", title=f"Doc {i}", text=f"Document number {i} talks about topic {i} at length.")
            for i in range(40)]
    counting.fail_after = 2
    indexer.settings = indexer.settings.model_copy(update={"write_batch": 8})
    with pytest.raises(RuntimeError):
        await asyncio.to_thread(indexer.run_job, "acme", "jobs", docs, full_rebuild=False, batch_docs=8)
    counting.fail_after = None
    r = await asyncio.to_thread(indexer.run_job, "acme", "jobs", docs, full_rebuild=False, batch_docs=8)
    assert r.documents_unchanged == 16 and r.chunks_embedded == 24  # the first two batches were complete
    hits = (await retriever.retriever.search(SearchQuery(tenant="acme", kb="jobs", query="document topic",
                                                         top_k=50, recall_k=200, fusion="lexical"))).hits
    ids = [h.chunk_id for h in hits]
    assert len(ids) == len(set(ids)) == 40
    assert {h.document_id for h in hits} == {d.id for d in docs}
    # Documents missing from the source are deleted by the next incremental job.
    r = await asyncio.to_thread(indexer.run_job, "acme", "jobs", docs[:30], full_rebuild=False)
    assert r.documents_deleted == 10 and r.chunks_embedded == 0


async def test_queries_during_a_full_rebuild_see_a_complete_index(indexer: Indexer, counting, retriever) -> None:
    old = [Doc(id=f"o{i}", text=f"old corpus entry {i} about apples") for i in range(12)]
    await asyncio.to_thread(indexer.run_job, "acme", "swap", old, full_rebuild=False)
    new = [Doc(id=f"n{i}", text=f"new corpus entry {i} about apples") for i in range(12)]
    counting.step = threading.Semaphore(0)  # the rebuild stops at each model call until the test has queried
    indexer.settings = indexer.settings.model_copy(update={"write_batch": 2})
    job = asyncio.ensure_future(asyncio.to_thread(indexer.run_job, "acme", "swap", new, full_rebuild=True,
                                                  batch_docs=2))
    seen: set[frozenset[str]] = set()
    queried = 0

    def at_the_next_call(n: int):  # type: ignore[no-untyped-def]
        return lambda: job.done() or counting.held > n

    while True:
        await async_wait_until(at_the_next_call(queried), timeout=30, interval=0.005)
        if job.done():
            break
        queried += 1
        r = await retriever.retriever.search(SearchQuery(tenant="acme", kb="swap", query="corpus entry apples",
                                                         top_k=50, fusion="lexical"))
        seen.add(frozenset(h.document_id[0] for h in r.hits))
        assert len(r.hits) == 12, "a query saw a half-built index"
        counting.step.release()
    result = await job
    assert queried == 6  # a query at every step of the rebuild: 12 documents, 2 per batch
    assert result.chunks_embedded == 12
    assert frozenset("o") in seen
    r = await retriever.retriever.search(SearchQuery(tenant="acme", kb="swap", query="corpus entry", top_k=50))
    assert {h.document_id[0] for h in r.hits} == {"n"} and len(r.hits) == 12
    # The records follow the rebuild: the new corpus is now unchanged.
    again = await asyncio.to_thread(indexer.run_job, "acme", "swap", new, full_rebuild=False)
    assert again.chunks_embedded == 0 and again.documents_deleted == 0
