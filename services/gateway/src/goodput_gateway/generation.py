"""A generation as the service hands it to its APIs: the :class:`Call` an API makes (credentials, a parser for its
wire format, the caller's options), the :class:`Opened` event that comes first, and the :class:`Generation` that
streams the rest. A generation records its own outcome when it is closed (SLO and goodput, the degradation ladder,
its feedback record, a trace sample), so no API can skip the accounting: an API that wants the breakdown earlier
(for a ``Server-Timing`` header) calls :meth:`Generation.timing`, and closing then records nothing twice.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from types import TracebackType

from goodput_core.errors import Unavailable
from goodput_core.sampling import TokenLogprob

from goodput_gateway.auth import Principal
from goodput_gateway.caching import CacheStatus
from goodput_gateway.events import StreamEnd, TextDelta
from goodput_gateway.profile import ClassProfile
from goodput_gateway.rag import Source
from goodput_gateway.requests import GenerationRequest
from goodput_gateway.timing import Timeline

__all__ = ["Call", "Generation", "Opened"]


@dataclass(frozen=True)
class Call:
    """One generation call as an API hands it over."""

    parse: Callable[[], Awaitable[GenerationRequest]]  # the wire format to a request; runs after authentication
    authorization: str | None = None  # "Bearer <key>"
    principal: Principal | None = None  # already authenticated instead (a parked job runs as its tenant)
    request_id: str = ""
    arrived: float = 0.0  # time.monotonic() at arrival; 0 = now
    timeout_s: float | None = None  # the caller's deadline, if shorter than request_timeout_s
    cache_control: str = ""  # "no-cache" (skip the lookup), "no-store" (skip lookup and store)


@dataclass(frozen=True)
class Opened:
    """The first event of a generation: what the caller needs before the first token."""

    request_id: str
    tenant: str
    priority: int  # resolved against the API key
    model: str
    worker_id: str  # "cache" for a cached answer
    request: GenerationRequest  # as the caller sent it (stream, include_usage, kind)
    sources: list[Source]  # RAG: the chunks put in the prompt
    cache: CacheStatus | None  # what the response cache did; None without a cache
    rate_limits: dict[str, str] = field(default_factory=dict)  # OpenAI's x-ratelimit-* values at admission
    timeline: Timeline | None = None  # where the time went (goodput_gateway.timing); finished by the API layer
    profile: ClassProfile | None = None  # the class's budgets and SLO (goodput_gateway.profile)


class Generation:
    """An opened generation: ``opened``, then its events. Always closed (``async with`` or :meth:`aclose`):
    closing stops the worker call, releases the lease and, for an answer that reached its end, records it."""

    def __init__(self, opened: Opened, events: AsyncGenerator[Opened | TextDelta | StreamEnd, None], *,
                 on_timing: Callable[[Opened, Timeline, StreamEnd | None], None] | None = None) -> None:
        self.opened = opened
        self._events = events
        self._on_timing = on_timing
        self.end: StreamEnd | None = None  # the final event, once it has passed
        self.logprobs: list[TokenLogprob] = []  # filled by collect(): the first answer's tokens
        self.answers: dict[int, tuple[list[str], list[TokenLogprob]]] = {}  # collect(): every answer's, by index
        self.prompt_logprobs: list[TokenLogprob] = []  # collect(), with echo and logprobs: the prompt's tokens

    async def __aiter__(self) -> AsyncGenerator[TextDelta | StreamEnd, None]:
        async for event in self._events:
            assert not isinstance(event, Opened)
            if isinstance(event, StreamEnd):
                self.end = event
            yield event

    async def collect(self) -> tuple[str, StreamEnd]:
        """The whole answer (for non-streaming callers): its text and its final event; its tokens' log
        probabilities (when asked for) in :attr:`logprobs`."""
        parts: list[str] = []
        end: StreamEnd | None = None
        async for event in self:
            if isinstance(event, TextDelta):
                self.prompt_logprobs.extend(event.prompt_logprobs)
                texts, logprobs = self.answers.setdefault(event.index, ([], []))
                texts.append(event.text)
                logprobs.extend(event.logprobs)
                if event.index == 0:
                    parts.append(event.text)
                    self.logprobs.extend(event.logprobs)
            else:
                end = event
        if end is None:
            raise Unavailable("the stream ended without a finish")
        return "".join(parts), end

    async def aclose(self) -> None:
        try:
            await self._events.aclose()
        finally:
            if self.end is not None:  # an answer: accounted whichever API served it (once, see timing())
                self.timing()

    def timing(self) -> Timeline | None:
        """The request's breakdown, its post-processing ended now; recorded (metrics, spans) on the first call."""
        t = self.opened.timeline
        if t is None or self._on_timing is None:
            return t
        if not any(stage == "post_processing" for stage, _ in t.marks):
            t.mark("post_processing")
            self._on_timing(self.opened, t, self.end)
        return t

    async def __aenter__(self) -> Generation:
        return self

    async def __aexit__(self, kind: type[BaseException] | None, err: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()
