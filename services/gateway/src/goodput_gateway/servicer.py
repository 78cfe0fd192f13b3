"""Thin gRPC servicer for the public Gateway API, over the same service as REST."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from goodput.common.v1 import types_pb2
from goodput.gateway.v1 import gateway_pb2, gateway_pb2_grpc
from grpc import aio

from goodput_core.context import REQUEST_ID_HEADER, new_request_id, request_context
from goodput_core.errors import GoodputError, ResourceExhausted

from goodput_gateway.auth import Principal
from goodput_gateway.caching import cache_metadata
from goodput_gateway.jobs import JOB_ID_KEY, JobQueue, park_shed
from goodput_gateway.knowledge import grpc_embed, grpc_index, grpc_search
from goodput_gateway.pipeline import GenerationStream, StreamEnd, TextDelta
from goodput_gateway.requests import GenerationRequest, from_proto, to_openai_body
from goodput_gateway.service import GatewayService

log = logging.getLogger("goodput.gateway")

_FINISH = {"stop": types_pb2.FINISH_REASON_STOP, "length": types_pb2.FINISH_REASON_LENGTH,
           "abort": types_pb2.FINISH_REASON_ABORT}


def _metadata(context: aio.ServicerContext, name: str) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == name:
            return value if isinstance(value, str) else value.decode()
    return ""


def _authorization(context: aio.ServicerContext) -> str | None:
    return _metadata(context, "authorization") or None


def _usage(end: StreamEnd) -> types_pb2.Usage:
    return types_pb2.Usage(prompt_tokens=end.prompt_tokens, completion_tokens=end.completion_tokens,
                           total_tokens=end.prompt_tokens + end.completion_tokens)


def _sources(stream: GenerationStream) -> list[gateway_pb2.Source]:
    return [gateway_pb2.Source(chunk_id=s.chunk_id, document_id=s.document_id, score=s.score, text=s.text)
            for s in stream.sources]


class GatewayServicer(gateway_pb2_grpc.GatewayServicer):
    def __init__(self, service: GatewayService, *, jobs: JobQueue | None = None) -> None:
        self.service = service
        self.jobs = jobs

    def _count(self, route: str, code: str, priority: str = "unspecified") -> None:
        self.service.metrics.requests.labels(route, code, priority).inc()

    async def _park(self, err: GoodputError, principal: Principal | None, gen: GenerationRequest | None,
                    request: gateway_pb2.GenerateRequest) -> None:
        """A shed P2 request is parked as a job (as on REST); its id travels in trailing metadata next to the
        RESOURCE_EXHAUSTED status and its retry-after. Best effort: the caller gets its honest error either way."""
        if self.jobs is None or principal is None or gen is None or not isinstance(err, ResourceExhausted):
            return
        try:
            route, body = to_openai_body(gen, knowledge_base=request.knowledge_base)
            job = await park_shed(self.jobs, err, principal=principal, gen=gen, route=route, body=body)
        except Exception:  # noqa: BLE001
            log.exception("could not park a shed P2 request")
            return
        if job is not None:
            err.extra_metadata = (*err.extra_metadata, (JOB_ID_KEY, job.id))

    async def GenerateStream(self, request: gateway_pb2.GenerateRequest,
                             context: aio.ServicerContext) -> AsyncIterator[gateway_pb2.GenerateStreamResponse]:
        arrived = time.monotonic()
        request_id = new_request_id()
        context.set_trailing_metadata(((REQUEST_ID_HEADER, request_id),))
        with request_context(request_id=request_id):
            principal: Principal | None = None
            gen = None
            try:
                principal = self.service.authenticate(_authorization(context))
                gen = from_proto(request, stream=True)
                stream = await self.service.begin(principal, gen, request_id=request_id,
                                                  arrived=arrived, timeout_s=context.time_remaining(),
                                                  knowledge_base=request.knowledge_base,
                                                  cache_control=_metadata(context, "cache-control"))
            except GoodputError as err:
                self._count("grpc_stream", err.grpc_code.name)
                await self._park(err, principal, gen, request)
                raise
            # A caller that cancels after the start message never iterates the stream: close it (worker call
            # and lease) whatever happens, as the REST path does.
            try:
                if cache_metadata(stream):  # x-goodput-cache: hit; layer=l1; similarity=1.000
                    await context.send_initial_metadata(cache_metadata(stream))
                    context.set_trailing_metadata(((REQUEST_ID_HEADER, request_id), *cache_metadata(stream)))
                self._count("grpc_stream", "OK")
                assert stream.start is not None
                yield gateway_pb2.GenerateStreamResponse(start=gateway_pb2.StreamStart(
                    request_id=request_id, model=stream.start.model, sources=_sources(stream)))
                async for event in stream:
                    if isinstance(event, TextDelta):
                        yield gateway_pb2.GenerateStreamResponse(delta=event.text)
                    else:
                        yield gateway_pb2.GenerateStreamResponse(end=gateway_pb2.StreamEnd(
                            finish_reason=_FINISH[event.finish_reason], usage=_usage(event)))
            finally:
                await stream.aclose()

    async def Generate(self, request: gateway_pb2.GenerateRequest,
                       context: aio.ServicerContext) -> gateway_pb2.GenerateResponse:
        arrived = time.monotonic()
        request_id = new_request_id()
        context.set_trailing_metadata(((REQUEST_ID_HEADER, request_id),))
        with request_context(request_id=request_id):
            principal: Principal | None = None
            gen = None
            try:
                principal = self.service.authenticate(_authorization(context))
                gen = from_proto(request, stream=False)
                stream = await self.service.begin(principal, gen, request_id=request_id, arrived=arrived,
                                                  timeout_s=context.time_remaining(),
                                                  knowledge_base=request.knowledge_base,
                                                  cache_control=_metadata(context, "cache-control"))
            except GoodputError as err:
                self._count("grpc", err.grpc_code.name)
                await self._park(err, principal, gen, request)
                raise
            if cache_metadata(stream):
                context.set_trailing_metadata(((REQUEST_ID_HEADER, request_id), *cache_metadata(stream)))
            self._count("grpc", "OK")
            try:
                text, end = await stream.collect()
            finally:
                await stream.aclose()
            assert stream.start is not None
            return gateway_pb2.GenerateResponse(request_id=request_id, model=stream.start.model,
                                                text=text, finish_reason=_FINISH[end.finish_reason],
                                                usage=_usage(end), sources=_sources(stream))

    async def ListModels(self, request: gateway_pb2.ListModelsRequest,
                         context: aio.ServicerContext) -> gateway_pb2.ListModelsResponse:
        self.service.authenticate(_authorization(context))
        models = await self.service.pipeline.models()
        return gateway_pb2.ListModelsResponse(models=[
            gateway_pb2.Model(id=m.id, max_model_len=m.max_model_len, workers=m.workers) for m in models])

    async def Embed(self, request: gateway_pb2.EmbedRequest,
                    context: aio.ServicerContext) -> gateway_pb2.EmbedResponse:
        return await grpc_embed(self.service, self.service.authenticate(_authorization(context)), request)

    async def Search(self, request: gateway_pb2.SearchRequest,
                     context: aio.ServicerContext) -> gateway_pb2.SearchResponse:
        return await grpc_search(self.service, self.service.authenticate(_authorization(context)), request)

    async def Index(self, request: gateway_pb2.IndexRequest,
                    context: aio.ServicerContext) -> gateway_pb2.IndexResponse:
        return await grpc_index(self.service, self.service.authenticate(_authorization(context)), request)
