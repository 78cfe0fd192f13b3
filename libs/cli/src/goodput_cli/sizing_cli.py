"""`goodput size`: which GPUs, how many, and with which ``max_num_seqs``, a model needs for a context and a concurrency
(the arithmetic is :mod:`goodput_cli.sizing`; the GPUs are :mod:`goodput_cli.gpus`).

Example::

    $ goodput size --model 7B --context 8192 --concurrency 8
    $ goodput size --model 72B --context 8192 --concurrency 16 --quantization int8 --gpu A100-80 --gpu H200
    $ goodput size --model /models/Qwen2.5-14B-Instruct-AWQ --context 8192 --concurrency 4 --json

It prints the weights and KV-cache memory, one row per GPU type (the smallest tensor-parallel size that holds the
concurrency at the full context, or why none does), the recommendation and a values snippet for its pool; ``--json``
prints the same as one JSON object (the snippet under ``values``). Exit status 1 when nothing fits.

    >>> _costs(["A100-80=2.5"])
    {'A100-80': 2.5}
"""

from __future__ import annotations

import json
from dataclasses import replace
from enum import Enum
from typing import Annotated, NoReturn

import typer
from rich import box
from rich.console import Console
from rich.table import Table

from goodput_cli.gpus import GPUS, Gpu, find_gpu
from goodput_cli.sizing import DEFAULT_CLASSES, Sizing, SizingError, load_model, pool_values, size

__all__ = ["register"]


class Quantization(str, Enum):
    auto = "auto"
    none = "none"
    fp8 = "fp8"
    int8 = "int8"
    awq = "awq"
    gptq = "gptq"


def _fail(message: str, code: int = 1) -> NoReturn:
    Console(stderr=True).print(f"error: {message}", markup=False, highlight=False, soft_wrap=True)
    raise typer.Exit(code)


def _costs(pairs: list[str]) -> dict[str, float]:
    costs: dict[str, float] = {}
    for pair in pairs:
        name, _, value = pair.partition("=")
        try:
            costs[find_gpu(name).name] = float(value)
        except KeyError as err:
            raise SizingError(str(err.args[0])) from None
        except ValueError:
            raise SizingError(f"--cost {pair!r}: expected GPU=PRICE, e.g. A100-80=2.4") from None
    return costs


def _catalogue(names: list[str], costs: dict[str, float]) -> list[Gpu]:
    try:
        chosen = [find_gpu(n) for n in names] if names else list(GPUS.values())
    except KeyError as err:
        raise SizingError(str(err.args[0])) from None
    return [replace(g, cost_per_hour=costs[g.name]) if g.name in costs else g for g in dict.fromkeys(chosen)]


def render(plan: Sizing, console: Console) -> None:
    m = plan.model
    console.print(f"[bold]{m.name}[/]: {m.parameters / 1e9:.2f}e9 parameters, {m.num_hidden_layers} layers, "
                  f"{m.num_attention_heads} heads, {m.num_key_value_heads} KV heads x {m.head_dim}, window "
                  f"{m.max_position_embeddings}" + (f", sliding window {m.sliding_window} on "
                                                    f"{m.sliding_window_layers} layers" if m.sliding_window else ""),
                  highlight=False)
    console.print(f"  ({m.source})", style="dim", highlight=False, soft_wrap=True)
    console.print(f"weights: {plan.weights_gib} GiB ({plan.dtype}, quantization {plan.quantization}); KV cache "
                  f"({plan.kv_cache_dtype}): {plan.kv_bytes_per_token / 1024:g} KiB per token, "
                  f"{plan.kv_gib_per_sequence} GiB per {plan.context}-token sequence, {plan.kv_gib_needed} GiB for "
                  f"{plan.concurrency} sequences; gpu_memory_utilization {plan.gpu_memory_utilization:g}; "
                  f"tensor-parallel sizes {', '.join(map(str, plan.tensor_parallel_sizes))}", highlight=False)
    # Narrow enough for 80 columns; why a GPU type does not fit is said below the table, in full.
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, padding=(0, 1), collapse_padding=True)
    for column in ("GPUs", "weights", "reserve", "KV", "KV tokens", "seqs", "max_seqs", "cost/h", "fits"):
        table.add_column(column, justify="left" if column in ("GPUs", "fits") else "right", no_wrap=True)
    for o in plan.options:
        mark = "[bold green]best[/]" if o is plan.recommended else ("yes" if o.fits else "[red]no[/]")
        table.add_row(f"{o.count}x {o.gpu}", f"{o.weights_gib_per_gpu:.1f}", f"{o.overhead_gib_per_gpu:.1f}",
                      f"{o.kv_cache_gib_per_gpu:.1f}", f"{o.kv_cache_tokens:,}", str(o.sequences),
                      str(o.max_num_seqs or "-"), f"{o.cost_per_hour:g}", mark,
                      style=None if o.fits else "dim")
    console.print(table)
    console.print("GiB per GPU (weights, activation/runtime reserve, KV cache); KV tokens per worker; seqs: "
                  f"{plan.context}-token sequences the cache holds; cost/h relative (A10 = 1)", style="dim",
                  highlight=False)
    for o in plan.options:
        if not o.fits:
            console.print(f"{o.gpu}: {o.reason}", style="dim", highlight=False, soft_wrap=True)
    for warning in plan.warnings:
        console.print(f"warning: {warning}", style="yellow", highlight=False, soft_wrap=True)


def register(app: typer.Typer) -> None:
    @app.command("size")
    def size_command(
        model: Annotated[str, typer.Option("--model", "-m", show_default=False,
                                           help="An HF model folder (its config.json) or a parameter count (7B, "
                                                "14B, 72B, 135M: Qwen2.5 shapes).")],
        context: Annotated[int, typer.Option("--context", "-c", min=1, show_default=False,
                                             help="Tokens per sequence, prompt and output (the pool's maxModelLen).")],
        concurrency: Annotated[int, typer.Option("--concurrency", "-n", min=1, show_default=False,
                                                 help="Sequences one worker holds at once, each at the full "
                                                      "context.")],
        dtype: Annotated[str, typer.Option("--dtype", help="auto (the checkpoint's; float32 runs as bfloat16), "
                                                           "bfloat16, float16, float32.")] = "auto",
        quantization: Annotated[Quantization, typer.Option(
            "--quantization", "-q", help="Weights: auto (the checkpoint's), none, fp8, int8 (W8A8), awq or gptq "
                                         "(4-bit).")] = Quantization.auto,
        kv_cache_dtype: Annotated[str, typer.Option("--kv-cache-dtype", help="auto (= dtype), bfloat16, float16, "
                                                                             "fp8.")] = "auto",
        gpu_memory_utilization: Annotated[float, typer.Option("--gpu-memory-utilization", min=0.05, max=1.0,
                                                              help="vLLM's share of each GPU.")] = 0.9,
        gpu: Annotated[list[str] | None, typer.Option("--gpu", show_default=False,
                                                      help="Consider only this GPU type (repeat for a fleet).")] = None,
        cost: Annotated[list[str] | None, typer.Option("--cost", show_default=False,
                                                       help="Your price per GPU-hour, GPU=PRICE (repeat).")] = None,
        overhead_gib: Annotated[float | None, typer.Option(
            "--overhead-gib", min=0.0, show_default=False,
            help="Activation and runtime reserve per GPU, replacing the estimate.")] = None,
        name: Annotated[str | None, typer.Option("--name", show_default=False, help="The pool's name.")] = None,
        classes: Annotated[str, typer.Option("--classes", help="Priority classes the pool serves.")] =
            ",".join(DEFAULT_CLASSES),
        as_json: Annotated[bool, typer.Option("--json", help="One JSON object instead of the table.")] = False,
    ) -> None:
        """Weights and KV-cache memory of a model, the GPUs and counts that hold it, max_num_seqs and pool values."""
        try:
            catalogue = _catalogue(gpu or [], _costs(cost or []))
            plan = size(load_model(model), context=context, concurrency=concurrency, dtype=dtype,
                        quantization=quantization.value, kv_cache_dtype=kv_cache_dtype,
                        gpu_memory_utilization=gpu_memory_utilization, overhead_gib=overhead_gib, gpus=catalogue)
        except SizingError as err:
            _fail(str(err))
        pool_classes = [c.strip() for c in classes.split(",") if c.strip()]
        values = pool_values(plan, plan.recommended, name=name, classes=pool_classes) if plan.recommended else ""
        if as_json:
            print(json.dumps({**plan.to_json(), "values": values}, indent=2))
        else:
            console = Console()
            render(plan, console)
            if plan.recommended:
                r = plan.recommended
                console.print(f"\nrecommended: {r.count}x {r.gpu} (tensorParallelSize {r.count}), maxNumSeqs "
                              f"{r.max_num_seqs}, maxNumBatchedTokens {r.max_num_batched_tokens}\n", highlight=False)
                print(values, end="")
        if plan.recommended is None:
            _fail(f"nothing considered holds {concurrency} sequences of {context} tokens: lower them, quantize "
                  "(--quantization), or allow more GPU types (--gpu)")
