"""The `goodput` command: `up` runs the platform here, `chat` asks it, `status` checks it, `keys` manages its API
keys, `train` makes the cross-encoders."""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from collections.abc import Collection
from pathlib import Path
from types import FrameType
from typing import Annotated, Any

import typer
from rich.console import Console

from goodput_cli.chat import DEFAULT_GATEWAY_URL, DEV_MODEL, ChatError, resolve_key, stream_chat
from goodput_cli.keys import default_state_dir
from goodput_cli.keys_cli import Priority
from goodput_cli.keys_cli import register as register_keys_commands
from goodput_cli.knowledge import register as register_knowledge_commands
from goodput_cli.pools import Pool, PoolsError, default_pools, load_pools
from goodput_cli.quotas_cli import register as register_quotas_commands
from goodput_cli.sizing_cli import register as register_size_command
from goodput_cli.status import collect, render
from goodput_cli.supervisor import Platform, PlatformError
from goodput_cli.train import register as register_train_command

app = typer.Typer(help="Goodput: LLM inference and RAG platform, on this machine.", no_args_is_help=True,
                  add_completion=False, pretty_exceptions_enable=False)

UP_FILE = "up.json"  # written once `goodput up` is serving, removed when it stops
EXAMPLE_QUESTION = "What is the capital of France?"
StateDir = Annotated[Path | None, typer.Option(
    "--state-dir", envvar="GOODPUT_STATE_DIR", show_default=False,
    help="State folder of the platform: key file, dev key, logs (default: .goodput here).")]


def cross_encoder_env(models_dir: Path, inherited: dict[str, str],
                      use: Collection[str] = ("reranker", "verifier")) -> dict[str, str]:
    """The settings that put the trained cross-encoders named in ``use`` to work when they exist (and nothing set
    them already): the retriever's reranker (and RAG asking for it) and the cache's verifier.

    >>> cross_encoder_env(Path("/nowhere"), {})
    {}
    """
    from goodput_crossencoder.card import MODEL_FOLDERS

    env: dict[str, str] = {}
    reranker, verifier = models_dir / MODEL_FOLDERS["reranker"], models_dir / MODEL_FOLDERS["verifier"]
    if ("reranker" in use and (reranker / "config.json").is_file()
            and "GOODPUT_RETRIEVER_RERANKER_MODEL" not in inherited):
        env["GOODPUT_RETRIEVER_RERANKER_MODEL"] = str(reranker.resolve())
        if "GOODPUT_GATEWAY_RAG__RERANK" not in inherited:
            env["GOODPUT_GATEWAY_RAG__RERANK"] = "true"
    if "verifier" in use and (verifier / "config.json").is_file() and "GOODPUT_CACHE_VERIFIER_MODEL" not in inherited:
        env["GOODPUT_CACHE_VERIFIER_MODEL"] = str(verifier.resolve())
    return env


def _fail(message: str, code: int = 1) -> typer.Exit:
    Console(stderr=True).print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    return typer.Exit(code)


def _raise_keyboard_interrupt(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def _served_models(platform: Platform) -> list[tuple[str, list[str]]]:
    """The generation models the gateway lists, with their aliases (the dev model's name when it answers with
    none); the embedding model, listed with its ``dimensions``, is left out."""
    import httpx

    try:
        reply = httpx.get(platform.gateway_http + "/v1/models", timeout=5,
                          headers={"Authorization": f"Bearer {platform.dev_key}"})
        data = reply.json().get("data") or []
        models = [(str(m["id"]), [str(a) for a in m.get("aliases") or []]) for m in data
                  if m.get("id") and "dimensions" not in m]
        if reply.status_code == 200 and models:
            return models
    except (httpx.HTTPError, ValueError, AttributeError, KeyError, TypeError):
        pass
    return [(os.environ.get("GOODPUT_INFERENCE_SERVED_MODEL_NAME") or DEV_MODEL, [])]


def choose_pools(workers: int | None, pools_file: Path | None) -> tuple[list[Pool], list[str]]:
    """The pools `goodput up` runs (and notes on what their file asks that runs only in a cluster): the file's, else
    the default two when ``--workers`` is not given either; none (``workers`` identical workers) with ``--workers``.

    >>> [p.name for p in choose_pools(None, None)[0]], choose_pools(3, None)
    (['interactive', 'batch'], ([], []))
    """
    if workers is not None and pools_file is not None:
        raise PoolsError("--workers and --pools both say which workers run: give one (--workers N is N workers of "
                         "one pool serving every class)")
    if pools_file is not None:
        return load_pools(pools_file)
    return ([], []) if workers is not None else (default_pools(), [])


def served_summary(pools: list[Pool], models: list[tuple[str, list[str]]]) -> str:
    """What `goodput up` says it serves: each pool (workers, model, classes, batch limits), then each model clients
    may name, with its aliases.

    >>> print(served_summary(default_pools(), [("smollm2-135m-instruct", [])]))
    Pools:
      interactive: 1 worker of smollm2-135m-instruct, classes P0,P1, max_num_seqs 8, max_num_batched_tokens 2048
      batch: 1 worker of smollm2-135m-instruct, classes P2, max_num_seqs 32, max_num_batched_tokens 4096
    Models (pass one as `model`): smollm2-135m-instruct
    """
    lines = ["Pools:", *(f"  {p.describe(DEV_MODEL)}" for p in pools if p.replicas)] if pools else []
    named = [f"{name} (aliases: {', '.join(aliases)})" if aliases else name for name, aliases in models]
    lines.append(f"Models (pass one as `model`): {'; '.join(named)}")
    return "\n".join(lines)


def usage_examples(*, base_url: str, key: str, model: str) -> str:
    """A curl line and an openai SDK snippet that work as printed (both stream).

    Both ask for greedy decoding (temperature 0): the dev model is nearly undecided on the example's first token
    (in float32, "The" and "L" are 0.08 logits apart), so at its recommended sampling temperature of 0.2 about one
    answer in three starts "L'Étoile…". A first call should show the model's most likely answer, every time.
    """
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": EXAMPLE_QUESTION}],
                       "max_tokens": 64, "temperature": 0, "stream": True})
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
    temperature=0,
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
    workers: Annotated[int | None, typer.Option(
        "--workers", "-w", min=1, show_default=False,
        help="N identical inference workers (one vLLM engine each) of one pool serving every class, instead of "
             "the pools.")] = None,
    pools_file: Annotated[Path | None, typer.Option(
        "--pools", envvar="GOODPUT_POOLS", show_default=False, exists=True, dir_okay=False,
        help="Model pools, YAML or JSON, in the shape of the chart's `inference` block (pools: name, classes, "
             "model, aliases, engine, maxNumSeqs, maxNumBatchedTokens, replicas...; docs/examples/pools-two-models"
             ".yaml). Default: two pools of the dev model, `interactive` (P0/P1, small batches) and `batch` (P2, "
             "larger ones), one worker each.")] = None,
    gateways: Annotated[int, typer.Option("--gateways", min=1,
                                          help="Gateway replicas (the n-th on the first's ports + 20n); they share "
                                               "the scheduler, the keys file and the quota counters.")] = 1,
    scheduler_replicas: Annotated[int, typer.Option(
        "--scheduler-replicas", min=1,
        help="Scheduler replicas (the n-th on the first's ports + 50n), active-passive: they elect their leader "
             "through Redis (a lock key per platform) and the gateways follow it, as the chart's replicas do "
             "through a Lease.")] = 1,
    engine: Annotated[str | None, typer.Option(
        "--engine", envvar="GOODPUT_INFERENCE_ENGINE", show_default=False,
        help="The workers' engine: vllm (default), sim (simulated: no model, starts in seconds) or triton; a pool "
             "that names its own engine keeps it.")] = None,
    port_offset: Annotated[int, typer.Option("--port-offset", help="Added to every port (run two platforms).")] = 0,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds to wait for every service to serve.")] = 900,
    state_dir: StateDir = None,
    redis_db: Annotated[int | None, typer.Option(
        "--redis-db", min=0, show_default=False,
        help="Redis database of this platform (keys, Celery queues); default: the one in GOODPUT_REDIS_URL, "
             "else 0.")] = None,
    insecure_internal: Annotated[bool, typer.Option(
        "--insecure-internal", envvar="GOODPUT_INSECURE_INTERNAL",
        help="Plaintext gRPC between the services (no certificates, no authorization by identity). The default "
             "is mutual TLS with a development CA in the state folder.")] = False,
    redis_users: Annotated[bool, typer.Option(
        "--redis-users/--no-redis-users",
        help="Each service connects to Redis as its own ACL user, limited to its keys (made with GOODPUT_REDIS_URL's "
             "credentials, deleted on stop). --no-redis-users gives them all GOODPUT_REDIS_URL (a Redis without "
             "ACLs).")] = True,
    models_dir: Annotated[Path, typer.Option(
        "--models-dir", envvar="GOODPUT_MODELS_DIR",
        help="Where `goodput train` put the cross-encoders.")] = Path("../shared/data/models"),
    use_models: Annotated[str, typer.Option(
        "--use-models", envvar="GOODPUT_USE_MODELS",
        help="Which trained cross-encoders in --models-dir to put to work: `reranker` (RAG reranks), `verifier` "
             "(the cache verifies semantic hits), both (comma-separated) or `none`. The verifier is off by default: "
             "the one `goodput train` makes on 2 cores refuses most true paraphrases at its threshold "
             "(loadtests/reports/cache_eval.md).")] = "reranker",
) -> None:
    """Start Redis (if needed) and every service here; Ctrl-C stops them all.

    A second platform on this machine: its own --state-dir, --port-offset and --redis-db.
    """
    console = Console()
    workdir = (state_dir or default_state_dir()).resolve()
    try:
        pools, notes = choose_pools(workers, pools_file)
    except PoolsError as err:
        raise _fail(str(err)) from None
    extra_env = cross_encoder_env(models_dir, dict(os.environ), use={u.strip() for u in use_models.split(",")})
    platform = Platform(workdir=workdir, workers=workers, port_offset=port_offset, redis_db=redis_db,
                        insecure_internal=insecure_internal, gateways=gateways, env=extra_env, pools=pools,
                        scheduler_replicas=scheduler_replicas, engine=engine, redis_users=redis_users)
    for name, value in extra_env.items():
        console.print(f"{name}={value}", style="dim", highlight=False)
    for note in notes:
        console.print(f"note: {note}", style="dim", highlight=False)
    if insecure_internal:
        console.print("warning: internal gRPC runs in PLAINTEXT (--insecure-internal): services do not authenticate "
                      "or authorize each other", style="yellow", highlight=False)
    # Ctrl-C and SIGTERM both stop everything, even when SIGINT came ignored (e.g. started with `&` by a script).
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise_keyboard_interrupt)
    ready, error = False, ""
    try:
        layout = (f"{len([p for p in pools if p.replicas])} pool(s) ("
                  + ", ".join(f"{p.name} x{p.replicas}" for p in pools if p.replicas) + "), " if pools else "")
        console.print(f"starting Goodput: {layout}{platform.workers} worker(s), logs in {platform.logs_dir}",
                      highlight=False)
        platform.start(timeout_s=timeout, console=console)
        ready = True
        more = "".join(f"; replica {i}: REST {platform.gateway_http_at(i)}, gRPC {platform.gateway_grpc_at(i)}"
                       for i in range(1, gateways))
        if scheduler_replicas > 1:
            more += (f"; {scheduler_replicas} scheduler replicas ("
                     + ", ".join(platform.scheduler_grpc_at(i) for i in range(scheduler_replicas))
                     + f"), replica {platform.leader()} leads")
        print(f"\nGoodput is up: REST {platform.gateway_http}, gRPC {platform.gateway_grpc}{more}. "
              f"Dev API key: {platform.dev_key} (also in {workdir / 'dev-key'}). "
              f"Gateway metrics: {platform.gateway_metrics}\n")
        models = _served_models(platform)
        print(served_summary(pools, models) + "\n")
        print(usage_examples(base_url=platform.gateway_http, key=str(platform.dev_key), model=models[0][0]))
        print("Press Ctrl-C to stop.", flush=True)
        # For scripts and tools: where the running platform answers (removed again on stop).
        (workdir / UP_FILE).write_text(json.dumps({"pid": os.getpid(), "gateway_http": platform.gateway_http,
                                                   "gateway_grpc": platform.gateway_grpc,
                                                   "scheduler_grpc": platform.scheduler_grpc,
                                                   "redis_url": platform.redis_url,
                                                   "tls_dir": str(platform.tls_dir or ""),
                                                   "endpoints": platform.endpoints()}) + "\n")
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
        api_key = resolve_key(key, default_state_dir())
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


def operator_credentials(state_dir: Path) -> Any:
    """The operator's mTLS credentials of the platform in ``state_dir`` (its ``up.json`` names the CA's folder; else
    ``tls/`` there); None when that platform runs plaintext or has no certificates."""
    from goodput_core.tls import tls_files

    tls_dir = state_dir / "tls"
    try:
        named = json.loads((state_dir / UP_FILE).read_text()).get("tls_dir")
        if isinstance(named, str):
            if not named:
                return None
            tls_dir = Path(named)
    except (OSError, ValueError, AttributeError):
        pass
    files = tls_files(tls_dir, "operator")
    return files.channel_credentials() if files.cert.exists() else None


def status_endpoints(state_dir: Path, port_offset: int) -> dict[str, str]:
    """What `status` checks: the endpoints a running `goodput up` wrote into its state folder, else those of a
    platform started with ``port_offset``."""
    try:
        up_file = json.loads((state_dir / UP_FILE).read_text())
        endpoints = up_file["endpoints"]
        if isinstance(endpoints, dict):
            return {str(k): str(v) for k, v in endpoints.items()}
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return Platform(workdir=state_dir, port_offset=port_offset).endpoints()


@app.command()
def status(
    state_dir: StateDir = None,
    port_offset: Annotated[int, typer.Option("--port-offset", help="Of a platform without an up.json in the "
                                                                   "state folder.")] = 0,
    scheduler: Annotated[str | None, typer.Option("--scheduler", show_default=False,
                                                  help="Scheduler gRPC address.")] = None,
    gateway: Annotated[str | None, typer.Option("--gateway", show_default=False,
                                                help="Gateway base URL (REST).")] = None,
    gateway_grpc: Annotated[str | None, typer.Option("--gateway-grpc", show_default=False,
                                                     help="Gateway gRPC address.")] = None,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds per check.")] = 2.0,
) -> None:
    """Health of every service (gateway, scheduler, embedder, retriever, cache, Celery workers) and each worker's
    load. Non-zero exit if any is down."""
    console = Console()
    folder = (state_dir or default_state_dir()).resolve()
    endpoints = status_endpoints(folder, port_offset)
    for name, value in (("scheduler", scheduler), ("gateway_http", gateway), ("gateway", gateway_grpc)):
        if value:
            endpoints[name] = value
    report = collect(endpoints, timeout_s=timeout, credentials=operator_credentials(folder))
    render(report, console)
    if not report.ok:
        raise _fail("; ".join(report.problems))
    console.print("[green]all services healthy[/]")


register_knowledge_commands(app)  # `goodput index` and `goodput search`
register_keys_commands(app)  # `goodput keys create|list|revoke|tenant`
register_quotas_commands(app)  # `goodput quotas status|accept-loss`
register_size_command(app)  # `goodput size`: GPUs, tensor parallelism and max_num_seqs for a model
register_train_command(app)  # `goodput train reranker|verifier`


def main() -> None:
    app()


if __name__ == "__main__":
    main()
