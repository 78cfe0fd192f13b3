"""What the gateway's tests share besides the gateway itself (:mod:`conftest`): API keys, request bodies, the REST
call, the check that an error is in OpenAI's shape, and a clock a test moves instead of sleeping."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx
from prometheus_client import CollectorRegistry

from goodput_gateway.service import GatewayService

KEYS = json.dumps({"keys": [{"key": "k-p0", "tenant": "a", "max_priority": "P0"},
                            {"key": "k-p2", "tenant": "b", "max_priority": "P2"}]})
AUTH = {"Authorization": "Bearer k-p0"}


@dataclass
class Gateway:
    client: httpx.AsyncClient
    service: GatewayService
    registry: CollectorRegistry


GatewayFactory = Callable[..., Awaitable[Gateway]]  # the conftest's `gateway` fixture: (models=, workers=, **settings)


def chat(**overrides: object) -> dict[str, object]:
    body: dict[str, object] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    body.update(overrides)
    return body


async def post(client: httpx.AsyncClient, body: object, headers: dict[str, str] | None = None,
               raw: bytes | None = None) -> httpx.Response:
    content = raw if raw is not None else json.dumps(body).encode()
    return await client.post("/v1/chat/completions", content=content,
                             headers={"Content-Type": "application/json", **(AUTH if headers is None else headers)})


def assert_openai_error(resp: httpx.Response, status: int, param: str | None = None) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) >= {"message", "type", "param", "code"} and error["message"]
    if param is not None:
        assert error["param"] == param
    return error


class FakeClock:
    """A clock the test moves (:meth:`advance`) instead of sleeping: given as the ``clock`` of the code under test.
    ``reads`` counts the calls, so a test can wait for that code to have looked at the time again.

    >>> clock = FakeClock(100.0)
    >>> clock.advance(2.5); clock(), clock.reads
    (102.5, 1)
    """

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.reads = 0

    def __call__(self) -> float:
        self.reads += 1
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds
