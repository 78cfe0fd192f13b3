"""Stream resume: a streamed answer survives its client's dropped connection (issue 21; BP-PERF-03).

With ``RESUME__WINDOW_S`` above 0, every event of a streamed generation is numbered and recorded as it is produced,
and a client that lost the stream reconnects, on any gateway replica, and gets the rest of the same answer, without
a second generation:

- REST (chat, completions, Responses): every SSE event carries ``id: <stream id>:<seq>`` (``seq`` from 0; the stream
  id is the request's, also in the ``X-Goodput-Stream-Id`` header; a Responses stream's is the response's id).
  ``GET /v1/streams/{stream id}`` with ``Last-Event-ID: <stream id>:<seq>`` (or ``?after=<seq>``; neither = from
  the start), or the same ``POST`` again with that ``Last-Event-ID`` (what an SSE client sends when it reconnects),
  answers the events after ``seq``, following the generation live while it runs, to its ``[DONE]``.
- gRPC: ``StreamStart.resume_token`` and every message's ``seq``; ``ResumeStream(resume_token, from_seq)``.

Only the stream's tenant may resume it: another tenant's id is unknown to it (404, not 403). Unknown or expired is
404 ``stream_not_found``; a stream whose events after the client's last one were dropped by the bounds, or that was
abandoned, is 410 (gRPC OUT_OF_RANGE) ``stream_events_dropped`` / ``stream_abandoned``.

How it runs. The generation no longer runs inside the client's response: a *producer* task drives the API's event
stream (the SSE bytes, or the serialized gRPC messages) to its end and records each event in a :class:`_Recording`;
the client's response follows that recording in this process, so no store sits on the token path. A client that
goes away detaches: the generation goes on so that a reconnect finds the rest, and it is cut (worker call cancelled,
lease released, as without resume) once nobody has followed it for the window: an abandoned answer costs at most the
window's decoding. It runs once, so it is admitted, settled and metered once; a resume runs nothing.

The shared store. One flusher per process writes what was recorded since its last turn, for every stream in one
pipeline, every ``RESUME__FLUSH_S`` (a stream's first event at once), never on the token path. Each stream is a Redis
stream (``XADD`` with the event's number as its entry id, ``0-<seq + 1>``; ``XTRIM MINID`` for the bounds;
``PEXPIRE`` the window after its end): a reader on another replica catches up and follows live with one blocking
``XREAD`` from the id it has, and a gap in the ids (events dropped by the bounds) shows. A heartbeat key marks the
producer alive (a reader of a stream whose replica died gets an error, not a wait), a hash of readers marks where
each follower elsewhere is (so the producer neither cuts the generation under it nor runs past it). Those followers
read through a pool of their own, capped (``RESUME__MAX_READER_CONNECTIONS``). Without Redis the recordings stay in
this process, finished ones for the window (bounded by ``RESUME__LOCAL_MAX_BYTES``): resumes must reach the same
replica.

Bounds: ``RESUME__MAX_EVENTS`` and ``RESUME__MAX_BYTES`` per stream (the oldest events are dropped past them, never
one a follower has yet to read: the generation waits for a slow follower instead, flow control, unless it read nothing
for ``RESUME__STALL_TIMEOUT_S``), kept ``RESUME__WINDOW_S`` after the stream ended. ``RESUME__MAX_TOTAL_BYTES`` for all
the recordings of a process (past it: finished ones forgotten, running ones keep what their followers have yet to
read, new streams are served unrecorded). ``RESUME__MAX_FOLLOWERS_PER_STREAM`` and ``_PER_TENANT`` resumes at once
per replica (429 past them). Per tenant, ``resume_streams`` in the keys file (goodput_gateway.storage)
bounds its recordings in Redis (running, and ended ones for the window): past it a stream is recorded on its own
replica only (a resume elsewhere is 404), and the client is served as ever.

Example (in a coroutine; ``source`` yields an API's wire events, ``generation`` is what it streams)::

    buffer = StreamBuffer(settings, redis=None)
    async for frame in buffer.stream(source, api="sse", tenant="acme", stream_id="req-1",
                                     closer=generation.aclose):
        ...                                 # the client's events; it may go away, the generation goes on
    frames = await buffer.resume(api="sse", tenant="acme", stream_id="req-1", after=41)
    async for frame in frames:              # events 42, 43, ... to the end
        ...

>>> parse_last_event_id("req-1f2e:41")
('req-1f2e', 41)
"""

from goodput_gateway.resume.buffer import StreamBuffer
from goodput_gateway.resume.frames import (
    LAST_EVENT_ID,
    MAX_SEQ,
    STREAM_HEADER,
    Frame,
    StreamGone,
    check_stream_id,
    parse_last_event_id,
    sse_error,
    sse_events,
)

__all__ = ["LAST_EVENT_ID", "MAX_SEQ", "STREAM_HEADER", "Frame", "StreamBuffer", "StreamGone", "check_stream_id",
           "parse_last_event_id", "sse_error", "sse_events"]
