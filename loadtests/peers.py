"""The field's benchmark clients against Goodput, unchanged: kubernetes-sigs inference-perf, NVIDIA aiperf and
vllm-project guidellm, each by its own CLI from its own venv (``scripts/install-peers.sh``; ``make peers``).

**Run mode** (default), against a running gateway: each tool streams ``--requests`` (20) at ``--concurrency`` 4 to
chat completions and to completions, short synthetic prompts, a fixed output length (``ignore_eos``: guidellm sends
it by itself, inference-perf by default, aiperf is told). Read back from each tool's own files: requests served and
failed, output tokens per request (min/max of the server's usage as the tool recorded it: must be the length asked
for), TTFT and ITL p50 as the tool measured them; exit status 1 on any failure, error or wrong length.
inference-perf's chat requests always ask for 30 tokens (its client's default), hence 30 for every run; its chat
prompts are a ShareGPT file written here (its chat data set), its completion prompts its ``random`` ones.

**Capture mode** (``--capture DIR``): the same commands, 4 requests at concurrency 2, against a recording server on
loopback that streams answers of exactly the asked length; ``DIR/<tool>.json`` holds tool, version, Python, its chat
command and one request per shape it sent (method, path, set of body keys; headers lower-cased without host and
content-length, the key as ``<api-key>``) with the output length it asked for: what the gateway must accept.

The tokenizer is the dev model's folder (``make install`` converts it under ``$GOODPUT_DATA_DIR``, default
``~/.cache/goodput``) or ``--tokenizer DIR``: the hub is switched off for the tools.

    python -m loadtests.peers                                  # against `goodput up`, a few minutes
    python -m loadtests.peers --capture tests/fixtures/peers   # the fixtures (~1 min)
    python -m loadtests.peers --render loadtests/reports/peers.json   # the report again (templates/peers.md)

Writes ``<out>.json`` and ``<out>.md`` (default ``loadtests/out/peers/peers``), each run's own files in ``runs/``
beside them (capture mode: ``capture/``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from loadtests import bench
from loadtests.common import machine_info, percentile

ROOT = Path(__file__).resolve().parents[1]
TOOLS = ("inference-perf", "aiperf", "guidellm")
ENDPOINTS = ("chat", "completions")
INFERENCE_PERF_CHAT_TOKENS = 30  # what inference-perf's chat requests ask for, whatever it is told
CAPTURE_KEY = "sk-goodput-capture"
WORDS = "the of and to in is it that for on with as was at by be this from or have an they which one you".split()
DROP_HEADERS = {"host", "content-length"}  # they change with the port and the prompt
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def tokenizer_dir() -> Path | None:
    """The dev model's converted folder (tokenizer.json, config.json), where goodput_inference.devmodel puts it."""
    from goodput_inference.devmodel import SERVED_NAME, default_data_dir

    found = [p for p in (default_data_dir() / "models").glob(f"{SERVED_NAME}-*") if not p.name.endswith(".tmp")
             and (p / "tokenizer.json").is_file() and (p / "config.json").is_file()]
    return max(found, key=lambda p: p.stat().st_mtime, default=None)


def tool_env(tool: str) -> dict[str, str]:
    """No hub (a dead loopback endpoint and the offline flags), no telemetry, no proxy for loopback. aiperf runs
    without the offline flags: offline, it looks a tokenizer folder up as a hub repository and fails."""
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    env = {k: v for k, v in os.environ.items() if k not in offline} | {
        "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_DISABLE_TELEMETRY": "1", "DO_NOT_TRACK": "1",
        "NO_PROXY": ",".join(filter(None, [os.environ.get("NO_PROXY"), "127.0.0.1,localhost"]))}
    return env if tool == "aiperf" else env | offline


def command(tool: str, endpoint: str, spec: argparse.Namespace, work: Path) -> tuple[list[str], int]:
    """The tool's argv for one run (its files under ``work``) and the output length it asks for."""
    exe, n, c = str(spec.tools_dir / f"{tool}-venv" / "bin" / tool), spec.requests, spec.concurrency
    isl, osl, tok, chat = spec.prompt_tokens, spec.output_tokens, str(spec.tokenizer), endpoint == "chat"
    if tool == "inference-perf":
        argv = [exe, "--server.type", "vllm", "--server.base_url", spec.base_url, "--server.model_name", spec.model,
                "--server.api_key", spec.api_key, "--server.ignore_eos", "true", "--api.type",
                "chat" if chat else "completion", "--api.streaming", "true", "--load.type", "concurrent",
                "--load.stages", json.dumps([{"num_requests": n, "concurrency_level": c}]),
                "--tokenizer.pretrained_model_name_or_path", tok, "--storage.local_storage.path", str(work)]
        if chat:  # about isl tokens of common words (one token each), new prompts each run (no prefix-cache hits)
            prompts = [f"Request {i}: " + " ".join(random.choices(WORDS, k=isl - 4)) for i in range(n + 1)]
            (work / "sharegpt.json").write_text(json.dumps([{"id": str(i), "conversations": [
                {"from": "human", "value": p}, {"from": "gpt", "value": "OK."}]} for i, p in enumerate(prompts)]))
            return argv + ["--data.type", "shareGPT", "--data.path", str(work / "sharegpt.json")], \
                INFERENCE_PERF_CHAT_TOKENS
        argv += ["--data.type", "random"]
        for side, value in (("input", isl), ("output", osl)):
            for key, v in (("min", value), ("max", value), ("mean", value), ("std_dev", 0)):
                argv += [f"--data.{side}_distribution.{key}", str(v)]
        return argv, osl
    if tool == "aiperf":
        return [exe, "profile", "--model", spec.model, "--url", spec.base_url, "--endpoint-type", endpoint,
                "--streaming", "--api-key", spec.api_key, "--tokenizer", tok, "--isl", str(isl), "--isl-stddev", "0",
                "--osl", str(osl), "--osl-stddev", "0", "--extra-inputs", "ignore_eos:true", "--concurrency", str(c),
                "--request-count", str(n), "--output-artifact-dir", str(work), "--ui", "none",
                "--no-server-metrics", "--no-gpu-telemetry"], osl
    route = "/v1/chat/completions" if chat else "/v1/completions"
    return [exe, "run", "--backend",
            f"kind=openai_http,target={spec.base_url},model={spec.model},api_key={spec.api_key},request_format={route}",
            "--profile", f"kind=concurrent,streams={c}", "--constraint", f"kind=max_requests,count={n}",
            "--data", f"kind=synthetic_text,prompt_tokens={isl},output_tokens={osl}",
            "--tokenizer", f"kind=huggingface_auto,model={tok}",
            "--output", f"kind=json,path={work / 'benchmarks.json'}", "--disable-console-interactive"], osl


def sanitize(argv: list[str], replace: dict[str, str]) -> list[str]:
    """argv as a report or a fixture shows it: the command's bare name, no paths, URL or key.

    >>> sanitize(["/v/bin/aiperf", "--api-key", "k1", "--url", "http://h:1"], {"k1": "<key>", "http://h:1": "<url>"})
    ['aiperf', '--api-key', '<key>', '--url', '<url>']
    """
    out = [Path(argv[0]).name, *argv[1:]]
    for old, new in replace.items():
        out = [a.replace(old, new) for a in out] if old else out
    return out


def parse(tool: str, work: Path) -> dict[str, Any]:
    """ok, errors, output tokens min/max, TTFT and ITL p50 (ms) and the first error, from the tool's own files."""
    if tool == "inference-perf":
        summary = json.loads((work / "summary_lifecycle_metrics.json").read_text(encoding="utf-8"))
        good, bad = summary.get("successes") or {}, summary.get("failures") or {}
        latency, out = good.get("latency") or {}, good.get("output_tokens") or {}
        errors = [m.get("message") for label in (bad.get("by_label") or {}).values() for m in label.get("messages", [])]
        ttft, itl = ((latency.get(k) or {}).get("median") for k in ("time_to_first_token", "inter_token_latency"))
        return {"ok": good.get("count", 0), "errors": bad.get("count", 0), "out_min": out.get("min"),
                "out_max": out.get("max"), "ttft_p50_ms": None if ttft is None else ttft * 1000,
                "itl_p50_ms": None if itl is None else itl * 1000, "first_error": errors[0] if errors else None}
    if tool == "aiperf":
        lines = (work / "profile_export.jsonl").read_text(encoding="utf-8").splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
        good = [r.get("metrics") or {} for r in records if not r.get("error")]
        failed = [r["error"] for r in records if r.get("error")]

        def values(name: str) -> list[float]:
            return [float(m[name]["value"]) for m in good if isinstance((m.get(name) or {}).get("value"), int | float)]

        out = values("usage_completion_tokens") or values("output_sequence_length")
        return {"ok": len(good), "errors": len(failed), "out_min": min(out, default=None),
                "out_max": max(out, default=None), "ttft_p50_ms": percentile(values("time_to_first_token"), 50),
                "itl_p50_ms": percentile(values("inter_token_latency"), 50),
                "first_error": str(failed[0].get("message") or failed[0]) if failed else None}
    bench = json.loads((work / "benchmarks.json").read_text(encoding="utf-8"))["benchmarks"][0]
    metrics, totals = bench["metrics"], bench["metrics"]["request_totals"]

    def successful(name: str) -> dict[str, Any]:
        stats = (metrics.get(name) or {}).get("successful") or {}
        return stats if stats.get("count") else {}

    out = successful("output_token_count")
    errored = [(r.get("info") or {}).get("error") for r in (bench.get("requests") or {}).get("errored") or []]
    return {"ok": totals["successful"], "errors": totals["errored"] + totals["incomplete"], "out_min": out.get("min"),
            "out_max": out.get("max"), "ttft_p50_ms": successful("time_to_first_token_ms").get("median"),
            "itl_p50_ms": successful("inter_token_latency_ms").get("median"),
            "first_error": str(errored[0]) if errored else None}


def run_tool(tool: str, endpoint: str, spec: argparse.Namespace) -> dict[str, Any]:
    """One run of one tool on one endpoint: its command (sanitized), exit status, parsed results and ``passed``."""
    root = spec.out.resolve().parent  # absolute: each tool runs in its own folder
    work = root / ("capture" if spec.capture else "runs") / f"{tool}-{endpoint}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    argv, asked = command(tool, endpoint, spec, work)
    started = time.monotonic()
    with open(work / "tool.log", "wb") as log:  # a process group of its own: aiperf starts services of its own
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=work,
                                env=tool_env(tool), start_new_session=True)
        try:
            rc = proc.wait(timeout=spec.timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            rc = proc.wait()
    log_lines = [line for line in (work / "tool.log").read_text(encoding="utf-8", errors="replace").splitlines()
                 if line.strip()]
    run: dict[str, Any] = {"tool": tool, "endpoint": endpoint, "asked": asked, "rc": rc,
                           "seconds": round(time.monotonic() - started, 1),
                           "command": sanitize(argv, {str(work): "<out>", str(spec.tokenizer): "<tokenizer>",
                                                      spec.api_key: "<api-key>", spec.base_url: "<base-url>"})}
    try:
        run.update(parse(tool, work))
        run.update({k: int(run[k]) for k in ("out_min", "out_max") if run[k] is not None})  # counts, not floats
    except (OSError, ValueError, KeyError, IndexError, TypeError) as err:
        run["problem"] = (f"exit status {rc}, no results ({type(err).__name__}): {''.join(log_lines[-1:]).strip()} "
                          f"(log: {work.relative_to(root)}/tool.log)")
    if "problem" not in run and (run["errors"] or run["ok"] != spec.requests):
        run["problem"] = f"{run['ok']} of {spec.requests} served, {run['errors']} errors: {run['first_error']}"
    elif "problem" not in run and not run["out_min"] == run["out_max"] == asked:
        run["problem"] = f"output tokens {run['out_min']}-{run['out_max']}, asked {asked}"
    run["passed"] = "problem" not in run
    if not run["passed"]:
        print(f"  {tool} {endpoint}: {run['problem']}\n    " + "\n    ".join(log_lines[-8:]), file=sys.stderr)
    return run


def tool_info(spec: argparse.Namespace, tool: str) -> dict[str, str]:
    code = "import importlib.metadata as m, platform, sys; print(m.version(sys.argv[1]), platform.python_version())"
    out = subprocess.run([str(spec.tools_dir / f"{tool}-venv" / "bin" / "python"), "-c", code, tool],
                         capture_output=True, text=True, check=True).stdout.split()
    return {"version": out[0], "python": out[1]}


class Recorder(ThreadingHTTPServer):
    """Records every request on loopback and answers as an OpenAI-compatible server: SSE, one chunk per token, exactly
    ``max_completion_tokens`` (or ``max_tokens``) of them, a finish chunk, a usage chunk and ``[DONE]``."""

    daemon_threads = True

    def __init__(self, model: str) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.model = model
        self.seen: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def handle_error(self, request: Any, client_address: Any) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # not a client that hung up on a kept-alive socket
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: Recorder

    def setup(self) -> None:
        super().setup()
        self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # else each chunk waits ~40 ms

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base class names it)
        pass

    def _record(self, body: Any) -> None:
        with self.server.lock:
            self.server.seen.append({"method": self.command, "path": self.path, "headers": dict(self.headers),
                                     "body": body})

    def _json(self, status: int, doc: dict[str, Any]) -> None:
        data = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _event(self, data: bytes) -> None:  # one SSE event as one HTTP chunk
        data = b"data: " + data + b"\n\n"
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self._record(None)
        if self.path.split("?")[0] == "/v1/models":
            self._json(200, {"object": "list", "data": [{"id": self.server.model, "object": "model", "created": 0,
                                                         "owned_by": "goodput"}]})
        else:  # /health and the like
            self._json(200, {"status": "ok"})

    def do_POST(self) -> None:  # noqa: N802
        raw = self.rfile.read(int(self.headers.get("content-length") or 0))
        try:
            body = json.loads(raw)
        except ValueError:
            body = raw.decode(errors="replace")
        self._record(body)
        chat, path = self.path.startswith("/v1/chat/completions"), self.path.split("?")[0]
        if not isinstance(body, dict) or path not in ("/v1/chat/completions", "/v1/completions") \
                or not body.get("stream"):  # every run streams
            self._json(400, {"error": {"message": f"POST {path}: streamed chat or completions only"}})
            return
        n = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        prompt = len(json.dumps(body.get("messages") or body.get("prompt") or "").split())
        usage = {"prompt_tokens": prompt, "completion_tokens": n, "total_tokens": prompt + n}
        head = {"id": "cmpl-capture", "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": body.get("model") or self.server.model}
        self.send_response(200)
        self.send_header("content-type", "text/event-stream")
        self.send_header("transfer-encoding", "chunked")
        self.end_headers()
        for i in range(n + 1):  # n tokens, then the finish chunk
            if chat:
                piece: dict[str, Any] = {"delta": {"role": "assistant", "content": " the"} if i == 0 else
                                         {"content": " the"} if i < n else {}}
            else:
                piece = {"text": " the" if i < n else ""}
            choice = {"index": 0, **piece, "finish_reason": None if i < n else "length"}
            self._event(json.dumps({**head, "choices": [choice]}).encode())
            time.sleep(0.001)
        self._event(json.dumps({**head, "choices": [], "usage": usage}).encode())
        self._event(b"[DONE]")
        self.wfile.write(b"0\r\n\r\n")  # the last chunk


def shapes(seen: list[dict[str, Any]], api_key: str) -> list[dict[str, Any]]:
    """One recorded request per (method, path, set of body keys), in the order first seen, key and ids masked.

    >>> seen = [{"method": "POST", "path": "/v1/completions", "headers": {"Authorization": "Bearer k", "Host": "h"},
    ...          "body": {"prompt": p, "max_tokens": 8}} for p in ("a", "b")]
    >>> shapes(seen, "k")
    [{'method': 'POST', 'path': '/v1/completions', 'headers': {'authorization': 'Bearer <api-key>'}, \
'body': {'prompt': 'a', 'max_tokens': 8}, 'output_tokens': 8}]
    """
    out: list[dict[str, Any]] = []
    keys: set[tuple[Any, ...]] = set()
    for r in seen:
        body = r["body"]
        key = (r["method"], r["path"], tuple(sorted(body)) if isinstance(body, dict) else None)
        if key not in keys:
            keys.add(key)
            headers = {k.lower(): UUID.sub("<uuid>", v.replace(api_key, "<api-key>")) for k, v in r["headers"].items()}
            out.append({"method": r["method"], "path": r["path"],
                        "headers": {k: headers[k] for k in sorted(headers) if k not in DROP_HEADERS}, "body": body,
                        "output_tokens": body.get("max_completion_tokens", body.get("max_tokens")) if key[2] else None})
    return out


def capture(spec: argparse.Namespace) -> int:
    """Each tool against the recording server; one fixture per tool under ``spec.capture``."""
    server = Recorder(spec.model)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    spec.base_url, spec.api_key = f"http://127.0.0.1:{server.server_address[1]}", CAPTURE_KEY
    failed = 0
    try:
        for tool in spec.tools:
            with server.lock:
                server.seen.clear()
            runs = [run_tool(tool, endpoint, spec) for endpoint in ENDPOINTS]
            with server.lock:
                requests = shapes(server.seen, CAPTURE_KEY)
            paths = {r["path"] for r in requests if r["method"] == "POST"}
            if not all(r["passed"] for r in runs) or not {"/v1/chat/completions", "/v1/completions"} <= paths:
                print(f"{tool}: not captured (a run failed or an endpoint was not called)", file=sys.stderr)
                failed += 1
                continue
            fixture = {"tool": tool, **tool_info(spec, tool), "captured": datetime.now(timezone.utc).date().isoformat(),
                       "command": runs[0]["command"], "requests": requests}
            spec.capture.mkdir(parents=True, exist_ok=True)
            path = spec.capture / f"{tool}.json"
            path.write_text(json.dumps(fixture, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")
            print(f"{tool}: {len(requests)} request shapes -> {path}")
    finally:
        server.shutdown()
        server.server_close()
    return 1 if failed else 0


async def measure(spec: argparse.Namespace) -> dict[str, Any]:
    """Each tool on each endpoint against the gateway; the model is the first it serves unless ``--model``."""
    if not spec.model:
        request = urllib.request.Request(f"{spec.base_url}/v1/models",
                                         headers={"Authorization": f"Bearer {spec.api_key}"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                spec.model = str(json.load(response)["data"][0]["id"])
        except (OSError, ValueError, KeyError, IndexError) as err:
            print(f"no model from {spec.base_url}/v1/models ({err}): is the platform up (goodput up)?", file=sys.stderr)
            raise SystemExit(2) from err
    report: dict[str, Any] = {
        "machine": machine_info(), "base_url": spec.base_url, "model": spec.model, "requests": spec.requests,
        "concurrency": spec.concurrency, "prompt_tokens": spec.prompt_tokens, "output_tokens": spec.output_tokens,
        "tools": {tool: tool_info(spec, tool) for tool in spec.tools}, "runs": []}
    for tool in spec.tools:
        for endpoint in ENDPOINTS:
            run = run_tool(tool, endpoint, spec)
            report["runs"].append(run)
            print(f"{tool} {endpoint}: {'ok' if run['passed'] else run['problem']}", flush=True)
    return report


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--base-url", default="http://127.0.0.1:8080", help="the gateway (run mode)")
    ap.add_argument("--api-key", default=None, help="default: .goodput/dev-key (run mode)")
    ap.add_argument("--model", default=None, help="default: the first of GET /v1/models (capture: the dev model's)")
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma-separated, of " + ", ".join(TOOLS))
    ap.add_argument("--requests", type=int, default=None, help="per run (default 20; capture 4)")
    ap.add_argument("--concurrency", type=int, default=None, help="default 4; capture 2")
    ap.add_argument("--prompt-tokens", type=int, default=96)
    ap.add_argument("--output-tokens", type=int, default=INFERENCE_PERF_CHAT_TOKENS)
    ap.add_argument("--tokenizer", type=Path, default=None, help="tokenizer.json's folder (default: the dev model)")
    ap.add_argument("--tools-dir", type=Path, default=Path(os.environ.get("PEERS_DIR", ROOT / ".tools" / "peers")))
    ap.add_argument("--timeout-s", type=float, default=900.0, help="per run")
    ap.add_argument("--capture", type=Path, default=None, help="capture mode: write the fixtures to this folder")


def prepare(ap: argparse.ArgumentParser, spec: argparse.Namespace) -> None:
    """The tools, the tokenizer and the key checked (not for ``--render``, which runs nothing); the defaults of the
    mode filled in."""
    spec.tools = [t for t in spec.tools.split(",") if t]
    if unknown := set(spec.tools) - set(TOOLS):
        ap.error(f"unknown tools: {', '.join(sorted(unknown))}")
    if spec.render is not None:
        return
    if missing := [t for t in spec.tools if not (spec.tools_dir / f"{t}-venv" / "bin" / t).exists()]:
        ap.error(f"not installed: {', '.join(missing)} (scripts/install-peers.sh)")
    spec.tokenizer = spec.tokenizer or tokenizer_dir()
    if spec.tokenizer is None or not (spec.tokenizer / "tokenizer.json").is_file():
        ap.error("no tokenizer folder: `make install` converts the dev model; or pass --tokenizer DIR")
    spec.tokenizer = spec.tokenizer.resolve()
    spec.requests = spec.requests or (4 if spec.capture else 20)
    spec.concurrency = spec.concurrency or (2 if spec.capture else 4)
    if spec.capture:
        from goodput_inference.devmodel import SERVED_NAME

        spec.model = spec.model or SERVED_NAME
    elif spec.api_key is None:
        if not (ROOT / ".goodput" / "dev-key").is_file():
            ap.error("no --api-key and no .goodput/dev-key (start the platform: goodput up)")
        spec.api_key = (ROOT / ".goodput" / "dev-key").read_text(encoding="utf-8").strip()


BENCHMARK = bench.Benchmark(name="peers", doc=__doc__ or "", run=measure, arguments=add_arguments, prepare=prepare,
                            out="loadtests/out/peers/peers",
                            ok=lambda report, args: all(r["passed"] for r in report["runs"]), reports=("peers",))


def main(argv: list[str] | None = None) -> int:
    """Capture mode writes fixtures, no report; run mode (and ``--render``) goes through the benchmark runner."""
    spec = bench.parse(BENCHMARK, argv)
    return capture(spec) if spec.capture and spec.render is None else bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
