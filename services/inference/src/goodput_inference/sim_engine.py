"""A simulated engine for capacity experiments (``GOODPUT_INFERENCE_ENGINE=sim``; never the default).

It implements the same :class:`~goodput_inference.engine.Engine` protocol as the vLLM adapter and is served by the
same servicer, so the scheduler and the gateway cannot tell it from a real worker. It runs no model: it advances a
model of vLLM's continuous batching in (scaled) wall-clock time and streams placeholder text.

The model, one engine step at a time (vLLM v1 with chunked prefill):

* a step runs every running sequence's decode plus prefill chunks of new prompts, up to
  ``max_batched_tokens`` tokens in all;
* step time = ``step_base_s`` + ``step_per_seq_s`` x sequences in the batch + ``prefill_s_per_token`` x prompt
  tokens prefilled in the step (decode is memory-bound: the weights are read once per step whatever the batch, each
  extra sequence adds its KV reads; prefill is compute-bound, linear in tokens);
* the KV cache holds ``kv_blocks`` blocks of ``block_tokens`` tokens; a request is admitted only when its blocks fit;
  waiting requests are taken in priority order (``scheduling_policy=priority``) or arrival order;
* prefix caching: blocks are hashed as a chain seeded with the tenant's cache salt (as vLLM salts the first
  block); blocks already cached are not prefilled again (each request reports them as its ``cached_tokens``),
  requests that end (finished or aborted) leave the full blocks they computed cached, their answers' included,
  evicted least recently used when new requests need room.

Calibration (defaults of :class:`SimParams`): a 7B Llama-class model in fp16 on one A100-80GB-SXM under vLLM.

* Decode: a step reads the ~13.5 GB of weights once; at the A100's 2.0 TB/s that is 6.7 ms, and vLLM's measured
  inter-token latency for 7B models at low concurrency is ~12 ms, rising to ~30 ms at 64 concurrent sequences
  (Lambda Labs, "vLLM benchmark" of Llama/Mistral 7B on A100-80GB-SXM, github.com/LambdaLabsML/vllm-benchmark;
  Kwon et al., "Efficient Memory Management for Large Language Model Serving with PagedAttention", SOSP 2023,
  which reports the same memory-bound decode regime for 7B-13B models on A100). Hence 12 ms + 0.3 ms/sequence.
* Prefill: ~14 GFLOP per token for 7B parameters; at ~50% of the A100's 312 TFLOPS that is ~0.09 ms/token, and
  the published TTFT of ~60 ms for a 512-token prompt at low load gives ~0.12 ms/token (incl. the step overhead).
* KV cache: 2 x 32 layers x 4096 x 2 bytes = 0.5 MB per token; 0.9 x 80 GB less weights leaves ~58 GB, ~110k
  tokens: 7000 blocks of 16 tokens.

These are round numbers read from public figures, good to within tens of percent; capacity experiments compare
policies on the same simulated fleet, which is what they are for.

Example::

    engine = SimEngine(settings, params=SimParams(time_scale=4.0))
    await engine.start()
    async for event in engine.generate(GenRequest(request_id="r1", prompt="Hello")):
        print(event)
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import heapq
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, fields
from typing import Any

from goodput_core.errors import InvalidArgument, Unavailable

from goodput_inference.config import InferenceSettings
from goodput_inference.engine import (
    Delta,
    EngineTiming,
    Finished,
    GenEvent,
    GenRequest,
    Load,
    ModelDescription,
    Started,
    check_model,
    continue_answer,
    max_tokens_for,
    prompt_limit,
    truncate,
)
from goodput_inference.tenancy import CacheSalts

log = logging.getLogger("goodput.inference.sim")

__all__ = ["SimEngine", "SimParams"]

_TOKEN, _TOKEN_ID = " tok", 1  # every placeholder token's text and id


@dataclass(frozen=True)
class SimParams:
    """Engine model parameters; the defaults are the A100 / 7B calibration above."""

    prefill_s_per_token: float = 0.00012
    step_base_s: float = 0.012
    step_per_seq_s: float = 0.0003
    kv_blocks: int = 7000
    block_tokens: int = 16
    max_batched_tokens: int = 2048  # vLLM v1's default for online serving on A100-class GPUs
    chars_per_token: float = 4.0
    # Multiplies every simulated duration: >1 slows the simulated GPU down so a benchmark's own Python overhead
    # (gRPC, scheduler) stays small next to it on a small machine.
    time_scale: float = 1.0
    # Stream a Delta every this many tokens (the first token always at once), to spare small machines.
    stream_every: int = 1

    @classmethod
    def from_dict(cls, doc: dict[str, Any] | None) -> SimParams:
        doc = dict(doc or {})
        known = {f.name for f in fields(cls)}
        unknown = set(doc) - known
        if unknown:
            raise ValueError(f"unknown sim parameters: {', '.join(sorted(unknown))}; known: {', '.join(sorted(known))}")
        return cls(**doc)

    def step_seconds(self, batch: int, prefill_tokens: int) -> float:
        if batch == 0:
            return 0.0
        return self.step_base_s + self.step_per_seq_s * batch + self.prefill_s_per_token * prefill_tokens


@dataclass(eq=False)
class _Seq:
    request_id: str
    priority: int
    arrival: int
    prompt_tokens: int
    max_tokens: int
    block_hashes: list[bytes]
    events: asyncio.Queue[GenEvent | None] = field(default_factory=asyncio.Queue)
    cached_tokens: int = 0
    prefill_left: int = 0
    generated: int = 0
    private_blocks: int = 0
    pinned: list[bytes] = field(default_factory=list)
    aborted: bool = False
    streamed: int = 0
    continued: int = 0  # of the tokens prefilled, the answer's generated by an earlier call (a continuation)
    text: str = ""  # the prompt's (a continuation's answer so far included) and its cache salt: what its blocks hash
    salt: str = ""
    queued_at: float = field(default_factory=time.monotonic)  # the engine's timestamps (EngineTiming)
    scheduled_at: float = 0.0
    first_at: float = 0.0


class SimEngine:
    def __init__(self, settings: InferenceSettings, *, params: SimParams | None = None,
                 served_model_name: str = "sim-7b", salts: CacheSalts | None = None) -> None:
        self.settings = settings
        self.salts = salts or CacheSalts.from_settings(settings)
        self.params = params or SimParams.from_dict(settings.sim_config)
        self.served_model_name = settings.served_model_name or served_model_name
        self._waiting: list[tuple[tuple[int, int], _Seq]] = []
        self._running: list[_Seq] = []
        self._cache: collections.OrderedDict[bytes, int] = collections.OrderedDict()  # hash -> pin count
        self._private_blocks = 0
        self._seq = itertools.count()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._ready = False
        self._aborted = 0
        self._finished = 0
        self.prefix_hit_tokens = 0
        self.prompt_tokens_total = 0

    # ---- lifecycle -------------------------------------------------------------------------------------------

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="sim-engine")
        self._ready = True
        log.info("simulated engine ready", extra={"params": str(self.params)})

    async def shutdown(self) -> None:
        self._ready = False
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def describe(self) -> ModelDescription:
        return ModelDescription(served_model_name=self.served_model_name, model="simulated-7b",
                                max_model_len=self.settings.max_model_len,
                                max_prompt_tokens=self._max_prompt_tokens(), engine="sim",
                                model_version="sim-a100-7b", max_num_batched_tokens=self.params.max_batched_tokens)

    def numerics(self) -> dict[str, str]:
        return {"engine": "sim", "device": "simulated", "dtype": "none", "kv_cache_dtype": "none"}

    def load(self) -> Load:
        used = self._private_blocks + sum(1 for pins in self._cache.values() if pins > 0)
        return Load(running=len(self._running), waiting=len(self._waiting),
                    kv_cache_usage=min(used / self.params.kv_blocks, 1.0), gpu_utilization=-1.0,
                    max_num_seqs=self.settings.max_num_seqs, aborted_total=self._aborted,
                    finished_total=self._finished, ready=self._ready,
                    prefix_cache_queries=self.prompt_tokens_total, prefix_cache_hits=self.prefix_hit_tokens)

    def _max_prompt_tokens(self) -> int:
        return prompt_limit(self.settings.max_model_len, self.settings.max_prompt_tokens)

    # ---- requests --------------------------------------------------------------------------------------------

    def _text(self, request: GenRequest) -> str:
        if request.messages:
            return "".join(f"{t.role}:{t.content}\n" for t in request.messages)
        if request.prompt:
            return request.prompt
        raise InvalidArgument("either messages or prompt is required", param="messages")

    def _hashes(self, text: str, prompt_tokens: int, salt: str = "", known: list[bytes] | None = None) -> list[bytes]:
        """The chain of the full blocks' hashes; ``known``: the chain of a prefix of ``text``, taken as it is."""
        chars = int(self.params.block_tokens * self.params.chars_per_token)
        blocks = prompt_tokens // self.params.block_tokens
        out = (known or [])[:blocks]
        prev = out[-1] if out else salt.encode()
        for i in range(len(out), blocks):
            prev = hashlib.blake2b(prev + text[i * chars:(i + 1) * chars].encode("utf-8", "surrogatepass"),
                                   digest_size=8).digest()
            out.append(prev)
        return out

    async def generate(self, request: GenRequest) -> AsyncIterator[GenEvent]:
        if not self._ready:
            raise Unavailable("the engine is not ready (loading or draining)")
        check_model(request, self.served_model_name)
        s = request.sampling
        # Refused by name: a placeholder answer has no schema, logits, probabilities or token ids, and is only one.
        for refused, param, what in ((s.structured, "response_format", "structured output (response_format)"),
                                     (s.n > 1, "n", "n > 1"), (bool(s.logit_bias), "logit_bias", "logit_bias"),
                                     (s.logprobs is not None, "logprobs", "logprobs"),
                                     (bool(s.stop_token_ids), "stop_token_ids", "stop_token_ids")):
            if refused:
                raise InvalidArgument(f"the simulated engine does not implement {what}", param=param,
                                      code="unsupported_parameter")
        if request.tools:  # nor a model that could choose to call a function
            raise InvalidArgument("the simulated engine has no tool-call parser: tool_choice 'auto' is not "
                                  "implemented", param="tool_choice", code="unsupported_value")
        text = self._text(request)
        prompt_tokens = max(1, math.ceil(len(text) / self.params.chars_per_token))
        if s.truncate_prompt_tokens is not None:  # the prompt's last tokens, as vLLM keeps them
            prompt_tokens = len(truncate(list(range(prompt_tokens)), s.truncate_prompt_tokens,
                                         self._max_prompt_tokens()))
            text = text[-math.ceil(prompt_tokens * self.params.chars_per_token):]
        if prompt_tokens > self._max_prompt_tokens():
            raise InvalidArgument(f"prompt has {prompt_tokens} tokens; the limit is {self._max_prompt_tokens()}",
                                  param="messages", code="context_length_exceeded")
        max_tokens = max_tokens_for(prompt_tokens, s, default_max_tokens=self.settings.default_max_tokens,
                                    max_model_len=self.settings.max_model_len)
        done = len(request.continuation)
        if done:  # the answer so far is prefilled after the prompt, and counts in the answer
            continue_answer(request, max_tokens)
            text += _TOKEN * done
        priority = max(request.priority - 1, 0) if self.settings.scheduling_policy == "priority" else 0
        salt = self.salts.salt(request.tenant)
        seq = _Seq(request_id=request.request_id, priority=priority, arrival=next(self._seq),
                   prompt_tokens=prompt_tokens + done, max_tokens=max_tokens, generated=done, streamed=done,
                   continued=done, text=text, salt=salt, block_hashes=self._hashes(text, prompt_tokens + done, salt))
        heapq.heappush(self._waiting, ((seq.priority, seq.arrival), seq))
        self._wake.set()
        finished = False
        try:
            yield Started(prompt_tokens=prompt_tokens)
            while (event := await seq.events.get()) is not None:
                if isinstance(event, Finished):
                    finished = True
                yield event
        finally:
            if not finished:
                seq.aborted = True
                self._aborted += 1
                self._wake.set()

    # ---- the engine loop -------------------------------------------------------------------------------------

    async def _loop(self) -> None:
        p = self.params
        while True:
            if not self._running and not self._waiting:
                self._wake.clear()
                await self._wake.wait()
                continue
            self._reap_aborted()
            self._admit()
            budget = p.max_batched_tokens - sum(1 for s in self._running if s.prefill_left == 0)
            prefill_tokens = 0
            for s in self._running:
                if s.prefill_left > 0 and budget > 0:
                    chunk = min(s.prefill_left, budget)
                    s.prefill_left -= chunk
                    budget -= chunk
                    prefill_tokens += chunk
                    if s.prefill_left == 0:
                        s.prefill_left = -1  # finishes its prefill in this step: first token at the end
            batch = len(self._running)
            if batch == 0:
                # Nothing fits (KV full of cached blocks cannot happen: they are evictable); wait for a change.
                self._wake.clear()
                await self._wake.wait()
                continue
            started = time.monotonic()
            await asyncio.sleep(p.step_seconds(batch, prefill_tokens) * p.time_scale)
            self._advance(time.monotonic() - started)

    def _reap_aborted(self) -> None:
        if any(s.aborted for _, s in self._waiting):
            self._waiting = [(k, s) for k, s in self._waiting if not s.aborted]
            heapq.heapify(self._waiting)
        for s in [s for s in self._running if s.aborted]:
            self._finish(s)

    def _admit(self) -> None:
        p = self.params
        while self._waiting and len(self._running) < self.settings.max_num_seqs:
            _, s = self._waiting[0]
            # As in vLLM, the prompt's last token is always computed (its logits give the first output token), so
            # a hit covers at most the full blocks before it.
            cached = 0
            for h in s.block_hashes[:(s.prompt_tokens - 1) // p.block_tokens]:
                if h not in self._cache:
                    break
                cached += 1
            need = math.ceil((s.prompt_tokens + s.max_tokens) / p.block_tokens) - cached
            if not self._make_room(need):
                break  # the head waits for blocks (no preemption in this model)
            heapq.heappop(self._waiting)
            for h in s.block_hashes[:cached]:
                self._cache[h] += 1
                self._cache.move_to_end(h)
            s.pinned = list(s.block_hashes[:cached])
            s.cached_tokens = cached * p.block_tokens
            s.prefill_left = max(s.prompt_tokens - s.cached_tokens, 1)
            s.private_blocks = need
            self._private_blocks += need
            self.prefix_hit_tokens += s.cached_tokens
            self.prompt_tokens_total += s.prompt_tokens
            s.scheduled_at = time.monotonic()
            self._running.append(s)

    def _make_room(self, need: int) -> bool:
        total = self.params.kv_blocks
        while self._private_blocks + len(self._cache) + need > total:
            victim = next((h for h, pins in self._cache.items() if pins == 0), None)
            if victim is None:
                return self._private_blocks + sum(1 for v in self._cache.values() if v) + need <= total
            del self._cache[victim]
        return True

    def _advance(self, elapsed: float) -> None:
        every = max(self.params.stream_every, 1)
        for s in list(self._running):
            if s.aborted:
                self._finish(s)
                continue
            if s.prefill_left > 0:
                continue  # still prefilling (chunked)
            s.prefill_left = 0
            s.generated += 1
            now = time.monotonic()
            if s.generated == s.continued + 1:
                s.first_at = now
            done = s.generated >= s.max_tokens
            if s.generated == s.continued + 1 or done or s.generated - s.streamed >= every:
                n = s.generated - s.streamed
                s.streamed = s.generated
                s.events.put_nowait(Delta(text=_TOKEN * n, completion_tokens=s.generated, token_ids=(_TOKEN_ID,) * n))
            if done:
                timing = EngineTiming(queued_s=max(s.scheduled_at - s.queued_at, 0.0),
                                      prefill_s=max(s.first_at - s.scheduled_at, 0.0), decode_s=now - s.first_at)
                s.events.put_nowait(Finished(reason="length", prompt_tokens=s.prompt_tokens - s.continued,
                                             completion_tokens=s.generated, cached_tokens=s.cached_tokens,
                                             timing=timing))
                self._finished += 1
                self._finish(s)

    def _finish(self, s: _Seq) -> None:
        if s in self._running:
            self._running.remove(s)
        self._private_blocks -= s.private_blocks
        s.private_blocks = 0
        for h in s.pinned:
            if h in self._cache:
                self._cache[h] -= 1
        s.pinned = []
        # Every full block it computed stays cached (evictable), its answer's as well as its prompt's, finished or
        # aborted, as in vLLM's prefix cache: the next request with the same prefix, or a continuation of this
        # answer, hits them.
        if s.prefill_left > 0:
            computed, text = s.prompt_tokens - s.prefill_left, s.text
        else:
            answered = s.generated - s.continued
            computed, text = s.prompt_tokens + answered, s.text + _TOKEN * answered
        for h in self._hashes(text, computed, s.salt, known=s.block_hashes):
            if h in self._cache:
                self._cache.move_to_end(h)
            else:
                self._cache[h] = 0
        self._make_room(0)
        s.events.put_nowait(None)
