"""OpenAI's wire format, in one place: the JSON answer of chat and completions (:func:`completion_body`), their
server-sent chunks (:func:`stream_events`), errors in OpenAI's shape (:func:`error_response`), and the headers a
generation's response carries. The REST routes (:mod:`goodput_gateway.api`) and the jobs worker shape their answers
here; nothing here knows how an answer was made.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict
from itertools import accumulate
from typing import Any

from fastapi.responses import JSONResponse
from opentelemetry import trace
from opentelemetry.trace import Status, StatusCode

from goodput_core.context import REQUEST_ID_HEADER
from goodput_core.errors import GoodputError, InvalidArgument
from goodput_core.sampling import TokenLogprob

from goodput_gateway.encoding import dumps
from goodput_gateway.events import StreamEnd, TextDelta
from goodput_gateway.generation import Generation, Opened
from goodput_gateway.jobs import JOB_HEADER, Parked
from goodput_gateway.tools import calling, named, new_call_id, tool_calls

__all__ = ["DEGRADED_HEADER", "ROUTE_HEADER", "SERVER_TIMING_HEADER", "completion_body", "deadline_header",
           "error_response", "logprobs_json", "sse", "stream_events"]


def error_response(err: GoodputError, request_id: str | None = None) -> JSONResponse:
    headers = {REQUEST_ID_HEADER: request_id} if request_id else {}
    if err.retry_after_s is not None:
        headers["Retry-After"] = str(max(int(err.retry_after_s + 0.999), 1))
    if isinstance(err, Parked):  # a shed P2 request parked as a job: the 429 says which
        headers[JOB_HEADER] = err.job_id
    headers.update(err.headers)  # e.g. the x-ratelimit-* values of a request refused by its quotas
    return JSONResponse(err.openai_body(), status_code=err.http_status, headers=headers)


def sse(payload: dict[str, Any]) -> bytes:
    """One server-sent event."""
    return b"data: " + dumps(payload) + b"\n\n"


def _ids(opened: Opened, route: str, response_id: str = "") -> tuple[str, str, int]:
    prefix = "chatcmpl" if route == "chat" else "cmpl"
    return f"{prefix}-{response_id or opened.request_id.removeprefix('req-') or uuid.uuid4().hex}", \
        ("chat.completion" if route == "chat" else "text_completion"), int(time.time())


def _usage(end: StreamEnd) -> dict[str, Any]:
    return {"prompt_tokens": end.prompt_tokens, "completion_tokens": end.completion_tokens,
            "total_tokens": end.prompt_tokens + end.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": end.cached_tokens}}


def _logprob(value: float) -> float:
    """A log probability JSON can carry (-inf, for a token the engine could not score, as OpenAI's -9999)."""
    return max(value, -9999.0)


def logprobs_json(tokens: Sequence[TokenLogprob], *, route: str, offset: int = 0) -> dict[str, Any]:
    """OpenAI's ``logprobs`` of a choice: chat's ``content`` entries (token, logprob, bytes, top_logprobs), or the
    legacy completions' parallel lists (``text_offset`` counted from ``offset`` characters into the answer).

    >>> t = TokenLogprob("Hi", -0.25, (("Hi", -0.25), ("Hey", -1.5)))
    >>> logprobs_json([t], route="chat")["content"][0]["top_logprobs"][1]
    {'token': 'Hey', 'logprob': -1.5, 'bytes': [72, 101, 121]}
    >>> logprobs_json([t, t], route="completions", offset=3)["text_offset"]
    [3, 5]
    """
    if route == "chat":
        return {"content": [{"token": t.token, "logprob": _logprob(t.logprob), "bytes": list(t.token.encode()),
                             "top_logprobs": [{"token": tok, "logprob": _logprob(lp), "bytes": list(tok.encode())}
                                              for tok, lp in t.top]} for t in tokens], "refusal": None}
    offsets = list(accumulate((len(t.token) for t in tokens), initial=offset))[:-1]
    return {"tokens": [t.token for t in tokens],
            "token_logprobs": [None if math.isnan(t.logprob) else _logprob(t.logprob) for t in tokens],
            "top_logprobs": [{tok: _logprob(lp) for tok, lp in t.top} for t in tokens], "text_offset": offsets}


def _choice(opened: Opened, index: int, text: str, finish: str, logprobs: Sequence[TokenLogprob], *,
            route: str, chosen: Sequence[dict[str, Any]] = ()) -> dict[str, Any]:
    """One choice; ``chosen``: the calls a tool_choice auto answer made (the worker's parser read them)."""
    lp = logprobs_json(logprobs, route=route) if opened.request.sampling.logprobs is not None else None
    if route != "chat":
        return {"index": index, "text": text, "finish_reason": finish, "logprobs": lp}
    calls = list(chosen) or tool_calls(opened.request, text)
    # a required/named answer's text is the call itself; an auto answer's is what the model said beside its calls
    message: dict[str, Any] = ({"role": "assistant", "content": (text or None) if chosen else None,
                                "tool_calls": calls} if calls
                               else {"role": "assistant", "content": text})
    return {"index": index, "message": message, "finish_reason": "tool_calls" if calls and finish == "stop" else finish,
            "logprobs": lp}


SERVER_TIMING_HEADER = "Server-Timing"
DEGRADED_HEADER = "X-Goodput-Degraded"
ROUTE_HEADER = "X-Goodput-Route"
DEADLINE_HEADERS = ("x-goodput-deadline-ms", "request-timeout-ms")
MAX_DEADLINE_MS = 86_400_000


def deadline_header(headers: Any) -> float | None:
    """The caller's deadline in seconds from ``X-Goodput-Deadline-Ms`` or ``Request-Timeout-Ms`` (the header
    proposed for the openai SDK): milliseconds from arrival; the shorter when both are given; None when neither.

    >>> deadline_header({"request-timeout-ms": "1500"}), deadline_header({})
    (1.5, None)
    """
    found = []
    for name in DEADLINE_HEADERS:
        raw = headers.get(name)
        if raw is None:
            continue
        try:
            ms = float(raw)
        except ValueError:
            ms = float("nan")
        if not 0 < ms <= MAX_DEADLINE_MS:  # NaN fails this too
            raise InvalidArgument(f"{name} must be milliseconds, above 0 and at most {MAX_DEADLINE_MS}",
                                  param=name, code="invalid_value")
        found.append(ms / 1000)
    return min(found) if found else None


def completion_body(opened: Opened, text: str, end: StreamEnd, *, route: str, response_id: str = "",
                    logprobs: Sequence[TokenLogprob] = (),
                    answers: dict[int, tuple[list[str], list[TokenLogprob]]] | None = None,
                    prompt_logprobs: Sequence[TokenLogprob] = ()) -> dict[str, Any]:
    """The OpenAI-shaped JSON answer (``chat.completion`` or ``text_completion``), with the Goodput extensions;
    ``answers`` (:attr:`Generation.answers`) gives every answer of a request for several (n), ``prompt_logprobs``
    the prompt's tokens of an echo."""
    cid, obj, created = _ids(opened, route, response_id)
    n = opened.request.sampling.n
    parts = [(text, list(logprobs), end.finish_reason)]
    if n > 1 and answers is not None:
        reasons = end.finish_reasons or (end.finish_reason,) * n
        parts = [("".join(answers.get(i, ([], []))[0]), answers.get(i, ([], []))[1],
                  reasons[i] if i < len(reasons) else "stop") for i in range(n)]
    if opened.request.sampling.echo:  # completions: the prompt first
        parts = [(opened.request.prompt + t, [*prompt_logprobs, *lp], f) for t, lp, f in parts]
    choices = [_choice(opened, i, t, f, lp, route=route, chosen=end.tool_calls if i == 0 else ())
               for i, (t, lp, f) in enumerate(parts)]
    body = {"id": cid, "object": obj, "created": created, "model": opened.model, "choices": choices,
            "usage": _usage(end), "system_fingerprint": None}
    if opened.sources:  # RAG extension: the chunks the answer was grounded on, beside `choices`
        body["sources"] = [asdict(s) for s in opened.sources]
    if opened.cache is not None:  # what the response cache did (hit, layer, similarity)
        body["goodput_cache"] = opened.cache.as_dict()
    return body


async def stream_events(generation: Generation, route: str, span: trace.Span) -> AsyncIterator[bytes]:
    opened = generation.opened
    cid, obj, created = _ids(opened, route)
    obj = "chat.completion.chunk" if route == "chat" else "text_completion"
    model = opened.model

    asked = opened.request.sampling.logprobs is not None
    n = opened.request.sampling.n
    sent = [0] * n  # characters of each answer so far (the legacy logprobs' text_offset)

    # Tool calls stream as OpenAI's incremental tool_calls deltas: a named function's arguments as they are
    # generated; a `required` answer (one or more calls) once it is whole.
    calling_now = route == "chat" and calling(opened.request)
    function = named(opened.request) if calling_now else None
    held: list[str] = []

    def chunk(delta_text: str | None, finish: str | None, *, role: bool = False, index: int = 0,
              logprobs: Sequence[TokenLogprob] = (), calls: list[dict[str, Any]] | None = None) -> dict[str, Any]:
        lp = logprobs_json(logprobs, route=route, offset=sent[index]) if asked and logprobs else None
        if route == "chat":
            delta: dict[str, Any] = {"role": "assistant"} if role else {}
            if calls is not None:
                delta["tool_calls"] = calls
            elif delta_text is not None:
                delta["content"] = delta_text
            choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": lp}
        else:
            choice = {"index": index, "text": delta_text or "", "finish_reason": finish, "logprobs": lp}
        return {"id": cid, "object": obj, "created": created, "model": model, "choices": [choice]}

    try:
        if route == "chat":
            first = chunk("", None, role=True)
            if opened.sources:  # RAG extension on the first chunk (the openai SDK keeps unknown fields)
                first["sources"] = [asdict(s) for s in opened.sources]
            if opened.cache is not None:
                first["goodput_cache"] = opened.cache.as_dict()
            if opened.timeline is not None and opened.timeline.degraded:
                first["goodput_degraded"] = list(opened.timeline.degraded)
            yield sse(first)
            for i in range(1, n):  # every answer opens with its role
                yield sse(chunk("", None, role=True, index=i))
        if function is not None:  # the call's id and name first, then its arguments as they come
            yield sse(chunk(None, None, calls=[{"index": 0, "id": new_call_id(), "type": "function",
                                                 "function": {"name": function, "arguments": ""}}]))
        echo = opened.request.sampling.echo  # completions: the prompt first, in every answer
        async for event in generation:
            if echo and route != "chat":
                echo = False
                for i in range(n):
                    yield sse(chunk(opened.request.prompt, None, index=i, logprobs=event.prompt_logprobs
                                     if isinstance(event, TextDelta) else ()))
                    sent[i] += len(opened.request.prompt)
            if isinstance(event, TextDelta):
                if not event.text and not event.logprobs:  # the prompt's logprobs alone: sent with the echo
                    continue
                if function is not None:
                    yield sse(chunk(None, None, logprobs=event.logprobs, calls=[
                        {"index": 0, "function": {"arguments": event.text}}]))
                elif calling_now:
                    held.append(event.text)
                else:
                    message = chunk(event.text, None, logprobs=event.logprobs, index=event.index)
                    if opened.request.continuous_usage:  # vLLM's continuous usage stats: the usage so far
                        message["usage"] = {"prompt_tokens": event.prompt_tokens,
                                            "completion_tokens": event.completion_tokens,
                                            "total_tokens": event.prompt_tokens + event.completion_tokens}
                    yield sse(message)
                sent[event.index] += len(event.text)
            else:
                finish = event.finish_reason
                # tool_choice auto: the calls the model chose, each whole, after any text
                calls: Sequence[dict[str, Any]] | None = event.tool_calls
                if calling_now:  # a named function's call is sent already; a `required` answer's is whole now
                    calls = [{"index": 0}] if function is not None else tool_calls(opened.request, "".join(held))
                if function is None:
                    for i, call in enumerate(calls or ()):
                        yield sse(chunk(None, None, calls=[{"index": i, **call}]))
                    if calling_now and not calls:  # not a whole call (cut by max_tokens): the text as it came
                        yield sse(chunk("".join(held), None))
                if calls and finish == "stop":
                    finish = "tool_calls"
                closing = [chunk(None, finish)]
                closing += [chunk(None, reason, index=i) for i, reason in enumerate(event.finish_reasons[1:n], start=1)]
                if opened.request.include_usage:
                    closing.append({"id": cid, "object": obj, "created": created, "model": model, "choices": [],
                                    "usage": _usage(event)})
                timeline = generation.timing()
                if timeline is not None:  # Goodput extension, on the last chunk: where the time went
                    closing[-1]["goodput_timing"] = timeline.as_json(opened.profile)
                for message in closing:
                    yield sse(message)
                yield b"data: [DONE]\n\n"
    except GoodputError as err:
        # Headers are sent: the error travels as an SSE event (the openai SDK raises it as an APIError).
        span.set_status(Status(StatusCode.ERROR, err.message))
        yield sse(err.openai_body())
    finally:
        await generation.aclose()
