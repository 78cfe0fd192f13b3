"""OpenAI's Files and Batch REST routes (:mod:`goodput_gateway.jobs.batches` keeps them): ``/v1/files`` (upload,
list, get, content, delete) and ``/v1/batches`` (create, get, cancel, list), each scoped to the caller's tenant."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Iterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.formparsers import MultiPartException, MultiPartParser

from goodput_core.errors import InvalidArgument

from goodput_gateway.api.deps import Batches, Caller, JsonBody, Service
from goodput_gateway.generation_schemas import ChatCompletionRequest, CompletionRequest
from goodput_gateway.jobs.batches import Batch
from goodput_gateway.jobs.records import ROUTES
from goodput_gateway.limits import load_json, read_limited
from goodput_gateway.requests import validate
from goodput_gateway.schemas import BatchRequest, parse

__all__ = ["check_file", "check_lines", "router"]

MAX_LIST = 100
# A batch file is checked on the event loop in turns of WORK_S, each followed by REST_S for everything else: a turn
# is far below a stream's inter-token gap, and the file takes 1.5x its parse time (about 1 s for 10,000 lines).
WORK_S, REST_S = 0.002, 0.001
PARSE_PIECE = 1 << 16  # an upload's multipart body is parsed this much at a time: well under a millisecond each
router = APIRouter()


def check_lines(content: bytes, *, endpoint: str, settings: Any) -> list[tuple[str, bytes]]:
    """The (custom_id, line as uploaded) of every request of a batch input file, each checked (custom_id unique,
    method and url the batch's, a body its endpoint accepts); InvalidArgument naming the first bad line. The lines
    are kept as bytes, which the garbage collector never walks (10,000 parsed bodies kept alive would make its
    full passes take 100 ms and more, each a stall of the event loop).

    >>> import json
    >>> from goodput_gateway.config import GatewaySettings
    >>> line = {"custom_id": "a", "method": "POST", "url": "/v1/chat/completions",
    ...         "body": {"messages": [{"role": "user", "content": "hi"}]}}
    >>> check_lines(json.dumps(line).encode(), endpoint="/v1/chat/completions", settings=GatewaySettings())[0][0]
    'a'
    """
    return list(_checked(content, endpoint=endpoint, settings=settings))


async def check_file(content: bytes, *, endpoint: str, settings: Any) -> list[tuple[str, bytes]]:
    """:func:`check_lines` on the event loop in turns: lines are checked for :data:`WORK_S`, then the loop serves
    everything else for :data:`REST_S`, so a 10,000-line file delays another stream's next token by one turn (and
    one line, bounded as one request's body), never by the whole file."""
    lines = _checked(content, endpoint=endpoint, settings=settings)
    out: list[tuple[str, bytes]] = []
    while True:
        turn_ends = time.perf_counter() + WORK_S
        for checked in lines:
            out.append(checked)
            if time.perf_counter() >= turn_ends:
                break
        else:
            return out
        await asyncio.sleep(REST_S)


def _checked(content: bytes, *, endpoint: str, settings: Any) -> Iterator[tuple[str, bytes]]:
    """Each request's (custom_id, line), one line at a time (the file is not decoded or split whole)."""
    model = ChatCompletionRequest if ROUTES[endpoint] == "chat" else CompletionRequest
    seen: set[str] = set()
    n = start = 0
    while start < len(content):
        end = content.find(b"\n", start)
        end = len(content) if end < 0 else end
        raw, start, n = content[start:end], end + 1, n + 1
        if not raw.strip():
            continue

        def bad(why: str, n: int = n) -> InvalidArgument:
            return InvalidArgument(f"line {n} of the input file: {why}", param="input_file_id", code="invalid_file")

        if len(raw) > settings.limits.body_bytes:
            raise bad(f"longer than {settings.limits.body_bytes} bytes (the bound of one request's body)")
        try:
            line = load_json(raw, max_depth=settings.limits.json_depth, what="it")
        except InvalidArgument as err:
            raise bad(err.message) from None
        if not isinstance(line, dict):
            raise bad("not a JSON object")
        custom_id, body = line.get("custom_id"), line.get("body")
        if not isinstance(custom_id, str) or not custom_id or len(custom_id) > settings.limits.name_chars:
            raise bad(f"custom_id must be a non-empty string of at most {settings.limits.name_chars} characters")
        if custom_id in seen:
            raise bad(f"custom_id {custom_id!r} is not unique")
        seen.add(custom_id)
        if line.get("method") != "POST" or line.get("url") != endpoint:
            raise bad(f"method must be POST and url {endpoint} (the batch's endpoint)")
        if unknown := set(line) - {"custom_id", "method", "url", "body"}:
            raise bad(f"unrecognized field {min(unknown)!r}")
        if not isinstance(body, dict) or body.get("stream"):
            raise bad("body must be a JSON object of a non-streaming request")
        try:
            validate(parse(model, body).to_request(), settings)
        except InvalidArgument as err:
            raise bad(f"body: {err.message}") from None
        if len(seen) > settings.limits.batch_requests:
            raise bad(f"more than {settings.limits.batch_requests} requests in one batch")
        yield custom_id, raw
    if not seen:
        raise InvalidArgument("the input file has no requests", param="input_file_id", code="invalid_file")


def _page(items: list[Any], has_more: bool) -> dict[str, Any]:
    data = [i.public() for i in items]
    return {"object": "list", "data": data, "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None, "has_more": has_more}


@router.post("/v1/files")
async def upload_file(request: Request, caller: Caller, service: Service, store: Batches) -> JSONResponse:
    settings = service.settings
    # read within the file's bound (plus the multipart framing) before anything is parsed
    raw = await read_limited(request.stream(), limit=settings.limits.file_bytes + 16_384,
                             declared=request.headers.get("content-length"))

    async def body() -> AsyncGenerator[bytes, None]:  # parsed a piece at a time, the loop serving others between
        for start in range(0, len(raw), PARSE_PIECE):
            yield raw[start:start + PARSE_PIECE]
            await asyncio.sleep(0)

    if not request.headers.get("content-type", "").startswith("multipart/form-data"):
        raise InvalidArgument("a file is uploaded as multipart/form-data (fields file and purpose)",
                              code="invalid_content_type")
    try:
        form = await MultiPartParser(request.headers, body(), max_files=1, max_fields=4,
                                     max_part_size=settings.limits.file_bytes).parse()
    except MultiPartException as err:
        raise InvalidArgument(f"malformed multipart body: {err.message}", code="invalid_multipart") from None
    upload, purpose = form.get("file"), form.get("purpose")
    if purpose != "batch":
        raise InvalidArgument("purpose must be 'batch' (the only purpose this gateway keeps files for)",
                              param="purpose", code="invalid_value")
    if not isinstance(upload, UploadFile):
        raise InvalidArgument("'file' is required", param="file", code="missing_required_parameter")
    content = await upload.read()
    if len(content) > settings.limits.file_bytes:
        raise InvalidArgument(f"the file has {len(content)} bytes; the limit is {settings.limits.file_bytes}",
                              param="file", code="file_too_large")
    f = await asyncio.to_thread(store.put_file, tenant=caller.tenant, filename=upload.filename or "input.jsonl",
                                purpose=purpose, content=content, quota=caller.storage)
    return JSONResponse(f.public())


@router.get("/v1/files")
async def list_files(caller: Caller, store: Batches, limit: int = MAX_LIST) -> JSONResponse:
    files = await asyncio.to_thread(store.list_files, tenant=caller.tenant, limit=max(1, min(limit, MAX_LIST)))
    return JSONResponse(_page(files, False))


@router.get("/v1/files/{file_id}")
async def get_file(file_id: str, caller: Caller, store: Batches) -> JSONResponse:
    return JSONResponse((await asyncio.to_thread(store.get_file, file_id, tenant=caller.tenant)).public())


@router.get("/v1/files/{file_id}/content")
async def file_content(file_id: str, caller: Caller, store: Batches) -> Response:
    content = await asyncio.to_thread(store.file_content, file_id, tenant=caller.tenant)
    return Response(content, media_type="application/jsonl")


@router.delete("/v1/files/{file_id}")
async def delete_file(file_id: str, caller: Caller, store: Batches) -> JSONResponse:
    await asyncio.to_thread(store.delete_file, file_id, tenant=caller.tenant)
    return JSONResponse({"id": file_id, "object": "file", "deleted": True})


@router.post("/v1/batches")
async def create_batch(caller: Caller, body: JsonBody, service: Service, store: Batches) -> JSONResponse:
    req = parse(BatchRequest, body)
    if req.endpoint not in ROUTES:
        raise InvalidArgument(f"endpoint must be one of {', '.join(ROUTES)}", param="endpoint", code="invalid_value")
    with store.creating(caller.tenant):  # one batch of a tenant at a time in this replica; a second is a 429
        content = await asyncio.to_thread(store.file_content, req.input_file_id, tenant=caller.tenant)
        lines = await check_file(content, endpoint=req.endpoint, settings=service.settings)
        batch = await asyncio.to_thread(store.create, tenant=caller.tenant, endpoint=req.endpoint,
                                        input_file_id=req.input_file_id, window=req.completion_window,
                                        metadata=req.metadata, lines=lines, quota=caller.storage,
                                        key=caller.key_id, weight=caller.weight)
    return JSONResponse(batch.public())


@router.get("/v1/batches")
async def list_batches(caller: Caller, store: Batches, limit: int = 20, after: str | None = None) -> JSONResponse:
    limit = max(1, min(limit, MAX_LIST))
    batches: list[Batch] = await asyncio.to_thread(store.list_batches, tenant=caller.tenant, limit=limit + 1,
                                                   after=after)
    return JSONResponse(_page(batches[:limit], len(batches) > limit))


@router.get("/v1/batches/{batch_id}")
async def get_batch(batch_id: str, caller: Caller, store: Batches) -> JSONResponse:
    return JSONResponse((await asyncio.to_thread(store.get, batch_id, tenant=caller.tenant)).public())


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(batch_id: str, caller: Caller, store: Batches) -> JSONResponse:
    return JSONResponse((await asyncio.to_thread(store.cancel, batch_id, tenant=caller.tenant)).public())
