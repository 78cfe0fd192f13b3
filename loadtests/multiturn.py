"""Multi-turn conversations: sessions of 5-10 turns whose prompt is the whole conversation so far (a system prompt,
then every user message and answer), TTFT per turn with and without prefix caching and session affinity.

Every arm replays the same sessions (seeded: system prompts, turns, user messages, the answers put back into the
history, think times) on a fresh fleet (cold caches); ``--concurrent`` sessions at a time, a new one starting when
one ends. Arms:

* ``affinity``: prefix caching on, the scheduler's default profile (session affinity: the worker that served the
  conversation's last turn; prefix affinity on the first 512 characters, the gateway's prefix hint);
* ``prefix_affinity_only``: the default profile without ``session_affinity`` (``GOODPUT_SCHEDULER_PROFILE``);
* ``no_affinity``: neither ``session_affinity`` nor ``prefix_affinity``: placement by load only, so a turn finds
  its history cached only if it lands where the last one ran;
* ``no_cache``: no prefix caching. On vLLM the worker's own switch (``GOODPUT_INFERENCE_ENABLE_PREFIX_CACHING=false``).
  The simulated engine has no such switch (it ignores the setting), so there it is **emulated**: every request is
  sent as a tenant of its own, and as the worker salts each tenant's cache blocks differently, no request can reuse
  another's blocks, which is what an engine without a prefix cache computes. (It also defeats the scheduler's
  tenant-scoped affinities, which without a cache have nothing to win.)

Per turn: TTFT p50/p95 and the share of the prompt the prefix cache served; per arm: TTFT over all turns and the
later turns (5+), the share of turns placed on the worker of the previous turn, and goodput within the P0 SLO.

    python -m loadtests.multiturn --out loadtests/reports/multiturn-sim      # 4 simulated workers, ~10 min
    python -m loadtests.multiturn --engine vllm --out loadtests/reports/multiturn-vllm   # 1 CPU worker, ~7 min
    python -m loadtests.multiturn --smoke      # 2 simulated workers, 4 short sessions, 2 arms (the test)
    python -m loadtests.multiturn --render loadtests/reports/multiturn-sim.json   # re-render report + plot

A benchmark reports numbers; it does not fail on a missed goal (only when nothing could be served).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass
from typing import Any

from goodput_scheduler.placement.profile import DEFAULT_PROFILE
from loadtests import bench
from loadtests.common import machine_info, summarize
from loadtests.simfleet import LeaseClient, RequestSpec, Result, random_text
from loadtests.suite import (
    CHARS_PER_TOKEN,
    LOGS,
    Engine,
    declare,
    engine_for,
    figure_title,
    fleet,
    latency_stats,
    p0_slo,
    samples,
    worker_info,
)

NAME = "multiturn"
PRESETS: dict[str, dict[str, Any]] = {
    "sim": {"workers": 4, "max_num_seqs": 64, "max_model_len": 8192, "sessions": 96, "concurrent": 48,
            "turns": "5,10", "system_tokens": 500, "tenants": 4, "user_tokens": "100,400", "max_tokens": 64,
            "think_s": 1.0, "arms": "affinity,prefix_affinity_only,no_affinity,no_cache"},
    "vllm": {"workers": 1, "max_num_seqs": 8, "max_model_len": 2048, "sessions": 8, "concurrent": 4,
             "turns": "5,8", "system_tokens": 150, "tenants": 1, "user_tokens": "30,80", "max_tokens": 32,
             "think_s": 0.5, "arms": "affinity,no_cache"},
    "smoke": {"workers": 2, "max_num_seqs": 8, "max_model_len": 4096, "sessions": 4, "concurrent": 4,
              "turns": "5,5", "system_tokens": 100, "tenants": 2, "user_tokens": "20,40", "max_tokens": 8,
              "think_s": 0.05, "arms": "affinity,no_cache", "time_scale": 1.0},
}
ARMS = {
    "affinity": "prefix caching, the default profile (session + prefix affinity)",
    "prefix_affinity_only": "prefix caching, the default profile without session_affinity",
    "no_affinity": "prefix caching, the default profile without session_affinity and prefix_affinity",
    "no_cache": "no prefix caching, the default profile",
}
LATER_TURN = 5


def profile_without(*scorers: str) -> str:
    """The scheduler's default placement profile less the named scorers, as GOODPUT_SCHEDULER_PROFILE JSON.

    >>> [s["name"] for s in json.loads(profile_without("session_affinity"))["scorers"]]
    ['least_loaded', 'least_prefill', 'predicted_finish', 'prefix_affinity']
    """
    return json.dumps({**DEFAULT_PROFILE,
                       "scorers": [s for s in DEFAULT_PROFILE["scorers"] if s["name"] not in scorers]})


def arm_settings(arm: str, engine_name: str) -> tuple[dict[str, str], dict[str, str], bool]:
    """(scheduler env, worker env, one tenant per request) of an arm on an engine."""
    if arm == "prefix_affinity_only":
        return {"PROFILE": profile_without("session_affinity")}, {}, False
    if arm == "no_affinity":
        return {"PROFILE": profile_without("session_affinity", "prefix_affinity")}, {}, False
    if arm == "no_cache":
        if engine_name == "vllm":
            return {}, {"GOODPUT_INFERENCE_ENABLE_PREFIX_CACHING": "false"}, False
        return {}, {}, True
    return {}, {}, False


@dataclass(frozen=True)
class Turn:
    session: int
    turn: int
    tenant: str
    prompt: str
    think_s: float  # engine time after this turn's answer


def conversations(args: argparse.Namespace, engine: Engine) -> list[list[Turn]]:
    """Every session's turns, the same in every arm: the prompt of turn k is the system prompt, then every earlier
    user message and answer (each answer ``max_tokens`` tokens of text), then turn k's user message.

    >>> ns = argparse.Namespace(seed=1, sessions=2, turns="3,3", tenants=1, system_tokens=10, user_tokens="5,5",
    ...                         max_tokens=4, think_s=1.0)
    >>> s = conversations(ns, Engine("sim", 1, 1, 512, {}, {}))
    >>> [len(t.prompt) for t in s[0]], all(b.prompt.startswith(a.prompt) for a, b in zip(s[0], s[0][1:]))
    ([113, 168, 223], True)
    """
    cpt = engine.chars_per_token
    lo, hi = (int(x) for x in args.turns.split(","))
    ulo, uhi = (int(x) for x in args.user_tokens.split(","))
    systems = {f"app{t}": f"system: you are app {t}'s assistant. " + random_text(random.Random(f"sys-{t}"),
                                                                                 int(args.system_tokens * cpt))
               for t in range(args.tenants)}
    out = []
    for sid in range(args.sessions):
        rng = random.Random(f"{args.seed}-session-{sid}")
        tenant = f"app{sid % args.tenants}"
        history = systems[tenant]
        turns = []
        for k in range(1, rng.randint(lo, hi) + 1):
            prompt = history + "\nuser: " + random_text(rng, int(rng.randint(ulo, uhi) * cpt)) + "\nassistant:"
            turns.append(Turn(sid, k, tenant, prompt, args.think_s * rng.uniform(0.5, 1.5)))
            history = prompt + " " + random_text(rng, int(args.max_tokens * cpt))
        out.append(turns)
    return out


async def run_arm(args: argparse.Namespace, arm: str, sessions: list[list[Turn]]) -> dict[str, Any]:
    scheduler_env, worker_env, own_tenant = arm_settings(arm, args.engine)
    engine = engine_for(args, worker_env=worker_env)
    results: list[tuple[Turn, Result]] = []
    gate = asyncio.Semaphore(args.concurrent)

    async def converse(turns: list[Turn], delay: float) -> None:
        async with gate:
            await asyncio.sleep(delay)
            for t in turns:
                tenant = f"{t.tenant}/s{t.session}/t{t.turn}" if own_tenant else t.tenant
                spec = RequestSpec(request_id=f"s{t.session}-t{t.turn}", priority="P0", tenant=tenant,
                                   prompt=t.prompt, max_tokens=args.max_tokens, deadline_s=300.0,
                                   session_id=f"session-{t.session}")
                results.append((t, await client.run(spec)))
                await asyncio.sleep(t.think_s * engine.scale)

    async with fleet(engine, base_port=args.base_port, logdir=LOGS / NAME, scheduler_env=scheduler_env,
                     name=f"scheduler-{arm}") as f:
        workers = await worker_info(f)
        client = LeaseClient(f.scheduler_addr, rng=random.Random(args.seed))
        rng = random.Random(args.seed)
        start = time.monotonic()
        # the first wave starts spread over a think time, not all at once
        await asyncio.gather(*(converse(s, rng.uniform(0, args.think_s * engine.scale) if i < args.concurrent
                                        else 0.0) for i, s in enumerate(sessions)))
        wall = time.monotonic() - start
        await client.close()
    return {"arm": arm, "description": ARMS[arm], "scheduler_env": scheduler_env, "worker_env": worker_env,
            "own_tenant_per_request": own_tenant, "engine": engine.describe(), "workers": workers,
            **analyse_arm(results, engine.scale, wall, args)}


def analyse_arm(results: list[tuple[Turn, Result]], scale: float, wall_s: float,
                args: argparse.Namespace) -> dict[str, Any]:
    slo = p0_slo(args.engine)
    by_turn: dict[int, list[Result]] = {}
    for t, r in results:
        by_turn.setdefault(t.turn, []).append(r)
    turns = []
    for k in sorted(by_turn):
        ss = samples(by_turn[k], scale)
        prompt = sum(s.prompt_tokens for s in ss)
        turns.append({"turn": k, "n": len(by_turn[k]), "served": len(ss),
                      "ttft": summarize([s.ttft_s for s in ss]),
                      "prompt_tokens_mean": prompt / len(ss) if ss else None,
                      "cached_share": sum(s.cached_tokens for s in ss) / prompt if prompt else None})
    last_worker: dict[int, str] = {}
    same = moved = 0
    for t, r in sorted(results, key=lambda x: (x[0].session, x[0].turn)):
        if t.turn > 1 and t.session in last_worker and r.outcome == "ok":
            same += r.worker == last_worker[t.session]
            moved += r.worker != last_worker[t.session]
        if r.outcome == "ok":
            last_worker[t.session] = r.worker
    everything = [r for _, r in results]
    later = [r for t, r in results if t.turn >= LATER_TURN]
    return {
        "turns": turns,
        "all": latency_stats(samples(everything, scale), slo, window_s=wall_s / scale, offered=len(everything)),
        "later": latency_stats(samples(later, scale), slo, window_s=wall_s / scale, offered=len(later)),
        "same_worker_share": same / (same + moved) if same + moved else None,
        "placement_reasons": dict(Counter(r.reason or "-" for r in everything).most_common()),
        "failed": sum(1 for r in everything if r.outcome != "ok"),
        "errors": sorted({(r.error or r.outcome)[:120] for r in everything if r.outcome != "ok"})[:5],
        "wall_s": wall_s,
    }


async def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    slo = p0_slo(args.engine)
    sessions = conversations(args, engine_for(args))
    n_turns = Counter(len(s) for s in sessions)
    report: dict[str, Any] = {
        "machine": machine_info(), "slo": asdict(slo),
        "setup": {"sessions": args.sessions, "concurrent": args.concurrent, "turns": args.turns,
                  "turn_counts": dict(sorted(n_turns.items())), "requests": sum(len(s) for s in sessions),
                  "system_tokens": args.system_tokens, "tenants": args.tenants, "user_tokens": args.user_tokens,
                  "max_tokens": args.max_tokens, "think_s": args.think_s, "seed": args.seed,
                  "longest_prompt_chars": max(len(t.prompt) for s in sessions for t in s)},
        "arms": {},
    }
    for arm in args.arms.split(","):
        result = await run_arm(args, arm, sessions)
        report["engine"] = result.pop("engine")
        report["arms"][arm] = result
        a = result["all"]
        print(f"[{arm}] TTFT p50 {a['ttft']['p50_ms'] or 0:.0f} ms p95 {a['ttft']['p95_ms'] or 0:.0f} ms; later turns "
              f"p50 {result['later']['ttft']['p50_ms'] or 0:.0f} ms; cached {(a['cached_share'] or 0) * 100:.0f}%; "
              f"same worker {(result['same_worker_share'] or 0) * 100:.0f}%; {result['failed']} failed", flush=True)
    report["engine"]["worker_env"] = {}  # per arm, below
    return report


# ---- report (the prose: templates/multiturn.md) ----------------------------------------------------------------


def later_p50(report: dict[str, Any], arm: str) -> float | None:
    """The arm's TTFT p50 over turns ``LATER_TURN``+ (ms)."""
    return report["arms"][arm]["later"]["ttft"]["p50_ms"]


def goals(report: dict[str, Any]) -> list[bench.Goal]:
    """What caching and session affinity save: each other arm's TTFT p50 on the later turns against affinity's."""
    def vs_affinity(arm: str) -> Any:
        return lambda r: (later_p50(r, arm), later_p50(r, "affinity"))

    others = [arm for arm in report["arms"] if arm != "affinity"] if "affinity" in report["arms"] else []
    return [bench.Goal(f"turns {LATER_TURN}+: {arm}'s TTFT p50 ≥ 1x affinity's", vs_affinity(arm), 1.0,
                       judged="ratio", digits=0) for arm in others]


def context(report: dict[str, Any]) -> dict[str, Any]:
    """Per turn, each arm's row (None where the arm had no such turn); the longest prompt in tokens; whether the
    gateway's 512-character prefix hint falls inside the system prompt."""
    arms, s = report["arms"], report["setup"]
    cpt = CHARS_PER_TOKEN[report["engine"]["engine"]]
    turns = sorted({row["turn"] for a in arms.values() for row in a["turns"]})
    per_turn = [[next((x for x in a["turns"] if x["turn"] == k), None) for a in arms.values()] for k in turns]
    return {"per_turn": [(k, next(r for r in rows if r is not None), rows) for k, rows in zip(turns, per_turn,
                                                                                              strict=True)],
            "later_turn": LATER_TURN, "longest_prompt_tokens": s["longest_prompt_chars"] // cpt,
            "hint_in_system_prompt": s["system_tokens"] * cpt >= 512}


def figure(report: dict[str, Any]) -> bench.Figure:
    """TTFT p50/p95 and the cached share per turn, every arm."""
    arms = report["arms"]
    colour = {name: f"C{i}" for i, name in enumerate(arms)}
    xs = {name: [row["turn"] for row in a["turns"]] for name, a in arms.items()}
    ttft = bench.Panel("TTFT per turn", "turn", "TTFT (ms, log)", [
        bench.Series(f"{name} {q}", xs[name], [row["ttft"][f"{q}_ms"] for row in a["turns"]], style, colour[name])
        for name, a in arms.items() for q, style in (("p50", "-"), ("p95", ":"))], yscale="log", legend_size=7)
    cached = bench.Panel("prefix-cache hits per turn", "turn", "% of the prompt served from the prefix cache", [
        bench.Series(name, xs[name], [(row["cached_share"] or 0) * 100 for row in a["turns"]], color=colour[name])
        for name, a in arms.items()], legend_size=7)
    return bench.Figure(figure_title(report, "Multi-turn conversations"), [ttft, cached])


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--arms", default=None, help=f"comma-separated, of: {', '.join(ARMS)}")
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--concurrent", type=int, default=None, help="sessions at a time")
    ap.add_argument("--turns", default=None, help="MIN,MAX turns per session")
    ap.add_argument("--system-tokens", type=int, default=None)
    ap.add_argument("--tenants", type=int, default=None, help="tenants (apps), each with its own system prompt")
    ap.add_argument("--user-tokens", default=None, help="MIN,MAX tokens of a user message")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens of an answer")
    ap.add_argument("--think-s", type=float, default=None, help="think time after an answer (engine time)")


def prepare(ap: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    unknown = set(args.arms.split(",")) - set(ARMS)
    if unknown:
        ap.error(f"unknown arms: {', '.join(sorted(unknown))}")


BENCHMARK = declare(NAME, __doc__ or "", benchmark, presets=PRESETS, base_port=31200, arguments=add_arguments,
                    prepare=prepare, goals=goals, context=context, figure=figure,
                    ok=lambda report: any(a["all"]["served"] for a in report["arms"].values()))


def main(argv: list[str] | None = None) -> int:
    return bench.main(BENCHMARK, argv)


if __name__ == "__main__":
    sys.exit(main())
