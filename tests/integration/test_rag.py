"""The knowledge path end to end, through real processes: documents indexed through the gateway (embedder ->
retriever stores), searched, embedded with the openai SDK, and a chat that names a knowledge base returning the
sources it was grounded on (REST streaming and not, and gRPC)."""

from __future__ import annotations

import time
import uuid

import grpc
import httpx
import openai
import pytest
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc

from goodput_cli.supervisor import Platform

from .conftest import KEY_P0, KEY_P2

pytestmark = [pytest.mark.integration, pytest.mark.e2e]

DOCS = [
    {"id": "zorblat", "title": "The Zorblat festival",
     "text": "The Zorblat festival is held every year in the town of Quenby on the first Sunday of May. "
             "Visitors eat blue pancakes and race wooden ducks on the river."},
    {"id": "quenby-trains", "title": "Trains to Quenby",
     "text": "Trains to Quenby leave from Central Station every hour; the journey takes forty minutes."},
    {"id": "faq", "type": "faq",
     "text": "Q: Can I bring a dog to the festival?\nA: Dogs on a leash are welcome.\n"
             "Q: Is there parking?\nA: Parking is at the old mill, two euros a day."},
]


@pytest.fixture(scope="module")
def kb(platform: Platform) -> str:
    name = f"town-{uuid.uuid4().hex[:8]}"
    r = httpx.post(f"{platform.gateway_http}/v1/knowledge-bases/{name}/documents",
                   headers={"Authorization": f"Bearer {KEY_P0}"}, json={"documents": DOCS}, timeout=120)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["chunks_embedded"] == 4 and body["kb_version"] >= 1
    return name


def _post(platform: Platform, path: str, body: object, key: str = KEY_P0) -> httpx.Response:
    return httpx.post(platform.gateway_http + path, headers={"Authorization": f"Bearer {key}"}, json=body,
                      timeout=60)


def test_reindexing_unchanged_documents_embeds_nothing(platform: Platform, kb: str) -> None:
    r = _post(platform, f"/v1/knowledge-bases/{kb}/documents", {"documents": DOCS})
    assert r.status_code == 200 and r.json()["chunks_embedded"] == 0 and r.json()["documents_unchanged"] == 3


def test_search_over_rest(platform: Platform, kb: str) -> None:
    r = _post(platform, f"/v1/knowledge-bases/{kb}/search", {"query": "when is the duck race?", "top_k": 3,
                                                               "rerank": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["data"][0]["document_id"] == "zorblat"
    # the test platform runs no reranker model: the rerank asked for is skipped and the answer says why
    assert not body["degraded"] and "rerank skipped: no reranker model configured" in body["notes"]
    assert body["rerank"] == {"status": "skipped", "reason": "no model", "model": ""}


def test_bad_knowledge_requests_are_4xx(platform: Platform, kb: str) -> None:
    assert _post(platform, f"/v1/knowledge-bases/{kb}/search", {"query": ""}).status_code == 400
    assert _post(platform, "/v1/knowledge-bases/no-such-kb/search", {"query": "x"}).status_code == 404
    # Another tenant's key does not see this knowledge base at all.
    assert _post(platform, f"/v1/knowledge-bases/{kb}/search", {"query": "Zorblat"}, key=KEY_P2).status_code == 404
    r = _post(platform, f"/v1/knowledge-bases/{kb}/documents", {"documents": [{"id": "e", "text": "  "}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "empty_document"
    r = _post(platform, f"/v1/knowledge-bases/{kb}/documents",
              {"documents": [{"id": "ok", "text": "fine"}, {"id": "bin", "text": "\u0000\u0001\u0002" * 100}]})
    assert r.status_code == 400 and r.json()["error"]["code"] == "binary_document"
    r = _post(platform, f"/v1/knowledge-bases/{kb}/search", {"query": "fine", "top_k": 10})
    assert "ok" not in {h["document_id"] for h in r.json()["data"]}  # nothing of the bad batch was written
    resp = _post(platform, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                                     "knowledge_base": "no-such-kb", "max_tokens": 5})
    assert resp.status_code == 404


def test_embeddings_with_the_openai_sdk(platform: Platform) -> None:
    client = openai.OpenAI(base_url=platform.gateway_http + "/v1", api_key=KEY_P0, max_retries=0, timeout=60)
    resp = client.embeddings.create(model="all-MiniLM-L6-v2", input=["blue pancakes", "wooden ducks"])
    assert len(resp.data) == 2 and len(resp.data[0].embedding) == 384
    assert resp.usage.prompt_tokens > 0
    floats = client.embeddings.create(model="default", input="blue pancakes", encoding_format="float")
    assert floats.data[0].embedding == pytest.approx(resp.data[0].embedding, abs=1e-5)


def test_rag_chat_returns_its_sources_streamed_or_not(platform: Platform, kb: str) -> None:
    client = openai.OpenAI(base_url=platform.gateway_http + "/v1", api_key=KEY_P0, max_retries=0, timeout=120)
    model = client.models.list().data[0].id
    question = [{"role": "user", "content": "In which town is the Zorblat festival held?"}]
    resp = client.chat.completions.create(model=model, messages=question, max_tokens=30, temperature=0,  # type: ignore[arg-type]
                                          extra_body={"knowledge_base": kb})
    sources = (resp.model_extra or {}).get("sources")
    assert sources and sources[0]["document_id"] == "zorblat", sources
    assert {"chunk_id", "document_id", "score", "text"} <= set(sources[0])
    assert resp.choices[0].message.content
    # The header works too, and a stream carries the sources on its first chunk.
    stream = client.chat.completions.create(model=model, messages=question, max_tokens=10, temperature=0,  # type: ignore[arg-type]
                                            stream=True, extra_headers={"X-Goodput-Knowledge-Base": kb})
    chunks = list(stream)
    first = (chunks[0].model_extra or {}).get("sources")
    assert first and first[0]["document_id"] == "zorblat"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


def test_rag_and_search_over_grpc(platform: Platform, kb: str) -> None:
    md = (("authorization", f"Bearer {KEY_P0}"),)
    with grpc.insecure_channel(platform.gateway_grpc) as ch:
        stub = gateway_pb2_grpc.GatewayStub(ch)
        r = stub.Search(gateway_pb2.SearchRequest(knowledge_base=kb, query="parking price"), metadata=md, timeout=30)
        assert r.results[0].document_id == "faq" and "old mill" in r.results[0].text
        g = stub.Generate(gateway_pb2.GenerateRequest(
            knowledge_base=kb, messages=[{"role": "user", "content": "How long is the train to Quenby?"}],
            sampling={"max_tokens": 10, "temperature": 0}), metadata=md, timeout=120)
        assert g.sources and g.sources[0].document_id == "quenby-trains"
        first = next(iter(stub.GenerateStream(gateway_pb2.GenerateRequest(
            knowledge_base=kb, messages=[{"role": "user", "content": "Can I bring my dog?"}],
            sampling={"max_tokens": 5}), metadata=md, timeout=120)))
        assert first.start.sources and first.start.sources[0].document_id == "faq"
        e = stub.Embed(gateway_pb2.EmbedRequest(texts=["a", "b"]), metadata=md, timeout=30)
        assert len(e.embeddings) == 2
        with pytest.raises(grpc.RpcError) as info:
            stub.Search(gateway_pb2.SearchRequest(knowledge_base=kb, query=" "), metadata=md, timeout=30)
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_goodput_index_and_search_commands(platform: Platform, tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    from typer.testing import CliRunner

    from goodput_cli.main import app

    (tmp_path / "guide.md").write_text("# Ferry\nThe ferry to Lundholm leaves at nine.\n\n# Bus\nThe bus is free.\n")
    tides = {"id": "tides", "text": "High tide in Lundholm is at noon."}
    (tmp_path / "more.jsonl").write_text(json.dumps(tides) + "\n")
    kb = f"cli-{uuid.uuid4().hex[:8]}"
    common = ["--kb", kb, "--url", platform.gateway_http, "--key", KEY_P0]
    r = CliRunner().invoke(app, ["index", str(tmp_path), *common])
    assert r.exit_code == 0, r.output
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["documents"] == 2 and summary["chunks_embedded"] == 3
    again = CliRunner().invoke(app, ["index", str(tmp_path), *common])
    assert json.loads(again.stdout.strip().splitlines()[-1])["chunks_embedded"] == 0  # incremental
    r = CliRunner().invoke(app, ["search", "when does the ferry leave", "--json", *common])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["data"][0]["document_id"] == "guide.md"


def test_a_rag_request_short_of_time_takes_the_ladders_rag_step_and_says_so(platform: Platform, kb: str) -> None:
    """Its deadline (6 s) cannot cover P0's retrieval and prefill budgets (2 s + 5 s): it retrieves half the chunks
    into half the context, and the answer names the step (body, header, the breakdown's ``degraded``)."""
    body = {"model": "", "messages": [{"role": "user", "content": "When is the Zorblat festival?"}],
            "max_tokens": 8, "temperature": 0, "knowledge_base": kb}
    headers = {"Authorization": f"Bearer {KEY_P0}", "Request-Timeout-Ms": "6000", "Cache-Control": "no-store"}
    resp = httpx.post(platform.gateway_http + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    assert resp.status_code == 200, resp.text
    answer = resp.json()
    assert answer["goodput_degraded"] == ["fewer_chunks"] and resp.headers["x-goodput-degraded"] == "fewer_chunks"
    assert 1 <= len(answer["sources"]) <= 2  # rag_top_k 5, halved
    # and what became of it is taken as feedback: used (its goodput stays)
    feedback = _post(platform, "/v1/feedback", {"request_id": resp.headers["x-request-id"], "verdict": "used"})
    assert feedback.status_code == 200 and feedback.json()["verdict"] == "used"
    # another answer, judged through the other replica (the store is Redis): discarded, its goodput withdrawn
    again = httpx.post(platform.gateway_http + "/v1/chat/completions", json=body, headers=headers, timeout=60)
    for _ in range(20):  # the answer is kept off its response's path
        judged = httpx.post(platform.gateway_http_at(1) + "/v1/feedback", timeout=10,
                            headers={"Authorization": f"Bearer {KEY_P0}"},
                            json={"request_id": again.headers["x-request-id"], "verdict": "discarded"})
        if judged.status_code != 404:
            break
        time.sleep(0.1)
    assert judged.status_code == 200 and judged.json()["verdict"] == "discarded", judged.text
    metrics = httpx.get(platform.gateway_metrics, timeout=10).text
    assert 'goodput_gateway_degradations_total{priority="P0",step="fewer_chunks"}' in metrics
    assert "goodput_gateway_slo_requests_total{" in metrics and "goodput_gateway_feedback_total{" in metrics
