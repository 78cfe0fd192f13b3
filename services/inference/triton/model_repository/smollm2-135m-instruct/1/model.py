"""The dev model on Triton's Python backend: SmolLM2-135M-Instruct with transformers and torch on the CPU, as a
decoupled model that streams real generated tokens.

Its interface is that of Triton's vLLM backend, so the worker's ``engine=triton`` talks to it and to a production
vLLM (or, through the same text interface, TensorRT-LLM) model alike:

* inputs ``text_input`` (the rendered prompt), optional ``stream``, ``sampling_parameters`` (JSON: ``max_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``seed``, ``stop``, ``presence_penalty``, ``frequency_penalty``,
  ``ignore_eos``, ``min_tokens``; any other is refused by name), ``exclude_input_in_output``, the flags
  ``return_finish_reason``, ``return_num_input_tokens``, ``return_num_output_tokens``, and ``cache_salt`` (the
  tenant's prefix-cache salt, what vLLM takes as the prompt's ``cache_salt``);
* outputs ``text_output`` (streaming: the new text of each response), and when asked ``finish_reason`` (``"None"``
  until the last response, then ``stop`` or ``length``), ``num_input_tokens``, ``num_output_tokens`` (tokens of
  this response).

Each request runs in a thread of its own (the backend's decoupled pattern: ``execute`` returns at once), at most
``max_num_seqs`` at a time; the others wait for a slot. A request the client cancels (its stream closed,
``request.is_cancelled()``) stops generating at the next token and frees its slot. Requests running and waiting
are published as the custom metrics ``goodput_model_requests_running`` / ``goodput_model_requests_waiting``.

A prefix cache keeps the KV cache of the last ``prefix_cache_entries`` prompts: a prompt reuses the longest start it
shares with a kept prompt *of the same cache salt* (never another salt's, as vLLM salts its block hashes), all but its
last token, and prefills the rest. Prompt tokens looked up and found are the counters
``goodput_model_prefix_cache_queries`` / ``goodput_model_prefix_cache_hits`` (vLLM's ``prefix_cache_queries`` /
``hits``).

Generation is a plain token loop over the model's KV cache: greedy at temperature 0, otherwise sampling with
temperature, top-k and top-p (a seeded generator when ``seed`` is given); unset values take the model's
generation_config, as vLLM does. Stop strings are cut from the output, and text that could be the start of one is
held back until it is known not to be.

Run by ``tritonserver --model-repository services/inference/triton/model_repository`` with the Python backend of
``nvidia-pytriton`` (``scripts/install-triton.sh``, ``python -m goodput_inference.triton_server``); not imported by
the worker.
"""

from __future__ import annotations

import copy
import json
import os
import threading
import time
from collections import OrderedDict
from typing import Any

import numpy as np
import torch
import triton_python_backend_utils as pb_utils
from transformers import AutoModelForCausalLM, AutoTokenizer

_SAMPLING_KEYS = {"max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "presence_penalty",
                  "frequency_penalty", "ignore_eos", "min_tokens"}
_DEFAULT_MAX_TOKENS = 16  # vLLM's SamplingParams default, which its Triton backend inherits


class TritonPythonModel:
    def initialize(self, args: dict[str, Any]) -> None:
        config = json.loads(args["model_config"])
        params = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        model_dir = params.get("model_dir") or os.environ.get("GOODPUT_TRITON_MODEL_DIR", "")
        if not model_dir or not os.path.isdir(model_dir):
            raise pb_utils.TritonModelException(
                f"no model folder: set the model_dir parameter or GOODPUT_TRITON_MODEL_DIR (got {model_dir!r})")
        self.logger = pb_utils.Logger
        self.max_model_len = int(params.get("max_model_len") or 2048)
        threads = int(params.get("torch_threads") or 0)  # 0: torch's default (every core)
        if threads:
            torch.set_num_threads(threads)
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        gen = self.model.generation_config
        self.defaults = {"temperature": float(gen.temperature if gen.do_sample and gen.temperature is not None
                                              else 1.0),
                         "top_p": float(gen.top_p if gen.do_sample and gen.top_p is not None else 1.0),
                         "top_k": int(gen.top_k or 0) if gen.do_sample else 0}
        eos = gen.eos_token_id if gen.eos_token_id is not None else self.tokenizer.eos_token_id
        self.eos_ids = set(eos if isinstance(eos, list) else [eos])
        self.slots = threading.BoundedSemaphore(int(params.get("max_num_seqs") or 4))
        self.prefixes = _PrefixCache(int(params.get("prefix_cache_entries") or 0))
        self.closing = threading.Event()
        self.lock = threading.Lock()
        self.threads: set[threading.Thread] = set()
        self.running = self.waiting = 0
        labels = {"model": args["model_name"], "version": args["model_version"]}
        # The families are kept: a metric outlived by its family can no longer be set.
        self.families = [pb_utils.MetricFamily(name=name, description=doc, kind=pb_utils.MetricFamily.GAUGE)
                         for name, doc in (("goodput_model_requests_running", "Requests generating tokens."),
                                           ("goodput_model_requests_waiting", "Requests waiting for a slot."))]
        self.running_gauge, self.waiting_gauge = (family.Metric(labels=labels) for family in self.families)
        self.families += [pb_utils.MetricFamily(name=name, description=doc, kind=pb_utils.MetricFamily.COUNTER)
                          for name, doc in (("goodput_model_prefix_cache_queries", "Prompt tokens looked up in the "
                                             "prefix cache."),
                                            ("goodput_model_prefix_cache_hits", "Prompt tokens found in the prefix "
                                             "cache (of the same cache salt)."))]
        self.queries_counter, self.hits_counter = (family.Metric(labels=labels) for family in self.families[2:])
        self.logger.log_info(f"loaded {model_dir} (float32, CPU, {torch.get_num_threads()} threads)")

    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            thread = threading.Thread(target=self._serve, args=(request,), daemon=True)
            with self.lock:
                self.threads.add(thread)
            thread.start()
        return None

    def finalize(self) -> None:
        self.closing.set()
        with self.lock:
            threads = list(self.threads)
        for thread in threads:
            thread.join(timeout=10)

    # ---- one request ----------------------------------------------------------------------------------------

    def _count(self, running: int = 0, waiting: int = 0) -> None:
        with self.lock:
            self.running += running
            self.waiting += waiting
            self.running_gauge.set(self.running)
            self.waiting_gauge.set(self.waiting)

    def _serve(self, request: Any) -> None:
        sender = request.get_response_sender()
        try:
            self._count(waiting=1)
            acquired = False
            try:
                while not acquired:
                    if self.closing.is_set() or _cancelled(request):
                        sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                        return
                    acquired = self.slots.acquire(timeout=0.05)
            finally:
                self._count(waiting=-1)
            self._count(running=1)
            try:
                self._generate(request, sender)
            finally:
                self._count(running=-1)
                self.slots.release()
        except Exception as err:  # noqa: BLE001 - every failure becomes the request's error response
            self.logger.log_error(f"request failed: {err!r}")
            sender.send(pb_utils.InferenceResponse(error=pb_utils.TritonError(str(err))),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
        finally:
            with self.lock:
                self.threads.discard(threading.current_thread())

    def _generate(self, request: Any, sender: Any) -> None:
        prompt = _input(request, "text_input")
        prompt = prompt.decode("utf-8") if isinstance(prompt, bytes) else str(prompt)
        stream = bool(_input(request, "stream", False))
        exclude = _input(request, "exclude_input_in_output", None)
        prepend = not stream and not bool(exclude) if exclude is not None else not stream
        flags = {name: bool(_input(request, name, False)) for name in
                 ("return_finish_reason", "return_num_input_tokens", "return_num_output_tokens")}
        salt = _input(request, "cache_salt", b"")
        salt = salt.decode("utf-8") if isinstance(salt, bytes) else str(salt)
        raw = _input(request, "sampling_parameters", None)
        sampling = json.loads(raw.decode("utf-8") if isinstance(raw, bytes) else raw) if raw is not None else {}
        unknown = set(sampling) - _SAMPLING_KEYS
        if unknown:
            raise ValueError(f"unsupported sampling parameters {sorted(unknown)}; this model takes "
                             f"{sorted(_SAMPLING_KEYS)}")
        ids = self.tokenizer(prompt, add_special_tokens=True)["input_ids"]
        max_tokens = int(sampling.get("max_tokens") or _DEFAULT_MAX_TOKENS)
        if len(ids) + max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) plus max_tokens ({max_tokens}) exceeds the context "
                             f"window of {self.max_model_len} tokens")
        stops = sampling.get("stop") or []
        stops = [stops] if isinstance(stops, str) else [s for s in stops if s]
        picker = _Picker(sampling, self.defaults)
        ignore_eos = bool(sampling.get("ignore_eos", False))
        min_tokens = int(sampling.get("min_tokens") or 0)  # EOS cannot end the answer before it

        def respond(text: str, tokens: int, reason: str | None, final: bool) -> None:
            tensors = [pb_utils.Tensor("text_output", np.array([text.encode("utf-8")], dtype=np.object_))]
            if flags["return_finish_reason"]:
                tensors.append(pb_utils.Tensor("finish_reason", np.array([str(reason).encode()], dtype=np.object_)))
            if flags["return_num_input_tokens"]:
                tensors.append(pb_utils.Tensor("num_input_tokens", np.array([len(ids)], dtype=np.uint32)))
            if flags["return_num_output_tokens"]:
                tensors.append(pb_utils.Tensor("num_output_tokens", np.array([tokens], dtype=np.uint32)))
            sender.send(pb_utils.InferenceResponse(output_tensors=tensors),
                        flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL if final else 0)

        generated: list[int] = []
        text = ""  # the answer so far (decoded whole each token: a token may complete a character)
        sent = ""  # text already sent (streaming)
        unsent_tokens = 0  # tokens not yet reported in num_output_tokens
        reason = "length"
        started = time.monotonic()
        with torch.inference_mode():
            reused, cached = self.prefixes.take(salt, ids)
            out = self.model(torch.tensor([ids[reused:]]), past_key_values=cached, use_cache=True)
            self.prefixes.put(salt, ids, out.past_key_values)  # a copy: generation goes on in this one
            self.queries_counter.increment(len(ids))
            self.hits_counter.increment(reused)
            while True:
                if self.closing.is_set() or _cancelled(request):
                    self.logger.log_info(f"request cancelled after {len(generated)} tokens")
                    sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
                    return
                logits = out.logits[0, -1].float()
                token = picker.pick(logits, generated)
                if token in self.eos_ids and not ignore_eos and len(generated) >= min_tokens:
                    reason = "stop"
                    break
                generated.append(token)
                unsent_tokens += 1
                text = self.tokenizer.decode(generated, skip_special_tokens=True)
                cut = _stop_at(text, stops)
                if cut is not None:
                    text, reason = text[:cut], "stop"
                    break
                if len(generated) >= max_tokens:
                    break
                if stream:
                    ready = _releasable(text, stops)
                    if len(ready) > len(sent):
                        respond(ready[len(sent):], unsent_tokens, None, final=False)
                        sent, unsent_tokens = ready, 0
                out = self.model(torch.tensor([[token]]), past_key_values=out.past_key_values, use_cache=True)
        if stream:
            respond(text[len(sent):], unsent_tokens, reason, final=True)
        else:
            respond((prompt if prepend else "") + text, len(generated), reason, final=True)
        self.logger.log_verbose(f"generated {len(generated)} tokens in {time.monotonic() - started:.2f} s "
                                f"({reason})")


class _PrefixCache:
    """The KV caches of the last ``entries`` prompts, by cache salt and tokens (least recently used dropped first)."""

    def __init__(self, entries: int) -> None:
        self.entries = entries
        self.kept: OrderedDict[tuple[str, tuple[int, ...]], Any] = OrderedDict()
        self.lock = threading.Lock()

    def take(self, salt: str, ids: list[int]) -> tuple[int, Any]:
        """(tokens reused, a copy of their KV cache, or None): the longest start ``ids`` shares with a kept prompt
        of ``salt``, all but its last token at most (that one is run for the next token's logits)."""
        best, found = 0, None
        with self.lock:
            for key in self.kept:
                if key[0] == salt and (n := _shared(key[1], ids)) > best:
                    best, found = n, key
            if found is None:
                return 0, None
            self.kept.move_to_end(found)
            kept = self.kept[found]
        reused = min(best, len(ids) - 1)
        if reused <= 0:
            return 0, None
        cache = copy.deepcopy(kept)  # a kept cache is never written to
        if cache.get_seq_length() > reused:
            cache.crop(reused - cache.get_seq_length())
        return reused, cache

    def put(self, salt: str, ids: list[int], cache: Any) -> None:
        if self.entries <= 0:
            return
        kept = copy.deepcopy(cache)
        with self.lock:
            self.kept[(salt, tuple(ids))] = kept
            self.kept.move_to_end((salt, tuple(ids)))
            while len(self.kept) > self.entries:
                self.kept.popitem(last=False)


def _shared(a: tuple[int, ...], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` start with in common."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


class _Picker:
    """Chooses the next token: greedy at temperature 0; otherwise penalties, temperature, top-k, top-p, sampling."""

    def __init__(self, sampling: dict[str, Any], defaults: dict[str, Any]) -> None:
        def value(name: str) -> Any:
            v = sampling.get(name)
            return defaults[name] if v is None else v

        self.temperature = float(value("temperature"))
        self.top_p = float(value("top_p"))
        self.top_k = int(value("top_k"))
        self.presence = float(sampling.get("presence_penalty") or 0.0)
        self.frequency = float(sampling.get("frequency_penalty") or 0.0)
        seed = sampling.get("seed")
        self.generator = torch.Generator().manual_seed(int(seed)) if seed is not None else None

    def pick(self, logits: torch.Tensor, generated: list[int]) -> int:
        if generated and (self.presence or self.frequency):
            ids, counts = torch.unique(torch.tensor(generated), return_counts=True)
            logits = logits.clone()
            logits[ids] -= self.frequency * counts.float() + self.presence
        if self.temperature <= 0.0:
            return int(torch.argmax(logits))
        logits = logits / self.temperature
        if 0 < self.top_k < logits.numel():
            kth = torch.topk(logits, self.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if self.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            outside = torch.cumsum(sorted_probs, dim=-1) - sorted_probs > self.top_p
            sorted_probs[outside] = 0.0
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs / probs.sum(), 1, generator=self.generator))


def _input(request: Any, name: str, default: Any = ...) -> Any:
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        if default is ...:
            raise ValueError(f"input {name!r} is required")
        return default
    return tensor.as_numpy().reshape(-1)[0]


def _cancelled(request: Any) -> bool:
    check = getattr(request, "is_cancelled", None)
    return bool(check()) if check is not None else False


def _stop_at(text: str, stops: list[str]) -> int | None:
    """Where the first stop string starts in ``text``; None when none occurs."""
    found = [i for i in (text.find(s) for s in stops) if i >= 0]
    return min(found) if found else None


def _releasable(text: str, stops: list[str]) -> str:
    """``text`` less what may still turn out to be a stop string or a character cut in half."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:n]):
                hold = max(hold, n)
                break
    text = text[:len(text) - hold] if hold else text
    return text.rstrip("\ufffd")
