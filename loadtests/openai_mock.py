"""An OpenAI-compatible endpoint served by the simulated engine: what the overhead benchmark puts behind the LiteLLM
proxy, so LiteLLM is measured against an upstream with the same timing model as Goodput's simulated worker.

``POST /v1/chat/completions`` (streamed as SSE ``chat.completion.chunk`` events with ``stream: true``, one per
engine delta, then a finish chunk, a usage chunk when ``stream_options.include_usage`` asks for it and
``data: [DONE]``; otherwise one ``chat.completion``), ``GET /v1/models`` and ``GET /health``. Generation is
:class:`goodput_inference.sim_engine.SimEngine` in this process (its continuous batching, step times and prefix
cache), not a fixed delay: the same engine model the Goodput worker runs with ``GOODPUT_INFERENCE_ENGINE=sim``.

A raw ASGI app under uvicorn (uvloop, httptools), no framework: the direct path should cost as little as the
worker's gRPC does.

    python -m loadtests.openai_mock --port 4300 --model sim-7b --max-num-seqs 64

Example (in-process, inside a coroutine)::

    app = MockApp(engine=SimEngine(InferenceSettings(engine="sim")), model="sim-7b")
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://mock") as client:
        await client.post("/v1/chat/completions", json={"messages": [...], "max_tokens": 8})
"""

from __future__ import annotations

import argparse
import json
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, cast

from goodput_core.errors import GoodputError
from goodput_core.sampling import Sampling

from goodput_inference.config import InferenceSettings
from goodput_inference.engine import ChatTurn, Delta, Finished, GenEvent, GenRequest
from goodput_inference.sim_engine import SimEngine, SimParams

__all__ = ["MockApp", "build_app"]

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
TENANT = "bench"  # the overhead benchmark's tenant: the same prefix-cache salt scope as on the Goodput worker
_SSE = [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")]
_JSON = [(b"content-type", b"application/json")]


class MockApp:
    def __init__(self, *, engine: SimEngine, model: str) -> None:
        self.engine = engine
        self.model = model
        self._started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        if not self._started:  # in-process use without a lifespan (tests)
            await self.engine.start()
            self._started = True
        path, method = scope["path"], scope["method"]
        if method == "GET" and path in ("/health", "/v1/health"):
            await _reply(send, 200, {"status": "ok"})
        elif method == "GET" and path == "/v1/models":
            await _reply(send, 200, {"object": "list", "data": [{"id": self.model, "object": "model",
                                                                 "owned_by": "goodput-sim"}]})
        elif method == "POST" and path in ("/v1/chat/completions", "/chat/completions"):
            await self._chat(receive, send)
        else:
            await _reply(send, 404, {"error": {"message": f"no route {method} {path}", "type": "not_found"}})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                if not self._started:
                    await self.engine.start()
                    self._started = True
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.engine.shutdown()
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _chat(self, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        try:
            doc = json.loads(body)
            messages = tuple(ChatTurn(role=str(m["role"]), content=str(m.get("content") or ""))
                             for m in doc["messages"])
            max_tokens = int(doc.get("max_completion_tokens") or doc.get("max_tokens") or 16)
        except (ValueError, KeyError, TypeError) as err:
            await _reply(send, 400, {"error": {"message": f"bad request: {err}", "type": "invalid_request_error"}})
            return
        rid = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        request = GenRequest(request_id=rid, messages=messages, sampling=Sampling(max_tokens=max_tokens),
                             tenant=TENANT)
        created = int(time.time())
        head = {"id": rid, "created": created, "model": doc.get("model") or self.model}
        # SimEngine.generate is an async generator function (closed below: aclose aborts the request), though it
        # is annotated with the Engine protocol's AsyncIterator
        events = cast("AsyncGenerator[GenEvent, None]", self.engine.generate(request))
        try:
            if doc.get("stream"):
                usage = bool((doc.get("stream_options") or {}).get("include_usage"))
                await self._stream(events, send, head, usage)
            else:
                await self._whole(events, send, head)
        except GoodputError as err:
            await _reply(send, 400, {"error": {"message": err.message, "type": "invalid_request_error"}})
        finally:
            await events.aclose()

    async def _stream(self, events: Any, send: Send, head: dict[str, Any], usage: bool) -> None:
        started = False
        chunk = {**head, "object": "chat.completion.chunk"}
        async for event in events:
            if not started:  # after the first event: a refusal above is still a 400
                await send({"type": "http.response.start", "status": 200, "headers": _SSE})
                started = True
            if isinstance(event, Delta):
                delta = {"content": event.text}
                if event.completion_tokens <= 1:
                    delta["role"] = "assistant"
                await _event(send, {**chunk, "choices": [{"index": 0, "delta": delta, "finish_reason": None}]})
            elif isinstance(event, Finished):
                await _event(send, {**chunk, "choices": [{"index": 0, "delta": {},
                                                          "finish_reason": event.reason}]})
                if usage:
                    await _event(send, {**chunk, "choices": [], "usage": _usage(event)})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    async def _whole(self, events: Any, send: Send, head: dict[str, Any]) -> None:
        parts: list[str] = []
        end: Finished | None = None
        async for event in events:
            if isinstance(event, Delta):
                parts.append(event.text)
            elif isinstance(event, Finished):
                end = event
        body = {**head, "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": "".join(parts)},
                             "finish_reason": end.reason if end else "stop"}]}
        if end is not None:
            body["usage"] = _usage(end)
        await _reply(send, 200, body)


def _usage(end: Finished) -> dict[str, int]:
    return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens}


async def _event(send: Send, doc: dict[str, Any]) -> None:
    await send({"type": "http.response.body", "body": b"data: " + json.dumps(doc).encode() + b"\n\n",
                "more_body": True})


async def _reply(send: Send, status: int, doc: dict[str, Any]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": _JSON})
    await send({"type": "http.response.body", "body": json.dumps(doc).encode()})


def build_app(*, model: str = "sim-7b", max_num_seqs: int = 64, max_model_len: int = 4096,
              sim: dict[str, Any] | None = None) -> MockApp:
    """The app with a simulated engine configured as a Goodput sim worker with these settings would be."""
    settings = InferenceSettings(engine="sim", served_model_name=model, max_num_seqs=max_num_seqs,
                                 max_model_len=max_model_len)
    return MockApp(engine=SimEngine(settings, params=SimParams.from_dict(sim)), model=model)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m loadtests.openai_mock", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=4300)
    ap.add_argument("--model", default="sim-7b", help="the served model name")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--sim-config", default="", help="SimParams overrides, JSON (default: the A100 / 7B model)")
    args = ap.parse_args(argv)
    import uvicorn

    app = build_app(model=args.model, max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                    sim=json.loads(args.sim_config) if args.sim_config else None)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", access_log=False, lifespan="on")


if __name__ == "__main__":
    main()
