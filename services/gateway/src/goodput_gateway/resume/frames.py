"""The words of stream resume: a recorded event (:class:`Frame`), how a stream ended (:class:`End`), stream and event
ids, the refusals (404 unknown, 410 dropped or abandoned), and the SSE form of recorded events."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc

from goodput_core.errors import GoodputError, InvalidArgument, NotFound, ResourceExhausted, from_status

__all__ = ["LAST_EVENT_ID", "MAX_SEQ", "STREAM_HEADER", "End", "Frame", "StreamGone", "check_stream_id",
           "parse_last_event_id", "sse_error", "sse_events"]

log = logging.getLogger("goodput.gateway.resume")

LAST_EVENT_ID = "last-event-id"
STREAM_HEADER = "X-Goodput-Stream-Id"
_STREAM_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
MAX_SEQ = 10**12
# A stream id not (yet) in Redis is looked for this long (at least four flushes) before it is answered 404: the replica
# producing it writes its first events at its next flush.
UNKNOWN_AFTER_S = 0.25
# outcomes of a resume by the error code that refused it (goodput_gateway_stream_resumes_total)
OUTCOMES = {"resume_disabled": "disabled", "stream_not_found": "not_found", "stream_events_dropped": "evicted",
             "stream_abandoned": "abandoned", "store_unavailable": "error", "too_many_stream_followers": "limited",
             "too_many_tenant_followers": "limited"}
# a follower refused by RESUME__MAX_FOLLOWERS_PER_STREAM or _PER_TENANT may try again after this long
FOLLOWERS_RETRY_AFTER_S = 1.0


class StreamGone(GoodputError):
    """A stream that exists but cannot be resumed where asked: the events after the caller's last one were dropped
    (it passed RESUME__MAX_EVENTS, RESUME__MAX_BYTES or RESUME__MAX_TOTAL_BYTES, or its client stalled), or it was
    abandoned. REST 410, gRPC OUT_OF_RANGE."""

    grpc_code = grpc.StatusCode.OUT_OF_RANGE
    http_status = 410
    openai_type = "invalid_request_error"


@dataclass(frozen=True)
class Frame:
    """One recorded event: its number in the stream (0 = the first) and its bytes on the wire (without its id)."""

    seq: int
    data: bytes


@dataclass(frozen=True)
class End:
    """How a stream ended: ``done``, ``error`` (with the error it ended with) or ``abandoned``."""

    status: str
    error: dict[str, Any] | None = None  # {"status": gRPC code name, "message", "code", "param", "retry_after_s"}

    @classmethod
    def of(cls, err: GoodputError) -> End:
        return cls("error", {"status": err.grpc_code.name, "message": err.message, "code": err.code,
                             "param": err.param, "retry_after_s": err.retry_after_s})

    def encode(self) -> bytes:
        return json.dumps({"status": self.status, "error": self.error}, separators=(",", ":")).encode()

    @classmethod
    def decode(cls, raw: bytes) -> End:
        doc = json.loads(raw)
        return cls(str(doc.get("status", "done")), doc.get("error"))

    def raise_error(self, stream_id: str) -> None:
        if self.status == "abandoned":
            raise abandoned(stream_id)
        if self.error:
            e = self.error
            status = grpc.StatusCode.__members__.get(e.get("status", ""), grpc.StatusCode.INTERNAL)
            raise from_status(status, str(e.get("message", "")), code=e.get("code"), param=e.get("param"),
                              retry_after_s=e.get("retry_after_s"))


def not_found(stream_id: str) -> NotFound:
    return NotFound(f"No resumable stream '{stream_id[:128]}': unknown, or its resume window has passed.",
                    param="stream_id", code="stream_not_found")


def dropped(stream_id: str, after: int, first: int, *, why: str = "the stream passed the gateway's bounds: "
            "RESUME__MAX_EVENTS, RESUME__MAX_BYTES or RESUME__MAX_TOTAL_BYTES") -> StreamGone:
    return StreamGone(f"The events of stream '{stream_id}' after {after} are no longer kept (the oldest kept is "
                      f"{first}: {why}); retry the request.", param="Last-Event-ID", code="stream_events_dropped")


def stalled(stream_id: str, after: int, first: int, stall_s: float) -> StreamGone:
    return dropped(stream_id, after, first, why=f"this client read nothing for {stall_s:g} s while the generation "
                   "waited for it, RESUME__STALL_TIMEOUT_S, so it went on without it")


def too_many_followers(stream_id: str, *, tenant_wide: bool, limit: int) -> ResourceExhausted:
    if tenant_wide:
        return ResourceExhausted(f"Your streams already have {limit} resumes following them on this gateway "
                                 "replica (RESUME__MAX_FOLLOWERS_PER_TENANT); close one, or try again shortly.",
                                 param="stream_id", code="too_many_tenant_followers",
                                 retry_after_s=FOLLOWERS_RETRY_AFTER_S)
    return ResourceExhausted(f"Stream '{stream_id}' already has {limit} resumes following it on this gateway replica "
                             "(RESUME__MAX_FOLLOWERS_PER_STREAM); close one, or try again shortly.", param="stream_id",
                             code="too_many_stream_followers", retry_after_s=FOLLOWERS_RETRY_AFTER_S)


def abandoned(stream_id: str) -> StreamGone:
    return StreamGone(f"Stream '{stream_id}' was abandoned: nobody followed it within the resume window, so its "
                      "generation was stopped; retry the request.", param="stream_id", code="stream_abandoned")


def seq_of(entry_id: bytes | str) -> int:
    """The event number of a Redis stream entry id ``0-<seq + 1>``."""
    raw = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
    return int(raw.rpartition("-")[2]) - 1


def check_stream_id(stream_id: str, *, param: str = "stream_id") -> str:
    if not _STREAM_ID.match(stream_id):
        raise InvalidArgument("a stream id is 1-128 of A-Z a-z 0-9 _ -", param=param, code="invalid_value")
    return stream_id


def parse_last_event_id(value: str, *, stream_id: str | None = None) -> tuple[str, int]:
    """``<stream id>:<seq>`` as the stream id and the number of the last event received; ``stream_id``, when given
    (the URL's), must be the one it names."""
    sid, sep, seq = value.strip().rpartition(":")
    if not sep or not _STREAM_ID.match(sid) or not seq.isdigit() or int(seq) > MAX_SEQ:
        raise InvalidArgument("Last-Event-ID must be an event id this gateway sent: <stream id>:<number>",
                              param="Last-Event-ID", code="invalid_value")
    if stream_id is not None and sid != stream_id:
        raise InvalidArgument("Last-Event-ID names another stream than the URL", param="Last-Event-ID",
                              code="invalid_value")
    return sid, int(seq)


def sse_error(err: GoodputError) -> bytes:
    """An error as the last event of an SSE stream (OpenAI's error body)."""
    return b"data: " + json.dumps(err.openai_body(), separators=(",", ":"), ensure_ascii=False).encode() + b"\n\n"


async def sse_events(frames: AsyncGenerator[Frame, None], stream_id: str, *,
                     error: Callable[[GoodputError], bytes] = sse_error) -> AsyncIterator[bytes]:
    """Recorded SSE events as sent: each with its ``id: <stream id>:<seq>``; an error the stream ended with (or a
    resume ran into) as a last event of its own, without an id (``error`` renders it; OpenAI's shape by default)."""
    prefix = f"id: {stream_id}:".encode()
    try:
        async for frame in frames:
            yield prefix + str(frame.seq).encode() + b"\n" + frame.data
    except GoodputError as err:
        yield error(err)
    finally:
        await frames.aclose()
