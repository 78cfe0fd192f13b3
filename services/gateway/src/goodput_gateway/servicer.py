"""Thin gRPC servicer for the public Gateway API, over the same request path as REST
(:meth:`goodput_gateway.service.GatewayService.generate`).

A ``GenerateRequest`` becomes a :class:`~goodput_gateway.requests.GenerationRequest` in :func:`from_proto` and then
passes the same domain checks as a REST body. Every field is carried: ``no_cache`` is ``Cache-Control: no-store``
(neither read nor write); the ``cache-control`` metadata works as the REST header does.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import AsyncIterator
from typing import Any

from goodput.common.v1 import types_pb2
from goodput.embedder.v1 import embedder_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from grpc import aio

from goodput_core.context import REQUEST_ID_HEADER, new_request_id, request_context
from goodput_core.errors import GoodputError, InvalidArgument
from goodput_core.priority import priority_name
from goodput_core.sampling import logprobs_to_proto, sampling_from_proto

from goodput_gateway.auth import caller
from goodput_gateway.events import FINISH_PB, StreamEnd, TextDelta
from goodput_gateway.generation import Call, Generation, Opened
from goodput_gateway.knowledge import chars, require
from goodput_gateway.limits import load_json
from goodput_gateway.requests import ROLE_ALIASES, GenerationRequest, Message, estimate_tokens
from goodput_gateway.resume import StreamBuffer
from goodput_gateway.service import GatewayService
from goodput_gateway.tools import resolve, tool_calls

__all__ = ["GatewayServicer", "from_proto"]

TIMING_KEY = "goodput-timing"
_FUNCTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def from_proto(req: gateway_pb2.GenerateRequest, *, stream: bool, max_json_depth: int) -> GenerationRequest:
    """The request as the domain sees it; its checks (:func:`~goodput_gateway.requests.validate`) come after. A
    tool's ``parameters_json`` is read as a REST body is (:func:`~goodput_gateway.limits.load_json`)."""
    messages = tuple(Message(role=ROLE_ALIASES.get(m.role, m.role), content=m.content, name=m.name,
                             tool_call_id=m.tool_call_id, tool_calls=_calls_json(m.tool_calls))
                     for m in req.messages)
    functions = []
    for i, f in enumerate(req.tools):
        try:
            parameters = load_json(f.parameters_json.encode(), max_depth=max_json_depth) if f.parameters_json else None
        except InvalidArgument:
            parameters = None
        if f.parameters_json and not isinstance(parameters, dict):
            raise InvalidArgument("parameters_json must be a JSON object (a JSON Schema)",
                                  param=f"tools[{i}].parameters_json", code="invalid_value")
        if not _FUNCTION_NAME.match(f.name):
            raise InvalidArgument("a function's name is 1-64 of A-Z a-z 0-9 _ -", param=f"tools[{i}].name",
                                  code="invalid_value")
        functions.append({"name": f.name, **({"description": f.description} if f.description else {}),
                          **({"parameters": parameters} if parameters is not None else {})})
    if req.sampling.n > 1:
        raise InvalidArgument("n > 1 is served on REST only (a GenerateResponse carries one answer)",
                              param="sampling.n", code="unsupported_parameter")
    tools = resolve(functions, req.tool_choice,
                    parallel=req.parallel_tool_calls if req.HasField("parallel_tool_calls") else None)
    return GenerationRequest(model=req.model, messages=messages, prompt=req.prompt,
                             sampling=sampling_from_proto(req.sampling), priority=int(req.priority), stream=stream,
                             session_id=req.session_id, knowledge_base=req.knowledge_base.strip(),
                             kind="completion" if req.prompt and not req.messages else "chat", tools=tools,
                             cache_key=req.prompt_cache_key, safety_identifier=req.safety_identifier)


def _calls_json(calls: Any) -> str:
    """An assistant message's calls as OpenAI's tool_calls JSON (what REST carries), or ""."""
    return json.dumps([{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                       for c in calls], sort_keys=True) if calls else ""


def _tool_calls(opened: Opened, text: str, end: StreamEnd) -> list[types_pb2.ToolCall]:
    """The answer's calls: read from a ``required``/named answer, or those a tool_choice auto answer made."""
    calls = list(end.tool_calls) or tool_calls(opened.request, text) or []
    return [types_pb2.ToolCall(id=c["id"], name=c["function"]["name"], arguments=c["function"]["arguments"])
            for c in calls]


def _degraded(opened: Opened) -> list[str]:
    return list(opened.timeline.degraded) if opened.timeline is not None else []


def _metadata(context: aio.ServicerContext, name: str) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == name:
            return value if isinstance(value, str) else value.decode()
    return ""


def _usage(end: StreamEnd) -> types_pb2.Usage:
    return types_pb2.Usage(prompt_tokens=end.prompt_tokens, completion_tokens=end.completion_tokens,
                           total_tokens=end.prompt_tokens + end.completion_tokens, cached_tokens=end.cached_tokens)


def _sources(opened: Opened) -> list[gateway_pb2.Source]:
    return [gateway_pb2.Source(chunk_id=s.chunk_id, document_id=s.document_id, score=s.score, text=s.text)
            for s in opened.sources]


def _cache_info(opened: Opened) -> gateway_pb2.CacheInfo | None:
    status = opened.cache
    if status is None or status.status != "hit":
        return None
    return gateway_pb2.CacheInfo(hit=True, layer=status.layer, similarity=status.similarity, verdict=status.verdict,
                                 verifier_probability=status.verifier_probability)


def _response_metadata(opened: Opened) -> tuple[tuple[str, str], ...]:
    """What the response cache did and OpenAI's x-ratelimit-* values, as metadata."""
    cache = tuple(opened.cache.metadata()) if opened.cache is not None else ()
    return (*cache, *opened.rate_limits.items())


async def _numbered(messages: AsyncIterator[gateway_pb2.GenerateStreamResponse],
                   stream_id: str) -> AsyncIterator[bytes]:
    """A stream's messages as recorded for resume (goodput_gateway.resume): each with its ``seq``, the start with
    its ``resume_token``."""
    seq = 0
    async for message in messages:
        message.seq = seq
        seq += 1
        if message.HasField("start"):
            message.start.resume_token = stream_id
        yield message.SerializeToString()


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, service: GatewayService, *, streams: StreamBuffer | None = None) -> None:
        self.service = service
        self.streams = streams or StreamBuffer(service.settings, redis=None)  # stream resume (RESUME__WINDOW_S)

    def _call(self, request: gateway_pb2.GenerateRequest, context: aio.ServicerContext, *, stream: bool,
              request_id: str) -> Call:
        async def parse() -> GenerationRequest:
            return from_proto(request, stream=stream, max_json_depth=self.service.settings.limits.json_depth)

        cache_control = "no-store" if request.no_cache else _metadata(context, "cache-control")
        return Call(parse=parse, principal=caller(), request_id=request_id,
                    arrived=time.monotonic(), timeout_s=context.time_remaining(), cache_control=cache_control)

    def _count(self, route: str, code: str, priority: int | None = None) -> None:
        self.service.metrics.requests.labels(route, code, priority_name(priority or 0)).inc()

    async def GenerateStream(self, request: gateway_pb2.GenerateRequest,
                             context: aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        request_id = new_request_id()
        context.set_trailing_metadata(((REQUEST_ID_HEADER, request_id),))
        with request_context(request_id=request_id):
            try:
                generation = await self.service.open(self._call(request, context, stream=True,
                                                                request_id=request_id))
            except GoodputError as err:
                self._count("grpc_stream", err.grpc_code.name)
                raise
            if self.streams.enabled:  # the generation runs to its end on its own, for a ResumeStream
                try:
                    messages = await self._started(generation, context, request_id)
                except BaseException:
                    await generation.aclose()
                    raise
                frames = self.streams.stream(_numbered(messages, request_id), api="grpc",
                                             tenant=generation.opened.tenant, stream_id=request_id,
                                             closer=generation.aclose)
                try:  # a caller that goes away only stops following it
                    async for frame in frames:
                        yield gateway_pb2.GenerateStreamResponse.FromString(frame.data)
                finally:
                    await frames.aclose()
                return
            # A caller that cancels after the start message never iterates the stream: close it (worker call
            # and lease) whatever happens, as the REST path does.
            async with generation:
                async for message in await self._started(generation, context, request_id):
                    yield message

    async def _started(self, generation: Generation, context: aio.ServicerContext,
                       request_id: str) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        """Sends the response metadata; the stream's messages: the start, deltas, the end."""
        opened = generation.opened
        metadata = _response_metadata(opened)  # x-goodput-cache, x-ratelimit-*
        if metadata:
            await context.send_initial_metadata(metadata)
            context.set_trailing_metadata(((REQUEST_ID_HEADER, request_id), *metadata))
        self._count("grpc_stream", "OK", opened.priority)
        return self._messages(generation, context, request_id, metadata)

    async def _messages(self, generation: Generation, context: aio.ServicerContext, request_id: str,
                        metadata: tuple[tuple[str, str], ...]) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        opened = generation.opened
        yield gateway_pb2.GenerateStreamResponse(start=gateway_pb2.StreamStart(
            request_id=request_id, model=opened.model, sources=_sources(opened), cache=_cache_info(opened),
            degraded=_degraded(opened)))
        parts: list[str] = []  # the text a tool call is read from at the end
        async for event in generation:
            if isinstance(event, TextDelta):
                if event.text:
                    parts.append(event.text)
                    yield gateway_pb2.GenerateStreamResponse(delta=event.text)
                if event.logprobs:  # right after the text they belong to
                    yield gateway_pb2.GenerateStreamResponse(logprobs=gateway_pb2.TokenLogprobs(
                        tokens=logprobs_to_proto(event.logprobs)))
            else:
                timeline = generation.timing()
                if timeline is not None:  # where the time went: trailing metadata, with the others
                    context.set_trailing_metadata(((REQUEST_ID_HEADER, request_id), *metadata,
                                                   (TIMING_KEY, timeline.server_timing())))
                yield gateway_pb2.GenerateStreamResponse(end=gateway_pb2.StreamEnd(
                    finish_reason=FINISH_PB[event.finish_reason], usage=_usage(event),
                    tool_calls=_tool_calls(opened, "".join(parts), event)))

    async def ResumeStream(self, request: gateway_pb2.ResumeStreamRequest,
                           context: aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        """A GenerateStream continued from ``from_seq`` (goodput_gateway.resume), for the stream's tenant only."""
        frames = await self.streams.resume(api="grpc", tenant=caller().tenant, stream_id=request.resume_token,
                                           after=request.from_seq - 1)
        try:
            async for frame in frames:
                yield gateway_pb2.GenerateStreamResponse.FromString(frame.data)
        finally:
            await frames.aclose()

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: aio.ServicerContext) -> gateway_pb2.GenerateResponse:
        request_id = new_request_id()
        context.set_trailing_metadata(((REQUEST_ID_HEADER, request_id),))
        with request_context(request_id=request_id):
            try:
                generation = await self.service.open(self._call(request, context, stream=False,
                                                                request_id=request_id))
            except GoodputError as err:
                self._count("grpc", err.grpc_code.name)
                raise
            opened = generation.opened
            metadata = _response_metadata(opened)
            if metadata:
                context.set_trailing_metadata(((REQUEST_ID_HEADER, request_id), *metadata))
            self._count("grpc", "OK", opened.priority)
            async with generation:
                text, end = await generation.collect()
            timeline = generation.timing()
            if timeline is not None:  # where the time went, per stage (Server-Timing's format)
                context.set_trailing_metadata(((REQUEST_ID_HEADER, request_id), *metadata,
                                               (TIMING_KEY, timeline.server_timing())))
            return gateway_pb2.GenerateResponse(request_id=request_id, model=opened.model, text=text,
                                                finish_reason=FINISH_PB[end.finish_reason], usage=_usage(end),
                                                cache=_cache_info(opened), sources=_sources(opened),
                                                logprobs=logprobs_to_proto(generation.logprobs),
                                                tool_calls=_tool_calls(opened, text, end),
                                                degraded=_degraded(opened))

    async def ListModels(self, request: gateway_pb2.ListModelsRequest,
                         context: aio.ServicerContext) -> gateway_pb2.ListModelsResponse:
        models = await self.service.pipeline.catalogue.models()
        return gateway_pb2.ListModelsResponse(models=[
            gateway_pb2.Model(id=m.id, max_model_len=m.max_model_len, workers=m.workers) for m in models])

    async def Embed(self, request: gateway_pb2.EmbedRequest,
                    context: aio.ServicerContext) -> gateway_pb2.EmbedResponse:
        tokens = estimate_tokens(chars(request.texts))
        async with self.service.metered(caller(), what="embeddings", tokens=tokens) as adm:
            r = await require(self.service.knowledge).embed(list(request.texts), request.model)
            adm.used = r.tokens
        return gateway_pb2.EmbedResponse(model=r.model, prompt_tokens=r.tokens,
                                         embeddings=[gateway_pb2.Embedding(values=v) for v in r.vectors])

    async def Search(self, request: gateway_pb2.SearchRequest,
                     context: aio.ServicerContext) -> gateway_pb2.SearchResponse:
        principal = caller()
        async with self.service.metered(principal, what="search", tokens=estimate_tokens(len(request.query))):
            r = await require(self.service.knowledge).search(
                principal.tenant, request.knowledge_base, request.query, top_k=request.top_k, fusion=request.fusion,
                dense_weight=request.dense_weight if request.HasField("dense_weight") else None,
                rerank=request.rerank)
        return gateway_pb2.SearchResponse(results=[gateway_pb2.Source(chunk_id=h.chunk_id, document_id=h.document_id,
                                                                      score=h.score, text=h.text) for h in r.hits],
                                          degraded=r.degraded, notes=r.notes, kb_version=r.kb_version,
                                          rerank_status=r.rerank.status, rerank_reason=r.rerank.reason)

    async def Index(self, request: gateway_pb2.IndexRequest,
                    context: aio.ServicerContext) -> gateway_pb2.IndexResponse:
        principal = caller()
        docs = [embedder_pb2.Document(id=d.id, text=d.text, type=d.type, title=d.title, metadata=dict(d.metadata))
                for d in request.documents]
        async with self.service.metered(principal, what="index", tokens=estimate_tokens(chars(d.text for d in docs))):
            r = await require(self.service.knowledge).index(principal.tenant, request.knowledge_base, docs,
                                                            list(request.delete_ids))
        return gateway_pb2.IndexResponse(chunks_embedded=r.chunks_embedded, documents_unchanged=r.documents_unchanged,
                                         documents_deleted=r.documents_deleted, kb_version=r.kb_version)
