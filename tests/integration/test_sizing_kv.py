"""`goodput size`'s KV-cache arithmetic against a real engine: the tokens the vLLM CPU engine of the session's
platform says its cache holds ("CPU KV cache size: N tokens" in the worker's log) are what the calculator predicts
from the dev model's config.json, the engine's KV dtype and its cache space (``VLLM_CPU_KVCACHE_SPACE``), within 10%.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from goodput_testing import wait_until

from goodput_cli.sizing import GIB, KV_DTYPES, kv_bytes_per_token, kv_cache_tokens, load_model
from goodput_cli.supervisor import Platform

pytestmark = [pytest.mark.integration]

KV_LINE = re.compile(r"KV cache size: ([\d,]+) tokens")


def _log_records(path: Path) -> list[dict[str, Any]]:
    records = []
    for line in path.read_text(errors="replace").splitlines():
        if line.startswith("{"):
            try:
                records.append(json.loads(line))
            except ValueError:
                pass
    return records


def test_the_engine_holds_the_kv_tokens_the_calculator_predicts(platform: Platform) -> None:
    log = platform.log_path("worker-0")
    # The platform serves only once the engine is up, so the line is there; the wait covers a log not yet flushed.
    found = wait_until(lambda: KV_LINE.findall(log.read_text(errors="replace")), timeout=60,
                       message="vLLM's 'KV cache size' line in worker-0's log")
    reported = int(found[-1].replace(",", ""))
    records = _log_records(log)
    started = next(r for r in reversed(records) if r.get("msg") == "starting vLLM engine")
    ready = next(r for r in reversed(records) if r.get("msg") == "vLLM engine ready")
    spec = next(s for s in platform.plan() if s.name == "worker-0")
    env = platform.child_env(spec)
    space_gib = float(env.get("VLLM_CPU_KVCACHE_SPACE") or env.get("GOODPUT_INFERENCE_KV_CACHE_SPACE_GB") or 1)

    shape = load_model(str(started["model"]))
    kv_bytes = KV_DTYPES[str(ready["kv_cache_dtype"])]
    predicted = kv_cache_tokens(shape, cache_bytes=int(space_gib * GIB), kv_bytes=kv_bytes)

    print(f"dev model {shape.name}: {kv_bytes_per_token(shape, kv_bytes=kv_bytes)} B/token ({ready['kv_cache_dtype']}),"
          f" {space_gib:g} GiB cache: predicted {predicted} tokens, the engine reports {reported}")
    assert predicted == pytest.approx(reported, rel=0.10)
