"""The inference worker with ``engine=triton`` against a real Triton server: ``tritonserver`` 2.51 from
nvidia-pytriton (the Triton venv of scripts/install-triton.sh) serving the dev model from
``services/inference/triton/model_repository`` (a decoupled Python model generating with transformers on the CPU),
and the worker (``python -m goodput_inference``) in front of it, each its own process on localhost.

Requests go through the worker's gRPC API as the gateway sends them: the answer streams in pieces and is the
model's own (greedy SmolLM2 knows the capital of France), token counts match the chat template's tokenization,
finish reasons, stop strings, load and model info are reported, a caller that goes away mid-stream stops the
generation inside Triton, and every request carries its tenant's cache salt, so the server's prefix cache serves a
tenant's repeated prompt and never another tenant's.

Skipped, saying why, only where the Triton venv cannot exist (no Debian system Python 3.11 with its libpython).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from goodput.common.v1 import types_pb2
from goodput.inference.v1 import inference_pb2, inference_pb2_grpc

from goodput_testing import free_port, wait_until

from goodput_inference.devmodel import SERVED_NAME, ensure_dev_model
from goodput_inference.triton_server import default_model_repository, find_install, server_command, server_env

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MAX_NUM_SEQS = 4
QUESTION = "What is the capital of France?"


@dataclass(frozen=True)
class Triton:
    grpc_url: str
    metrics_url: str
    log: Path


@dataclass(frozen=True)
class Worker:
    address: str
    model_dir: Path
    metrics_url: str  # the worker's /metrics


def _venv_impossible() -> str | None:
    python = Path("/usr/bin/python3")
    if not python.exists():
        return "no system Python at /usr/bin/python3"
    probe = subprocess.run([str(python), "-c", "import sys, sysconfig; print(sys.version_info[:2] == (3, 11)); "
                            "print(sysconfig.get_config_var('LIBDIR'))"], capture_output=True, text=True)
    lines = probe.stdout.split()
    if probe.returncode != 0 or not lines or lines[0] != "True":
        return "the system Python is not 3.11, the version of the Triton Python backend's stub"
    if not (Path(lines[1]) / "libpython3.11.so.1.0").exists():
        return "the system Python has no libpython3.11.so.1.0 (Debian: apt-get install libpython3.11)"
    return None


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


def _tail(path: Path, lines: int = 30) -> str:
    return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_dev_model()


@pytest.fixture(scope="module")
def triton(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[Triton]:
    impossible = _venv_impossible()
    if impossible:
        pytest.skip(f"a Triton server cannot run here: {impossible}")
    install = find_install()
    problem = install.missing()
    assert problem is None, problem  # it can exist on this machine: not having it is a failed install
    grpc_port, http_port, metrics_port = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("triton") / "tritonserver.log"
    cmd = server_command(install, model_repository=default_model_repository(), grpc_port=grpc_port,
                         http_port=http_port, metrics_port=metrics_port, log_verbose=0)
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, env=server_env(install, model_dir=model_dir), stdout=out,  # noqa: S603
                                stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def ready() -> bool:
            assert proc.poll() is None, f"tritonserver exited ({proc.returncode}):\n{_tail(log)}"
            try:
                return httpx.get(f"http://127.0.0.1:{http_port}/v2/models/{SERVED_NAME}/ready", timeout=2)\
                    .status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(ready, timeout=180, interval=0.25, message=f"Triton never served the dev model:\n{_tail(log)}")
        yield Triton(grpc_url=f"127.0.0.1:{grpc_port}", metrics_url=f"http://127.0.0.1:{metrics_port}/metrics",
                     log=log)
    finally:
        _stop(proc)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory, triton: Triton, model_dir: Path) -> Iterator[Worker]:
    port, http_port = free_port(), free_port()
    env = {**os.environ, "GOODPUT_INFERENCE_ENGINE": "triton", "GOODPUT_INFERENCE_TRITON_URL": triton.grpc_url,
           "GOODPUT_INFERENCE_TRITON_METRICS_URL": triton.metrics_url,
           "GOODPUT_INFERENCE_TRITON_METRICS_INTERVAL_S": "0.2",
           "GOODPUT_INFERENCE_GRPC_PORT": str(port), "GOODPUT_INFERENCE_HTTP_PORT": str(http_port),
           "GOODPUT_INFERENCE_MAX_NUM_SEQS": str(MAX_NUM_SEQS), "GOODPUT_INFERENCE_INSECURE_INTERNAL": "true",
           "GOODPUT_INFERENCE_TRITON_START_TIMEOUT_S": "60"}
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "goodput_inference"], env=env, stdout=out,  # noqa: S603
                                stderr=subprocess.STDOUT, start_new_session=True)
    address = f"127.0.0.1:{port}"
    try:
        def ready() -> bool:
            assert proc.poll() is None, f"the worker exited ({proc.returncode}):\n{_tail(log)}"
            try:
                return bool(_load(address).ready)
            except grpc.RpcError:
                return False

        wait_until(ready, timeout=120, interval=0.25, message=f"the worker never became ready:\n{_tail(log)}")
        yield Worker(address=address, model_dir=model_dir, metrics_url=f"http://127.0.0.1:{http_port}/metrics")
    finally:
        _stop(proc)


def _stub(address: str) -> tuple[grpc.Channel, inference_pb2_grpc.InferenceStub]:
    channel = grpc.insecure_channel(address)
    return channel, inference_pb2_grpc.InferenceStub(channel)


def _load(address: str) -> inference_pb2.WorkerLoad:
    channel, stub = _stub(address)
    with channel:
        return stub.GetLoad(inference_pb2.GetLoadRequest(), timeout=5)


def _chat(content: str, **sampling: object) -> inference_pb2.GenerateRequest:
    return inference_pb2.GenerateRequest(
        request_id=f"triton-test-{time.monotonic_ns()}", model=SERVED_NAME,
        messages=[types_pb2.ChatMessage(role="user", content=content)],
        sampling=types_pb2.SamplingParams(**sampling))  # type: ignore[arg-type]


def _generate(address: str, request: inference_pb2.GenerateRequest) -> list[inference_pb2.GenerateChunk]:
    channel, stub = _stub(address)
    with channel:
        return list(stub.Generate(request, timeout=120))


def test_a_chat_request_streams_the_models_answer_with_its_token_counts(worker: Worker) -> None:
    from transformers import AutoTokenizer

    chunks = _generate(worker.address, _chat(QUESTION, max_tokens=24, temperature=0.0))
    kinds = [c.WhichOneof("kind") for c in chunks]
    assert kinds[0] == "started" and kinds[-1] == "finished" and set(kinds[1:-1]) == {"delta"}, kinds
    deltas = [c.delta for c in chunks[1:-1]]
    text = "".join(d.text for d in deltas)
    assert len(deltas) > 3, f"the answer streams in pieces, not in one: {deltas}"
    assert "Paris" in text, text  # the model's own answer (greedy, float32)
    # The prompt is rendered with the model's chat template and counted the way the model counts it.
    tokenizer = AutoTokenizer.from_pretrained(worker.model_dir)
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                             tokenize=True)
    expected_prompt = len(rendered if isinstance(rendered, list) else rendered["input_ids"])
    finished = chunks[-1].finished
    assert chunks[0].started.prompt_tokens == expected_prompt == finished.usage.prompt_tokens
    assert finished.usage.completion_tokens == deltas[-1].completion_tokens
    assert 0 < finished.usage.completion_tokens <= 24
    assert [d.completion_tokens for d in deltas] == sorted(d.completion_tokens for d in deltas)
    assert finished.finish_reason == types_pb2.FINISH_REASON_STOP  # the model ended its answer itself
    assert finished.usage.total_tokens == expected_prompt + finished.usage.completion_tokens
    assert finished.timing.prefill_s > 0 and finished.timing.decode_s > 0


def test_max_tokens_and_stop_strings(worker: Worker) -> None:
    short = _generate(worker.address, _chat(QUESTION, max_tokens=3, temperature=0.0))[-1].finished
    assert short.finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert short.usage.completion_tokens == 3
    chunks = _generate(worker.address, _chat(QUESTION, max_tokens=24, temperature=0.0, stop=[" Paris"]))
    text = "".join(c.delta.text for c in chunks if c.WhichOneof("kind") == "delta")
    assert "Paris" not in text and text, text  # cut before the stop string, which is not sent
    assert chunks[-1].finished.finish_reason == types_pb2.FINISH_REASON_STOP


def test_vllm_extensions_reach_the_model_or_are_refused_by_name(worker: Worker) -> None:
    # the model would end its answer by itself within 24 tokens: ignore_eos / min_tokens keep it going
    for sampling in ({"ignore_eos": True}, {"min_tokens": 24}):
        finished = _generate(worker.address, _chat(QUESTION, max_tokens=24, temperature=0.0, **sampling))[-1]
        assert finished.finished.usage.completion_tokens == 24, sampling
    for sampling, param in (({"min_p": 0.1}, "min_p"), ({"truncate_prompt_tokens": 8}, "truncate_prompt_tokens")):
        with pytest.raises(grpc.RpcError) as err:
            _generate(worker.address, _chat(QUESTION, max_tokens=4, temperature=0.0, **sampling))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and param in err.value.details()


def test_prefix_cache_entries_of_one_tenant_never_serve_another(worker: Worker) -> None:
    # The evidence is the server's own prefix-cache counters (the dev model's, read from Triton's metrics by the
    # worker, which exports them as goodput_worker_prefix_cache_*): prompt tokens looked up and found.
    prompt = f"Explain prefix caching in one sentence. ({uuid.uuid4().hex})"

    def counters() -> tuple[float, float]:
        text = httpx.get(worker.metrics_url, timeout=5).text
        found = [re.search(rf"^goodput_worker_prefix_cache_{name}_total (\S+)$", text, re.M)
                 for name in ("queries", "hits")]
        assert all(found), "the worker exports no prefix-cache counters"
        return float(found[0].group(1)), float(found[1].group(1))  # type: ignore[union-attr]

    def sent(tenant: str) -> tuple[str, int, int]:
        """The answer to ``prompt`` as ``tenant``, its prompt tokens and those the server found cached."""
        queries, hits = counters()
        request = _chat(prompt, max_tokens=8, temperature=0.0)
        request.tenant = tenant
        chunks = _generate(worker.address, request)
        prompt_tokens = chunks[-1].finished.usage.prompt_tokens
        after = wait_until(lambda: (c := counters())[0] >= queries + prompt_tokens and c, timeout=10,
                           message="the server did not count the request's prefix-cache lookup")
        text = "".join(c.delta.text for c in chunks if c.WhichOneof("kind") == "delta")
        return text, prompt_tokens, int(after[1] - hits)

    first, prompt_tokens, found = sent("alpha")
    assert found == 0
    again, _, found = sent("alpha")  # its own repeat: all but the last token served from the cache
    assert found == prompt_tokens - 1 and again == first
    other, _, found = sent("beta")  # the same prompt from another tenant: another salt, nothing found
    assert found == 0 and other == first


def test_model_info_and_load(worker: Worker) -> None:
    channel, stub = _stub(worker.address)
    with channel:
        info = stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=5)
    assert info.served_model_name == SERVED_NAME
    assert info.engine.startswith("triton 2.51") and "python" in info.engine, info.engine
    assert info.max_model_len == 2048 and info.max_prompt_tokens == 2047
    assert info.model.endswith("/" + SERVED_NAME) and info.model_version
    # Idle once the server's metrics (read every 0.2 s) have caught up with the earlier tests' requests.
    load = wait_until(lambda: (lambda x: x if x.running == 0 and x.waiting == 0 else None)(_load(worker.address)),
                      timeout=5, message="the server still reports requests")
    assert load.ready and load.max_num_seqs == MAX_NUM_SEQS
    assert load.gpu_utilization == -1.0  # a CPU server: Triton reports no GPU


def test_a_caller_that_goes_away_stops_the_generation_in_triton(worker: Worker, triton: Triton) -> None:
    before = _load(worker.address)
    channel, stub = _stub(worker.address)
    with channel:
        call = stub.Generate(_chat("Write a very long story about a dragon and a knight.", max_tokens=1000,
                                   temperature=0.0), timeout=120)
        deltas = 0
        for chunk in call:
            deltas += chunk.WhichOneof("kind") == "delta"
            if deltas == 3:
                break
        # While it streams, the server reports it running (the model's gauge, read from Triton's metrics).
        wait_until(lambda: _load(worker.address).running == 1, timeout=10, message="the request is not running")
        call.cancel()
        cancelled_at = time.monotonic()
    load = wait_until(lambda: (lambda x: x if x.aborted_total == before.aborted_total + 1 else None)(
        _load(worker.address)), timeout=10, message="the worker did not count the request as aborted")
    assert load.finished_total == before.finished_total
    # Triton cancelled the request and the model stopped generating: its slot is free long before 1000 tokens.
    wait_until(lambda: _load(worker.address).running == 0, timeout=10, message="the model is still generating")
    wait_until(lambda: "request cancelled after" in triton.log.read_text(errors="replace"), timeout=10,
               message="the model never saw the cancellation")
    assert time.monotonic() - cancelled_at < 10
    # And the server serves the next request at once.
    after = _generate(worker.address, _chat(QUESTION, max_tokens=4, temperature=0.0))
    assert after[-1].finished.usage.completion_tokens == 4
