"""The `goodput` command: `up` runs the platform here, `chat` asks it, `status` checks it."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from enum import Enum
from pathlib import Path
from types import FrameType
from typing import Annotated

import typer
from rich.console import Console
from rich.table import Table

from goodput_cli.chat import DEFAULT_GATEWAY_URL, DEV_MODEL, ChatError, resolve_key, stream_chat
from goodput_cli.knowledge import register as register_knowledge_commands
from goodput_cli.status import collect
from goodput_cli.supervisor import GATEWAY_GRPC, SCHEDULER_GRPC, Platform, PlatformError

app = typer.Typer(help="Goodput: LLM inference and RAG platform, on this machine.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)

WORKDIR_NAME = ".goodput"
UP_FILE = "up.json"  # written once `goodput up` is serving, removed when it stops
EXAMPLE_QUESTION = "What is the capital of France?"
DEFAULT_SCHEDULER = f"127.0.0.1:{SCHEDULER_GRPC}"
DEFAULT_GATEWAY_GRPC = f"127.0.0.1:{GATEWAY_GRPC}"


class Priority(str, Enum):
    P0 = "P0"
    P1 = "P1"
    P2 = "P2"


def _fail(message: str, code: int = 1) -> typer.Exit:
    Console(stderr=True).print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _served_model(platform: Platform) -> str:
    """The model the gateway lists first (falls back to the dev model's name)."""
    import httpx

    try:
        reply = httpx.get(platform.gateway_http + "/v1/models", timeout=5,
                          headers={"Authorization": f"Bearer {platform.dev_key}"})
        data = reply.json().get("data") or []
        if reply.status_code == 200 and data and data[0].get("id"):
            return str(data[0]["id"])
    except (httpx.HTTPError, ValueError, AttributeError):
        pass
    return os.environ.get("GOODPUT_INFERENCE_SERVED_MODEL_NAME") or DEV_MODEL


def usage_examples(*, base_url: str, key: str, model: str) -> str:
    """A curl line and an openai SDK snippet that work as printed (both stream)."""
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": EXAMPLE_QUESTION}],
                       "max_tokens": 64, "stream": True})
    return f"""\
Stream a chat completion with curl:

curl -N {base_url}/v1/chat/completions \\
  -H "Authorization: Bearer {key}" \\
  -H "Content-Type: application/json" \\
  -d '{body}'

Or with the openai SDK (Python):

from openai import OpenAI

client = OpenAI(base_url="{base_url}/v1", api_key="{key}")
stream = client.chat.completions.create(
    model="{model}",
    messages=[{{"role": "user", "content": "{EXAMPLE_QUESTION}"}}],
    max_tokens=64,
    stream=True,
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()

Or: goodput chat "{EXAMPLE_QUESTION}"
"""


@app.command()
def up(
    workers: Annotated[int, typer.Option("--workers", "-w", min=1,
                                         help="Inference workers (one vLLM engine each).")] = 1,
    port_offset: Annotated[int, typer.Option("--port-offset", help="Added to every port (run two platforms).")] = 0,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for every service to serve.")] = 900,
) -> None:
    """Start Redis (if needed), the inference workers, the scheduler and the gateway here; Ctrl-C stops them all."""
    console = Console()
    workdir = Path.cwd() / WORKDIR_NAME
    platform = Platform(workdir=workdir, workers=workers, port_offset=port_offset)
    # Ctrl-C and SIGTERM both stop everything, even when SIGINT came ignored (e.g. started with `&` by a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    ready, error = False, ""
    try:
        console.print(f"starting Goodput: {workers} worker(s), logs in {platform.logs_dir}", highlight=False)
        platform.start(timeout_s=timeout, console=console)
        ready = True
        print(f"\nGoodput is up: REST {platform.gateway_http}, gRPC {platform.gateway_grpc}. "
              f"Dev API key: {platform.dev_key} (also in {workdir / 'dev-key'})\n")
        print(usage_examples(base_url=platform.gateway_http, key=str(platform.dev_key),
                             model=_served_model(platform)))
        print("Press Ctrl-C to stop.", flush=True)
        # For scripts and tools: where the running platform answers (removed again on stop).
        (workdir / UP_FILE).write_text(json.dumps({"pid": os.getpid(), "gateway_http": platform.gateway_http,
                                                   "gateway_grpc": platform.gateway_grpc,
                                                   "scheduler_grpc": platform.scheduler_grpc}) + "\n")
        reported: set[str] = set()
        while True:
            for name, rc in platform.exited().items():
                if name not in reported:
                    reported.add(name)
                    console.print(f"warning: {name} exited with code {rc}; see {platform.log_path(name)}",
                                  style="yellow", highlight=False)
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    except PlatformError as err:
        error = str(err)
    finally:
        # A second Ctrl-C must not interrupt the shutdown and leave children behind.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        console.print("stopping...", highlight=False)
        (workdir / UP_FILE).unlink(missing_ok=True)
        platform.stop()
        console.print("stopped.", highlight=False)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if error:
        raise _fail(error)
    if not ready:
        raise typer.Exit(130)


@app.command()
def chat(
    question: Annotated[str, typer.Argument(help="The question.")],
    model: Annotated[str, typer.Option("--model", "-m", help="Served model name.")] = DEV_MODEL,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1)] = 256,
    priority: Annotated[Priority | None, typer.Option("--priority", "-p", help="Default: the key's.")] = None,
    url: Annotated[str, typer.Option("--url", envvar="GOODPUT_URL", help="Gateway base URL.")] = DEFAULT_GATEWAY_URL,
    key: Annotated[str | None, typer.Option("--key", help="API key (default $GOODPUT_API_KEY, then "
                                                          ".goodput/dev-key).", show_default=False)] = None,
) -> None:
    """Ask the gateway one question and stream the answer as it is generated."""
    wrote = False

    def write(text: str) -> None:
        nonlocal wrote
        wrote = True
        sys.stdout.write(text)
        sys.stdout.flush()

    try:
        api_key = resolve_key(key, Path.cwd() / WORKDIR_NAME)
        stream_chat(question=question, url=url, key=api_key, model=model, max_tokens=max_tokens,
                    priority=priority.value if priority else None, write=write)
    except ChatError as err:
        if wrote:
            print()
        raise _fail(str(err)) from None
    except KeyboardInterrupt:
        print()
        raise typer.Exit(130) from None
    print()


@app.command()
def status(
    scheduler: Annotated[str, typer.Option("--scheduler", help="Scheduler gRPC address.")] = DEFAULT_SCHEDULER,
    gateway: Annotated[str, typer.Option("--gateway", help="Gateway base URL (REST).")] = DEFAULT_GATEWAY_URL,
    gateway_grpc: Annotated[str, typer.Option("--gateway-grpc", help="Gateway gRPC address.")] = DEFAULT_GATEWAY_GRPC,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds per check.")] = 2.0,
) -> None:
    """Health of the gateway, the scheduler and every worker, with each worker's load. Non-zero exit if any is down."""
    console = Console()
    report = collect(scheduler=scheduler, gateway_url=gateway, gateway_grpc=gateway_grpc, timeout_s=timeout)

    services = Table(title="services", title_justify="left")
    for col in ("service", "address", "health"):
        services.add_column(col)
    for s in report.services:
        services.add_row(s.name, s.address, f"[green]{s.detail}[/]" if s.ok else f"[red]{s.detail}[/]")
    console.print(services)

    if report.workers:
        workers = Table(title="workers (load as the scheduler sees it)", title_justify="left")
        workers.add_column("worker", no_wrap=True)
        workers.add_column("address", no_wrap=True)
        workers.add_column("state", no_wrap=True)
        for col in ("running", "waiting", "KV", "inflight"):
            workers.add_column(col, justify="right", no_wrap=True)
        workers.add_column("last error", overflow="fold")
        for w in report.workers:
            state = "[green]healthy[/]" if w.healthy else "[red]unhealthy[/]"
            if w.serving != "serving":
                state += f" [red]({w.serving})[/]"
            workers.add_row(w.worker_id, w.address, state, str(w.running), str(w.waiting),
                            f"{w.kv_cache_usage:.0%}", str(w.inflight), w.last_error or "")
        console.print(workers)

    if not report.ok:
        raise _fail("; ".join(report.problems))
    console.print("[green]all services healthy[/]")


register_knowledge_commands(app)  # `goodput index` and `goodput search`


def main() -> None:
    app()


if __name__ == "__main__":
    main()
