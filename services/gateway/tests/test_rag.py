"""RAG prompt assembly: the context stays within the budget, the sources are exactly the chunks put in the prompt."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from goodput_core.errors import InvalidArgument

from goodput_gateway.config import GatewaySettings
from goodput_gateway.generation_schemas import ChatCompletionRequest
from goodput_gateway.rag import augment
from goodput_gateway.requests import GenerationRequest, Message, Sampling
from goodput_gateway.schemas import parse


@dataclass
class FakeHit:
    chunk_id: str
    document_id: str
    score: float
    text: str


@dataclass
class FakeKnowledge:
    hits: list[FakeHit]
    calls: list[tuple[str, str, str]] = field(default_factory=list)

    async def search(self, tenant: str, kb: str, query: str, *, top_k: int = 0):  # type: ignore[no-untyped-def]
        self.calls.append((tenant, kb, query))

        class R:
            pass

        r = R()
        r.hits = self.hits[:top_k]  # type: ignore[attr-defined]
        return r


def chat(text: str, max_tokens: int = 0) -> GenerationRequest:
    return GenerationRequest(messages=(Message("system", "Be brief."), Message("user", "first"),
                                       Message("assistant", "ok"), Message("user", text)),
                             sampling=Sampling(max_tokens=max_tokens), knowledge_base="kb")


async def test_context_goes_first_and_the_last_user_message_is_the_query() -> None:
    k = FakeKnowledge([FakeHit(f"c{i}", f"d{i}", 1.0 / (i + 1), f"passage {i}") for i in range(3)])
    req, sources = await augment(k, GatewaySettings(), tenant="acme", request=chat("what?"),
                                 max_model_len=2048)
    assert k.calls == [("acme", "kb", "what?")]
    assert [s.document_id for s in sources] == ["d0", "d1", "d2"]
    assert req.messages[0].role == "system" and "[1] passage 0" in req.messages[0].content
    assert req.messages[1:] == chat("what?").messages


async def test_context_respects_the_model_window_and_sources_match_what_fits() -> None:
    k = FakeKnowledge([FakeHit(f"c{i}", f"d{i}", 1.0, "x" * 400) for i in range(5)])
    settings = GatewaySettings(rag={"max_context_chars": 100_000})
    # 512-token window, 256 for the answer: room for ~2 passages of 400 characters.
    req, sources = await augment(k, settings, tenant="t", request=chat("q", max_tokens=256),
                                 max_model_len=512)
    assert 1 <= len(sources) < 5
    assert req.messages[0].content.count("x" * 400) == len(sources)
    _, none = await augment(k, settings, tenant="t", request=chat("q", max_tokens=500), max_model_len=512)
    assert none == []


async def test_no_user_text_is_invalid_and_the_field_or_header_names_the_kb() -> None:
    with pytest.raises(InvalidArgument):
        await augment(FakeKnowledge([]), GatewaySettings(), tenant="t",
                      request=GenerationRequest(messages=(Message("system", "x"),), knowledge_base="kb"),
                      max_model_len=2048)

    def knowledge_base_from(body: dict[str, object], header: str | None) -> str:
        body = {"messages": [{"role": "user", "content": "q"}], **body}
        return parse(ChatCompletionRequest, body).to_request(header_kb=header).knowledge_base

    assert knowledge_base_from({"knowledge_base": "a"}, "b") == "a"
    assert knowledge_base_from({}, "b") == "b"
    with pytest.raises(InvalidArgument):
        knowledge_base_from({"knowledge_base": 3}, None)
