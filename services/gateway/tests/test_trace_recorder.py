"""The workload trace (TRACE__PATH): a sample of finished answers, one JSON line each, with token counts and
latencies but no prompt text and no tenant name, bounded on disk. The recorder is tested alone (sampling, the
bound); the hook on a gateway whose worker stream is a stand-in (the pipeline's ``open``), through the REST API."""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client import CollectorRegistry

from goodput_contracts.trace import TraceRecord, read_trace

from goodput_gateway.__main__ import build
from goodput_gateway.catalogue import ModelEntry
from goodput_gateway.config import GatewaySettings
from goodput_gateway.events import StreamEnd, TextDelta
from goodput_gateway.stream import StreamStart
from goodput_gateway.timing import Timeline
from goodput_gateway.trace_recorder import TraceRecorder

SECRET = "the launch codes are 0000"
KEYS = json.dumps({"keys": [{"key": "k1", "tenant": "acme-corp", "max_priority": "P0"}]})


def _record(i: int = 0) -> TraceRecord:
    return TraceRecord(arrival_s=1000.0 + i, priority="P1", prompt_tokens=100, output_tokens=20, model="m")


def test_a_fraction_of_answers_is_sampled(tmp_path: Path) -> None:
    recorder = TraceRecorder(tmp_path / "t.jsonl", sample=0.25, max_bytes=1 << 20, rng=random.Random(7))
    kept = sum(recorder.offer(lambda _t, i=i: _record(i), tenant="a") for i in range(2000))  # type: ignore[misc]
    recorder.close()
    assert 400 < kept < 600  # 25% of 2000, give or take the draw
    assert len(read_trace(tmp_path / "t.jsonl")) == kept
    assert TraceRecorder.from_settings(GatewaySettings(trace={"path": ""})) is None
    assert TraceRecorder.from_settings(GatewaySettings(trace={"path": str(tmp_path / "x"), "sample": 0})) is None


def test_the_file_is_bounded_one_previous_file_kept(tmp_path: Path) -> None:
    registry = CollectorRegistry()
    path = tmp_path / "t.jsonl"
    recorder = TraceRecorder(path, sample=1.0, max_bytes=2048, registry=registry)
    line = len(_record().to_json_line()) + 1
    for i in range(100):
        recorder.offer(lambda _t, i=i: _record(i), tenant="a")  # type: ignore[misc]
    recorder.close()
    assert path.stat().st_size <= 2048 and (tmp_path / "t.jsonl.1").stat().st_size <= 2048
    assert not (tmp_path / "t.jsonl.2").exists()
    kept, previous = read_trace(path), read_trace(tmp_path / "t.jsonl.1")
    assert kept[-1].arrival_s == 1099.0  # the newest are in the current file, the ones just before in .1
    assert previous[-1].arrival_s == kept[0].arrival_s - 1 and len(previous) == 2048 // line
    value = registry.get_sample_value
    assert value("goodput_gateway_trace_records_total", {"result": "written"}) == 100
    assert value("goodput_gateway_trace_records_total", {"result": "rotated"}) >= 2


class _FakeStream:
    """What Pipeline.open returns, without a scheduler or worker: five tokens, the worker's usage at the end."""

    def __init__(self, timeline: Timeline | None) -> None:
        self.start = StreamStart(request_id="r", model="m", worker_id="w0", prompt_tokens=0)
        self._timeline = timeline

    async def events(self) -> AsyncIterator[TextDelta | StreamEnd]:
        for i in range(5):
            if self._timeline is not None:
                self._timeline.first_token()
            yield TextDelta(f"t{i} ")
        if self._timeline is not None:
            self._timeline.last_token()
            self._timeline.completion_tokens = 5
        yield StreamEnd(finish_reason="length", prompt_tokens=42, completion_tokens=5, cached_tokens=16)

    def usage(self) -> tuple[int, int, int]:
        return 42, 5, 16

    async def aclose(self) -> None:
        pass


@pytest.mark.parametrize("stream", [False, True])
async def test_each_answer_is_recorded_without_its_text_or_tenant(tmp_path: Path, stream: bool) -> None:
    path = tmp_path / "trace.jsonl"
    settings = GatewaySettings(grpc_port=0, http_port=0, api_keys=KEYS, scheduler_addr="127.0.0.1:1",
                               trace={"path": str(path), "sample": 1.0})
    runner = build(settings, CollectorRegistry(), None)
    service = runner.http_app.state.service
    service.pipeline.catalogue.pin([ModelEntry(id="m", max_model_len=2048, model_version="v", workers=1)])

    async def fake_open(*_a: Any, timeline: Timeline | None = None, **_k: Any) -> _FakeStream:
        return _FakeStream(timeline)

    service.pipeline.open = fake_open
    body = {"model": "m", "messages": [{"role": "user", "content": SECRET}], "max_tokens": 5, "stream": stream}
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=runner.http_app),
                                 base_url="http://gw") as client:
        for _ in range(2):
            resp = await client.post("/v1/chat/completions", json=body,
                                     headers={"Authorization": "Bearer k1", "x-goodput-priority": "P1"})
            assert resp.status_code == 200, resp.text
    service.trace.close()
    text = path.read_text(encoding="utf-8")
    assert SECRET not in text and "launch" not in text and "acme" not in text
    records = read_trace(path)
    assert len(records) == 2
    r = records[0]
    assert (r.priority, r.model, r.prompt_tokens, r.cached_tokens, r.output_tokens, r.max_tokens, r.outcome) == \
        ("P1", "m", 42, 16, 5, 5, "length")
    assert r.ttft_s is not None and r.e2e_s is not None and r.ttft_s <= r.e2e_s
    assert r.tpot_s is not None and r.sample == 1.0
    assert r.tenant and r.tenant == records[1].tenant  # one pseudonym per tenant in a process
