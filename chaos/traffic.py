"""Steady mixed traffic through the gateways' REST API, and what became of every request.

Open-loop: each kind of request arrives at its own fixed rate whatever happens to the ones before it, so a fault shows
up as requests that fail, hang or slow down, never as a client that politely stops asking. The kinds:

- ``chat``: a P0 chat completion, streamed (SSE), sampled (temperature > 0: never cached), a prompt of its own;
- ``cached``: a P0 chat completion, not streamed, greedy, one of a few fixed questions (the response cache answers
  them after their first time);
- ``rag``: a P0 chat completion, streamed, grounded on a knowledge base indexed before the traffic starts;
- ``embed``: ``POST /v1/embeddings``;
- ``batch``: a P2 job (``POST /v1/jobs``), then polled (``GET /v1/jobs/{id}``) until it ends.

Every request ends in one of three outcomes:

- ``completed``: a 200 with a whole answer (a stream: its finish reason, then ``[DONE]``); a job: ``completed``;
- ``failed``: a clear error: an HTTP error with OpenAI's error body, an SSE ``{"error": ...}`` event, a job that
  ended ``failed`` or ``expired`` with its ``last_error``, or no gateway accepting the connection at all (the
  request never left the client); an HTTP error with any other body is ``failed`` too, its reason ``unshaped``;
- ``lost``: ``hung`` (no end by the request's deadline plus a grace), ``reset`` (the connection broke after the
  request was sent, with no error), ``truncated`` (a stream that ended without ``[DONE]`` and without an error
  event), ``vanished`` (a job the gateway no longer knows).

The client spreads requests over every gateway replica round-robin. There is no load balancer on one machine: when
a gateway refuses the connection (it is down), the client tries the next one (``failovers``); that is safe because
the request never reached anyone. Nothing sent is ever retried, and connections are not kept alive between
requests, so a request is never written on a connection the server has already dropped. With ``resume`` (the
gateway numbers a stream's events and keeps them: SSE ``id:``), a stream that breaks is resumed on another replica
with ``Last-Event-ID`` (the same POST again), and ``drop_every`` makes the client itself drop every n-th stream
after a few events and resume it.

Example::

    traffic = Traffic(["http://127.0.0.1:8080"], keys=Keys(p0="k0", p2="k2"), kb="handbook", mix=Mix())
    traffic.start()          # a thread of its own
    ...
    traffic.stop(drain_s=30)
    [o.status for o in traffic.outcomes]
"""

from __future__ import annotations

import asyncio
import itertools
import json
import random
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

__all__ = ["KINDS", "Keys", "Mix", "Outcome", "Traffic", "classify_error_body", "parse_sse"]

KINDS = ("chat", "cached", "rag", "embed", "batch")
CACHED_QUESTIONS = ("What is the capital of France?", "How many days are in a leap year?",
                    "What colour is the sky on a clear day?")
RAG_QUESTIONS = ("When is the duck race?", "How long is the train to Quenby?", "Can I bring a dog?",
                 "Where do I park for the festival?")
_WORDS = ("alpha bravo charlie delta echo foxtrot golf hotel india juliet kilo lima mike november oscar papa quebec "
          "romeo sierra tango uniform victor whiskey xray yankee zulu").split()
DEADLINE_HEADER = "X-Goodput-Deadline-Ms"


@dataclass(frozen=True)
class Keys:
    p0: str  # an interactive tenant's key (P0)
    p2: str  # a batch tenant's key (P2: its jobs)


@dataclass(frozen=True)
class Mix:
    """Arrival rates (requests per second) and bounds of the traffic."""

    chat: float = 2.5
    cached: float = 1.0
    rag: float = 0.75
    embed: float = 0.5
    batch: float = 0.5
    max_tokens: int = 24
    deadline_s: float = 20.0  # P0 requests: X-Goodput-Deadline-Ms; the client gives up at this plus grace_s
    job_deadline_s: float = 60.0  # a job not ended this long after its submission is lost (hung)
    grace_s: float = 5.0
    poll_s: float = 0.5  # a job's status is polled this often

    def rates(self) -> dict[str, float]:
        return {k: float(getattr(self, k)) for k in KINDS}


@dataclass
class Outcome:
    """What became of one request. Times are ``time.monotonic()``; ``arrival`` is when it was due."""

    kind: str
    arrival: float
    status: str = "pending"  # completed | failed | lost
    reason: str = ""  # failed: the error's code or message; lost: hung | reset | truncated | vanished
    end: float | None = None
    gateway: int = -1  # the replica that answered (for a job: that took it)
    http_status: int | None = None
    failovers: int = 0  # connections refused and tried on the next replica
    resumed: int = 0  # times a broken or dropped stream was resumed
    ttft: float | None = None  # streams: the first content
    cache: str = ""  # cached: what the response cache did (hit / miss / error...)
    degraded: str = ""  # X-Goodput-Degraded
    detail: str = ""
    job_state: str = ""  # batch: the job's state at the last poll
    attempts: int = 0  # batch: the job's attempts when it ended

    @property
    def latency(self) -> float | None:
        return None if self.end is None else self.end - self.arrival

    def as_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "arrival": round(self.arrival, 4), "status": self.status, "reason": self.reason,
                "latency_s": None if self.latency is None else round(self.latency, 4), "gateway": self.gateway,
                "http_status": self.http_status, "failovers": self.failovers, "resumed": self.resumed,
                "ttft_s": None if self.ttft is None else round(self.ttft, 4), "cache": self.cache,
                "degraded": self.degraded, "detail": self.detail[:300], "attempts": self.attempts}


class _Done(Exception):
    """Ends a request with its outcome already set."""


class _NoGateway(Exception):
    pass


def classify_error_body(status: int, body: bytes) -> tuple[str, str]:
    """An HTTP error's reason and detail: OpenAI's shape gives its code (``shaped``), anything else ``unshaped``.

    >>> classify_error_body(503, b'{"error": {"message": "down", "type": "x", "param": null, "code": "unavailable"}}')
    ('http 503 unavailable', 'down')
    >>> classify_error_body(502, b"Bad Gateway")
    ('http 502 unshaped', 'Bad Gateway')
    """
    try:
        doc = json.loads(body)
        error = doc["error"]
        message = str(error["message"])
        return f"http {status} {error.get('code') or error.get('type') or 'error'}", message
    except (ValueError, KeyError, TypeError):
        return f"http {status} unshaped", body[:200].decode(errors="replace")


def parse_sse(lines: list[str]) -> list[tuple[str | None, str]]:
    """SSE lines into events (``id``, ``data``); comments and other fields are skipped.

    >>> parse_sse(["id: s1-0", "data: {}", "", ": keep-alive", "", "data: [DONE]", ""])
    [('s1-0', '{}'), (None, '[DONE]')]
    """
    events: list[tuple[str | None, str]] = []
    event_id: str | None = None
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                events.append((event_id, "\n".join(data)))
            event_id, data = None, []
        elif line.startswith("data:"):
            data.append(line[5:].lstrip(" "))
        elif line.startswith("id:"):
            event_id = line[3:].strip()
    if data:
        events.append((event_id, "\n".join(data)))
    return events


@dataclass
class _StreamState:
    last_id: str | None = None
    content_events: int = 0
    finished: bool = False
    done: bool = False
    error: str = ""
    error_code: str = ""
    ids: list[str] = field(default_factory=list)


class Traffic:
    """Runs the mix against ``gateways`` (REST base URLs) in a thread of its own until :meth:`stop`."""

    def __init__(self, gateways: list[str], *, keys: Keys, kb: str, mix: Mix, model: str = "",
                 resume: bool = False, seed: int = 0) -> None:
        self.gateways = list(gateways)
        self.keys = keys
        self.kb = kb
        self.mix = mix
        self.model = model
        self.resume = resume
        self.drop_every = 0  # > 0 (with resume): the client drops every n-th stream after a few events and resumes it
        self.outcomes: list[Outcome] = []
        self.events: list[tuple[float, str]] = []  # (time, what): notes from the client (for the logs)
        self._rng = random.Random(seed)
        self._rr = itertools.count()
        self._streams = itertools.count()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._clients: list[httpx.AsyncClient] = []

    # --- lifecycle ---------------------------------------------------------------------------------------------------
    def start(self) -> None:
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="chaos-traffic", daemon=True)
        self._thread.start()
        ready.wait(10)

    def stop(self, drain_s: float) -> None:
        """No new arrivals; waits up to ``drain_s`` for the requests in flight (each also ends at its deadline)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(drain_s + 5)

    def _run(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main(ready))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()

    def _open_clients(self) -> None:
        # No keep-alive: every request on a fresh connection (see the module's docstring).
        limits = httpx.Limits(max_connections=1000, max_keepalive_connections=0)
        self._clients = [httpx.AsyncClient(base_url=g, limits=limits, timeout=httpx.Timeout(10.0, connect=2.0))
                         for g in self.gateways]

    async def once(self, kind: str) -> Outcome:
        """One request of ``kind``, in the caller's event loop, and what became of it (also recorded in
        ``outcomes``); for tests of the client itself. Call :meth:`aclose` when done."""
        if not self._clients:
            self._open_clients()
        outcome = Outcome(kind=kind, arrival=time.monotonic())
        self.outcomes.append(outcome)
        await self._guarded(outcome, self._runner(kind))
        return outcome

    async def aclose(self) -> None:
        for c in self._clients:
            await c.aclose()
        self._clients = []

    def _runner(self, kind: str) -> Callable[[Outcome], Awaitable[None]]:
        return {"chat": self._chat, "cached": self._cached, "rag": self._rag, "embed": self._embed,
                "batch": self._batch}[kind]

    async def _main(self, ready: threading.Event) -> None:
        self._open_clients()
        ready.set()
        arrivals = [asyncio.create_task(self._arrivals(kind, rate)) for kind, rate in self.mix.rates().items()
                    if rate > 0]
        while not self._stop.is_set():
            await asyncio.sleep(0.1)
        for a in arrivals:
            a.cancel()
        await asyncio.gather(*arrivals, return_exceptions=True)
        longest = max(self.mix.deadline_s, self.mix.job_deadline_s) + self.mix.grace_s + 5
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=longest)
        left = list(self._tasks)
        for t in left:
            t.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        await self.aclose()

    async def _arrivals(self, kind: str, rate: float) -> None:
        """Fixed intervals (a random phase per kind), so the rate is steady and buckets compare."""
        interval = 1.0 / rate
        loop = asyncio.get_running_loop()
        due = loop.time() + self._rng.uniform(0, interval)
        runner = self._runner(kind)
        while True:
            await asyncio.sleep(max(0.0, due - loop.time()))
            outcome = Outcome(kind=kind, arrival=time.monotonic())
            self.outcomes.append(outcome)
            task = asyncio.create_task(self._guarded(outcome, runner))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
            due += interval

    async def _guarded(self, o: Outcome, runner: Callable[[Outcome], Awaitable[None]]) -> None:
        limit = (self.mix.job_deadline_s if o.kind == "batch" else self.mix.deadline_s) + self.mix.grace_s
        try:
            await asyncio.wait_for(runner(o), timeout=limit)
        except (asyncio.TimeoutError, httpx.TimeoutException):
            self._end(o, "lost", "hung", f"no end within {limit:.0f} s")
        except asyncio.CancelledError:
            self._end(o, "lost", "hung", "still running when the run ended")
            raise
        except _Done:
            pass
        except _NoGateway as err:
            self._end(o, "failed", "no gateway accepts connections", str(err))
        except (httpx.TransportError, httpx.StreamError) as err:  # after the request was sent: nobody said why
            self._end(o, "lost", "reset", f"{type(err).__name__}: {err}")
        except Exception as err:  # noqa: BLE001 - a bug of the client must not pass for the platform's
            self._end(o, "lost", "client error", f"{type(err).__name__}: {err}")
        if o.status == "pending":
            self._end(o, "lost", "client error", "no outcome recorded")

    @staticmethod
    def _end(o: Outcome, status: str, reason: str, detail: str = "") -> None:
        if o.status != "pending":
            return
        o.status, o.reason, o.detail, o.end = status, reason, detail, time.monotonic()

    # --- sending with failover ----------------------------------------------------------------------------------
    def _pick(self) -> int:
        return next(self._rr) % len(self.gateways)

    async def _send(self, o: Outcome, method: str, path: str, *, key: str, json_body: Any = None,
                    headers: dict[str, str] | None = None, stream: bool = False,
                    first: int | None = None) -> tuple[int, httpx.Response]:
        """Sends on one replica, trying the next on a refused connection (the request was not sent); returns the
        replica and the response (open, for a stream: the caller closes it)."""
        start = self._pick() if first is None else first
        hdrs = {"Authorization": f"Bearer {key}", **(headers or {})}
        last: Exception | None = None
        for attempt in range(len(self.gateways)):
            i = (start + attempt) % len(self.gateways)
            client = self._clients[i]
            # reads wait past the request's own limit (see _guarded): a silent server is "hung", not a timeout here
            request = client.build_request(method, path, json=json_body, headers=hdrs,
                                           timeout=httpx.Timeout(self.mix.deadline_s + self.mix.grace_s + 5,
                                                                 connect=2.0))
            try:
                response = await client.send(request, stream=stream)
            except (httpx.ConnectError, httpx.ConnectTimeout) as err:
                last = err
                o.failovers += 1
                continue
            return i, response
        raise _NoGateway(f"{type(last).__name__}: {last}")

    async def _json_call(self, o: Outcome, method: str, path: str, *, key: str,
                         body: Any = None, headers: dict[str, str] | None = None) -> tuple[int, httpx.Response]:
        i, response = await self._send(o, method, path, key=key, json_body=body, headers=headers)
        o.gateway, o.http_status = i, response.status_code
        return i, response

    def _fail_http(self, o: Outcome, response: httpx.Response) -> None:
        reason, detail = classify_error_body(response.status_code, response.content)
        self._end(o, "failed", reason, detail)
        raise _Done

    # --- the kinds ---------------------------------------------------------------------------------------------------
    def _p0_headers(self) -> dict[str, str]:
        return {DEADLINE_HEADER: str(int(self.mix.deadline_s * 1000))}

    def _prompt(self) -> str:
        return " ".join(self._rng.choice(_WORDS) for _ in range(12)) + ". Tell me a story about it."

    def _chat_body(self, content: str, *, stream: bool, temperature: float, kb: str = "") -> dict[str, Any]:
        body: dict[str, Any] = {"messages": [{"role": "user", "content": content}], "max_tokens": self.mix.max_tokens,
                                "temperature": temperature, "stream": stream}
        if self.model:
            body["model"] = self.model
        if stream:
            body["stream_options"] = {"include_usage": True}
        if kb:
            body["knowledge_base"] = kb
        return body

    async def _chat(self, o: Outcome) -> None:
        await self._stream(o, self._chat_body(self._prompt(), stream=True, temperature=0.8))

    async def _rag(self, o: Outcome) -> None:
        await self._stream(o, self._chat_body(self._rng.choice(RAG_QUESTIONS), stream=True, temperature=0.8,
                                              kb=self.kb))

    async def _cached(self, o: Outcome) -> None:
        body = self._chat_body(self._rng.choice(CACHED_QUESTIONS), stream=False, temperature=0.0)
        _, r = await self._json_call(o, "POST", "/v1/chat/completions", key=self.keys.p0, body=body,
                                     headers=self._p0_headers())
        if r.status_code != 200:
            self._fail_http(o, r)
        doc = r.json()
        o.cache = r.headers.get("X-Goodput-Cache", "").split(";")[0]
        o.degraded = r.headers.get("X-Goodput-Degraded", "")
        if not doc.get("choices"):
            self._end(o, "lost", "truncated", "a 200 without choices")
            return
        self._end(o, "completed", "")

    async def _embed(self, o: Outcome) -> None:
        body = {"model": "default", "input": [self._prompt()]}
        _, r = await self._json_call(o, "POST", "/v1/embeddings", key=self.keys.p0, body=body)
        if r.status_code != 200:
            self._fail_http(o, r)
        if not r.json().get("data"):
            self._end(o, "lost", "truncated", "a 200 without data")
            return
        self._end(o, "completed", "")

    async def _batch(self, o: Outcome) -> None:
        body = {"endpoint": "/v1/chat/completions",
                "body": self._chat_body(self._prompt(), stream=False, temperature=0.8)}
        _, r = await self._json_call(o, "POST", "/v1/jobs", key=self.keys.p2, body=body)
        if r.status_code not in (200, 202):
            self._fail_http(o, r)
        job_id = r.json()["id"]
        o.detail = job_id
        while True:
            await asyncio.sleep(self.mix.poll_s)
            try:
                _, r = await self._send(o, "GET", f"/v1/jobs/{job_id}", key=self.keys.p2)
            except (_NoGateway, httpx.TransportError):
                continue  # a poll is only a question: ask again (the job itself is in Redis)
            if r.status_code == 404:
                self._end(o, "lost", "vanished", f"{job_id}: {r.text[:200]}")
                return
            if r.status_code != 200:
                continue  # e.g. 503 while Redis restarts: the job's state is not known yet
            job = r.json()
            state = job.get("status")
            o.job_state, o.attempts = str(state), int(job.get("attempts") or 0)
            if state == "completed":
                if not (job.get("response") or {}).get("choices"):
                    self._end(o, "lost", "truncated", f"{job_id}: completed without a response")
                    return
                o.detail = f"{job_id} attempts={job.get('attempts')}"
                self._end(o, "completed", "")
                return
            if state in ("failed", "expired"):
                self._end(o, "failed", f"job {state}", f"{job_id}: {job.get('last_error', '')}")
                return

    # --- streams ---------------------------------------------------------------------------------------------------
    async def _stream(self, o: Outcome, body: dict[str, Any]) -> None:
        """A streamed chat: read to [DONE]; a break is resumed when the gateways can (``resume``)."""
        state = _StreamState()
        n = next(self._streams)
        drop_after = 3 if (self.resume and self.drop_every and n % self.drop_every == 0) else 0
        first: int | None = None
        resumes_left = 3
        while True:
            headers = self._p0_headers()
            if state.last_id is not None:
                headers["Last-Event-ID"] = state.last_id
            i, response = await self._send(o, "POST", "/v1/chat/completions", key=self.keys.p0, json_body=body,
                                           headers=headers, stream=True, first=first)
            o.gateway, o.http_status = i, response.status_code
            try:
                if response.status_code != 200:
                    await response.aread()
                    self._fail_http(o, response)
                o.degraded = o.degraded or response.headers.get("X-Goodput-Degraded", "")
                broke = await self._read(o, response, state, drop_after=drop_after)
            except httpx.TimeoutException:
                raise  # hung
            except (httpx.TransportError, httpx.StreamError) as err:
                broke = f"{type(err).__name__}: {err}"
            finally:
                await response.aclose()
            if state.error:
                self._end(o, "failed", f"sse {state.error_code or 'error'}", state.error)
                return
            if state.done and state.finished:
                self._end(o, "completed", "")
                return
            if broke == "dropped":  # the client's own drop: resume at once, on the other replica
                drop_after = 0
            elif not (self.resume and state.last_id is not None and resumes_left > 0):
                if broke:
                    self._end(o, "lost", "reset", broke)
                else:
                    self._end(o, "lost", "truncated", f"ended after {state.content_events} content events "
                                                      f"without [DONE] or an error")
                return
            resumes_left -= 1
            o.resumed += 1
            first = (i + 1) % len(self.gateways)
            await asyncio.sleep(0.2)

    async def _read(self, o: Outcome, response: httpx.Response, state: _StreamState, *, drop_after: int) -> str:
        """Reads events until the stream ends; returns "dropped" when the client dropped it on purpose, else ""."""
        pending: list[str] = []
        async for line in response.aiter_lines():
            if line:
                pending.append(line)
                continue
            for event_id, data in parse_sse([*pending, ""]):
                self._event(o, state, event_id, data)
            pending = []
            if state.done or state.error:
                return ""
            if drop_after and state.content_events >= drop_after and state.last_id is not None:
                return "dropped"
        for event_id, data in parse_sse(pending):
            self._event(o, state, event_id, data)
        return ""

    def _event(self, o: Outcome, state: _StreamState, event_id: str | None, data: str) -> None:
        if event_id is not None:
            state.last_id = event_id
            state.ids.append(event_id)
        if data == "[DONE]":
            state.done = True
            return
        try:
            doc = json.loads(data)
        except ValueError:
            return
        if "error" in doc:
            error = doc["error"] or {}
            state.error = str(error.get("message") if isinstance(error, dict) else error)
            state.error_code = str(error.get("code") or "") if isinstance(error, dict) else ""
            return
        for choice in doc.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                state.content_events += 1
                if o.ttft is None:
                    o.ttft = time.monotonic() - o.arrival
            if choice.get("finish_reason"):
                state.finished = True
