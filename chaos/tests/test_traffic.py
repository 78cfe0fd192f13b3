"""The chaos client's verdicts, against a fake gateway that misbehaves on purpose: a whole answer is completed, an
OpenAI-shaped error or an SSE error event is a clear failure, and a hang, a connection dropped with no answer or a
stream cut short without an error is a lost request; a refused connection is tried on the next replica, and a broken
stream whose events are numbered is resumed with Last-Event-ID."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from goodput_testing import dead_port

from chaos.traffic import Keys, Mix, Traffic

CHUNK = {"choices": [{"index": 0, "delta": {"content": " tok"}, "finish_reason": None}]}
LAST = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
ERROR = {"error": {"message": "the inference worker failed mid-stream", "type": "x", "param": None,
                   "code": "unavailable"}}


class FakeGateway:
    """Answers every request the way ``mode`` says; records the requests' headers."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.headers: list[dict[str, str]] = []
        self.server: asyncio.Server | None = None
        self.handlers: set[asyncio.Task[None]] = set()

    @property
    def url(self) -> str:
        assert self.server is not None
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def start(self) -> FakeGateway:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.handlers.add(task)
        try:
            await self._answer(reader, writer)
        finally:
            self.handlers.discard(task)

    async def _answer(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in head.split("\r\n")[1:])
                   if k}
        self.headers.append(headers)
        await reader.readexactly(int(headers.get("content-length", "0")))
        mode = self.mode
        if mode == "hang":
            await asyncio.sleep(30)
        elif mode == "reset":
            pass  # the request was read; no answer at all
        elif mode in ("503", "502"):
            body = json.dumps(ERROR).encode() if mode == "503" else b"Bad Gateway"
            writer.write(f"HTTP/1.1 {mode} X\r\ncontent-length: {len(body)}\r\nconnection: close\r\n\r\n".encode()
                         + body)
        else:
            # an event stream delimited by the connection's end (no length): a close is a clean end of the body
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\nconnection: close\r\n\r\n")
            resuming = "last-event-id" in headers
            events = [CHUNK, CHUNK, CHUNK, LAST] if mode in ("ok", "resume") or resuming else \
                [CHUNK, ERROR] if mode == "error" else [CHUNK, CHUNK]
            start = int(headers["last-event-id"].rsplit(":", 1)[1]) + 1 if resuming else 0
            for seq, event in enumerate(events[start:] if resuming else events, start=start):
                numbered = f"id: s1:{seq}\n" if mode == "resume" else ""
                writer.write(f"{numbered}data: {json.dumps(event)}\n\n".encode())
            if mode in ("ok", "error") or resuming:
                writer.write(b"data: [DONE]\n\n" if mode != "error" else b"")
        await writer.drain()
        writer.close()

    async def stop(self) -> None:
        for task in list(self.handlers):
            task.cancel()
        await asyncio.gather(*self.handlers, return_exceptions=True)
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()


@pytest.fixture
async def gateway() -> AsyncIterator[FakeGateway]:
    fake = await FakeGateway().start()
    yield fake
    await fake.stop()


def _traffic(*urls: str, resume: bool = False) -> Traffic:
    return Traffic(list(urls), keys=Keys(p0="k0", p2="k2"), kb="kb", resume=resume,
                   mix=Mix(deadline_s=0.5, grace_s=0.5, job_deadline_s=2.0, poll_s=0.05))


@pytest.mark.parametrize(("mode", "status", "reason"), [
    ("ok", "completed", ""),
    ("error", "failed", "sse unavailable"),
    ("503", "failed", "http 503 unavailable"),
    ("502", "failed", "http 502 unshaped"),
    ("truncate", "lost", "truncated"),
    ("reset", "lost", "reset"),
    ("hang", "lost", "hung"),
])
async def test_each_way_a_stream_can_end_gets_its_verdict(gateway: FakeGateway, mode: str, status: str,
                                                          reason: str) -> None:
    gateway.mode = mode
    traffic = _traffic(gateway.url)
    try:
        outcome = await traffic.once("chat")
    finally:
        await traffic.aclose()
    assert (outcome.status, outcome.reason) == (status, reason), outcome.detail
    assert gateway.headers[0]["authorization"] == "Bearer k0" and gateway.headers[0]["x-goodput-deadline-ms"] == "500"


async def test_a_refused_connection_is_tried_on_the_next_replica_and_none_at_all_is_a_clear_failure(
        gateway: FakeGateway) -> None:
    traffic = _traffic(f"http://127.0.0.1:{dead_port()}", gateway.url)
    nowhere = _traffic(f"http://127.0.0.1:{dead_port()}")
    try:
        first = await traffic.once("chat")
        second = await traffic.once("chat")
        refused = await nowhere.once("chat")
    finally:
        await traffic.aclose()
        await nowhere.aclose()
    assert first.status == second.status == "completed" and first.failovers + second.failovers == 1
    assert (refused.status, refused.reason) == ("failed", "no gateway accepts connections")


async def test_a_numbered_stream_that_breaks_is_resumed_where_it_stopped(gateway: FakeGateway) -> None:
    gateway.mode = "resume"
    traffic = _traffic(gateway.url, gateway.url, resume=True)
    traffic.drop_every = 1  # the client drops it after 3 events, then resumes
    try:
        outcome = await traffic.once("chat")
    finally:
        await traffic.aclose()
    assert (outcome.status, outcome.resumed) == ("completed", 1), outcome.detail
    assert gateway.headers[1]["last-event-id"] == "s1:2"  # the third event's id: the rest follows it
