"""Stream resume over REST (:mod:`goodput_gateway.resume` keeps the streams): ``GET /v1/streams/{stream_id}``, and
the resume a generation route answers when an SSE client reconnects with ``Last-Event-ID``."""

from __future__ import annotations

from collections.abc import Callable

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from goodput_core.errors import GoodputError, InvalidArgument

from goodput_gateway.api.deps import Caller, Streams
from goodput_gateway.auth import Principal
from goodput_gateway.events import SSE_HEADERS
from goodput_gateway.resume import (
    LAST_EVENT_ID,
    MAX_SEQ,
    STREAM_HEADER,
    StreamBuffer,
    check_stream_id,
    parse_last_event_id,
    sse_error,
    sse_events,
)

__all__ = ["resume_response", "router"]

router = APIRouter()


async def resume_response(principal: Principal, streams: StreamBuffer, request: Request, *,
                          stream_id: str | None = None, after: str | None = None,
                          error: Callable[[GoodputError], bytes] = sse_error) -> StreamingResponse:
    """A REST resume: the caller's tenant's stream named by the URL (``stream_id``) or by ``Last-Event-ID``, from
    the event after the one ``Last-Event-ID`` (or ``after``) names; from the start when neither does."""
    header = request.headers.get(LAST_EVENT_ID, "").strip()
    if header:
        sid, last = parse_last_event_id(header, stream_id=stream_id)
    elif stream_id is not None:
        sid, last = check_stream_id(stream_id), -1
        if after is not None:
            if not after.lstrip("-").isdigit() or not -1 <= int(after) <= MAX_SEQ:
                raise InvalidArgument("after must be the number of the last event received (-1 = none)",
                                      param="after", code="invalid_value")
            last = int(after)
    else:
        raise InvalidArgument("a resume needs Last-Event-ID", param="Last-Event-ID", code="missing_required_parameter")
    frames = await streams.resume(api="sse", tenant=principal.tenant, stream_id=sid, after=last)
    return StreamingResponse(sse_events(frames, sid, error=error), media_type="text/event-stream",
                             headers={**SSE_HEADERS, STREAM_HEADER: sid})


@router.get("/v1/streams/{stream_id}")
async def resume_stream(stream_id: str, request: Request, caller: Caller, streams: Streams,
                        after: str | None = None) -> Response:
    return await resume_response(caller, streams, request, stream_id=stream_id, after=after)
