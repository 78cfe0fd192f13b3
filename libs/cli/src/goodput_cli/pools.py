"""Model pools of a local platform (`goodput up --pools FILE`), written as the chart's ``inference`` block.

A pools file is what the chart's ``inference`` values hold (or a whole values file with an ``inference:`` key): a
``pools`` list, and optionally ``model``, ``vllm``, ``env`` and ``replicas`` that every pool inherits unless it names
its own. Each pool runs ``replicas`` inference workers (default 1) whose settings say the pool's name, the classes it
serves, its model and served name, its aliases, its engine and its engine limits, the same settings the chart's
ConfigMap gives a pool's pods (``GOODPUT_INFERENCE_POOL``, ``_POOL_CLASSES``, ``_SERVED_MODEL_ALIASES``,
``_MAX_NUM_SEQS``...). A file that deploys can therefore run here, and the other way round.

What only means something in a cluster (GPU type and count, image, resources, autoscaling, PDB, probes, node
selection, Kubernetes-form env) is accepted and ignored, with a note; any other key is refused by name, as the
chart's schema refuses it.

Example:
    >>> pools, notes = parse_pools({"pools": [
    ...     {"name": "chat", "classes": ["P0", "P1"], "aliases": ["small-chat"], "maxNumSeqs": 8,
    ...      "model": {"servedModelName": "smollm2"}, "gpu": {"type": "NVIDIA-L4"}},
    ...     {"name": "batch", "classes": ["P2"], "replicas": 2, "vllm": {"maxNumSeqs": 64, "dtype": "float32"}}]})
    >>> [(p.name, p.replicas) for p in pools]
    [('chat', 1), ('batch', 2)]
    >>> chat, batch = pools[0].worker_env(), pools[1].worker_env()
    >>> chat["GOODPUT_INFERENCE_SERVED_MODEL_ALIASES"], batch["GOODPUT_INFERENCE_DTYPE"]
    ('small-chat', 'float32')
    >>> notes
    ['pool chat: gpu is for Kubernetes only; ignored here (every local worker runs on this machine)']
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["DEFAULT_POOLS_YAML", "POOL_CLASSES", "Pool", "PoolsError", "default_pools", "load_pools", "parse_pools",
           "worker_pools"]

PREFIX = "GOODPUT_INFERENCE_"
POOL_CLASSES = ("P0", "P1", "P2")
ENGINES = ("", "vllm", "triton", "sim")
# The chart's inference.vllm keys and the worker setting each one is (charts/goodput/templates/_helpers.tpl).
VLLM_SETTINGS = {
    "tensorParallelSize": "TENSOR_PARALLEL_SIZE", "gpuMemoryUtilization": "GPU_MEMORY_UTILIZATION",
    "maxNumSeqs": "MAX_NUM_SEQS", "maxNumBatchedTokens": "MAX_NUM_BATCHED_TOKENS", "maxModelLen": "MAX_MODEL_LEN",
    "enablePrefixCaching": "ENABLE_PREFIX_CACHING", "quantization": "QUANTIZATION",
    "speculativeConfig": "SPECULATIVE_CONFIG", "toolCallParser": "TOOL_CALL_PARSER",
    "toolChatTemplate": "TOOL_CHAT_TEMPLATE", "schedulingPolicy": "SCHEDULING_POLICY", "dtype": "DTYPE",
    "kvCacheDtype": "KV_CACHE_DTYPE", "maxPromptTokens": "MAX_PROMPT_TOKENS", "kvCacheSpaceGb": "KV_CACHE_SPACE_GB",
    "enforceEager": "ENFORCE_EAGER",
}
# A pool's shorthands for vllm.<same name> (the chart's too).
SHORTHANDS = ("tensorParallelSize", "maxNumSeqs", "maxNumBatchedTokens")
# Keys that only shape Kubernetes objects: accepted (a values file runs here unchanged) and ignored.
KUBERNETES_ONLY = ("gpu", "image", "resources", "autoscaling", "pdb", "probes", "extraEnv", "nodeSelector",
                   "tolerations", "affinity", "podLabels", "podAnnotations", "priorityClassName")
# ... and those the inference block has besides (its pools have none of them).
KUBERNETES_ONLY_BLOCK = ("enabled", "service", "drainGraceSeconds", "preStopSleepSeconds",
                         "terminationGracePeriodSeconds", "shmSizeLimit", "dataSizeLimit", "topologySpreadConstraints")
# What a pool says that runs here too.
POOL_KEYS = ("name", "classes", "engine", "aliases", "replicas", "model", "vllm", "env", "costPerHour", *SHORTHANDS)
MODEL_KEYS = ("path", "servedModelName")
MODEL_KUBERNETES_ONLY = ("source", "pvc")
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")  # a DNS label, as the chart's schema says
_ALIAS = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# The default of `goodput up`: two pools of the dev model, as the chart's default values have two pools of one model.
# On a few CPU cores each pool is one worker: each is its own vLLM engine (about 3.3 GB of memory with its 1 GB KV
# cache, worker and engine process together) and the two share the cores (VLLM_CPU_OMP_THREADS_BIND gives each its
# own). Measured on 2 cores: `goodput up` serves after 39-57 s with these two, ~35 s with `--workers 1`, and one chat
# alone streams as fast on either (~16 tokens/s). The interactive pool keeps its batches small, the batch pool takes
# more sequences and tokens a step.
DEFAULT_POOLS_YAML = """\
pools:
  # P0 chat and P1 near-real-time: small batches keep the time to first token and per-token latency low.
  - name: interactive
    classes: [P0, P1]
    maxNumSeqs: 8
    maxNumBatchedTokens: 2048
  # P2 batch: larger batches for throughput; a batch backlog never takes the interactive worker's slots.
  - name: batch
    classes: [P2]
    maxNumSeqs: 32
    maxNumBatchedTokens: 4096
"""


class PoolsError(ValueError):
    """A pools definition that cannot run: the message names the pool and the key."""


@dataclass(frozen=True)
class Pool:
    """One model pool: ``replicas`` workers with the same model, engine and limits, serving ``classes`` (empty:
    every class). ``settings`` are the pool's engine settings as worker setting names without the prefix
    (``MAX_NUM_SEQS``), ``env`` literal variables; ``model_path`` and ``served_model_name`` empty mean the dev model
    under its own name.

    >>> batch = Pool(name="batch", classes=("P2",), settings={"MAX_NUM_SEQS": "32"})
    >>> batch.worker_env()  # doctest: +NORMALIZE_WHITESPACE
    {'GOODPUT_INFERENCE_POOL': 'batch', 'GOODPUT_INFERENCE_POOL_CLASSES': 'P2',
     'GOODPUT_INFERENCE_SERVED_MODEL_ALIASES': '', 'GOODPUT_INFERENCE_MAX_NUM_SEQS': '32'}
    """

    name: str
    classes: tuple[str, ...] = ()
    replicas: int = 1
    engine: str = ""
    model_path: str = ""
    served_model_name: str = ""
    aliases: tuple[str, ...] = ()
    settings: Mapping[str, str] = field(default_factory=dict)
    env: Mapping[str, str] = field(default_factory=dict)

    def worker_env(self) -> dict[str, str]:
        """The settings of each of this pool's workers (on top of what every worker gets)."""
        env = {PREFIX + "POOL": self.name, PREFIX + "POOL_CLASSES": ",".join(self.classes),
               PREFIX + "SERVED_MODEL_ALIASES": ",".join(self.aliases)}
        if self.engine:
            env[PREFIX + "ENGINE"] = self.engine
        if self.model_path:
            env[PREFIX + "MODEL"] = self.model_path
        if self.served_model_name:
            env[PREFIX + "SERVED_MODEL_NAME"] = self.served_model_name
        env.update({PREFIX + name: value for name, value in self.settings.items()})
        env.update(self.env)
        return env

    def describe(self, default_model: str) -> str:
        """One line for the terminal: the pool, its workers, model, aliases, classes and batch limits.

        >>> Pool(name="batch", classes=("P2",), settings={"MAX_NUM_SEQS": "32"}).describe("smollm2-135m-instruct")
        'batch: 1 worker of smollm2-135m-instruct, classes P2, max_num_seqs 32'
        """
        model = self.served_model_name or (Path(self.model_path).name if self.model_path else default_model)
        parts = [f"{self.name}: {self.replicas} worker{'' if self.replicas == 1 else 's'} of {model}"]
        if self.aliases:
            parts.append(f"aliases {', '.join(self.aliases)}")
        parts.append(f"classes {','.join(self.classes) or 'all'}")
        for setting in ("MAX_NUM_SEQS", "MAX_NUM_BATCHED_TOKENS", "TENSOR_PARALLEL_SIZE"):
            if setting in self.settings:
                parts.append(f"{setting.lower()} {self.settings[setting]}")
        if self.engine and self.engine != "vllm":
            parts.append(f"engine {self.engine}")
        return ", ".join(parts)


def worker_pools(pools: Sequence[Pool]) -> list[Pool]:
    """The pool of each worker, in worker order: a pool's replicas are consecutive, pools in their order.

    >>> [p.name for p in worker_pools([Pool(name="a", replicas=2), Pool(name="b", replicas=0), Pool(name="c")])]
    ['a', 'a', 'c']
    """
    return [p for p in pools for _ in range(p.replicas)]


def _text(value: Any) -> str:
    """A value as an environment variable holds it (the chart renders them the same way)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return json.dumps(value) if value else ""
    if value is None:
        return ""
    return str(value)


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise PoolsError(f"{where} must be a mapping, not {type(value).__name__}")
    return value


def _strings(value: Any, where: str, pattern: re.Pattern[str], what: str) -> tuple[str, ...]:
    if value is None:
        return ()
    if isinstance(value, str):  # "P0,P1" as the settings write it
        value = [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, Sequence) or not all(isinstance(v, str) for v in value):
        raise PoolsError(f"{where} must be a list of {what}")
    bad = [v for v in value if not pattern.match(v)]
    if bad:
        raise PoolsError(f"{where}: {', '.join(map(repr, bad))} is not a valid {what}")
    if len(set(value)) != len(value):
        raise PoolsError(f"{where}: a {what} is listed twice")
    return tuple(value)


def _int(value: Any, where: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise PoolsError(f"{where} must be an integer of at least {minimum}, not {value!r}")
    return value


def _vllm(block: Mapping[str, Any], where: str) -> dict[str, str]:
    unknown = sorted(set(block) - set(VLLM_SETTINGS))
    if unknown:
        raise PoolsError(f"{where}: unknown key {', '.join(unknown)} (known: {', '.join(VLLM_SETTINGS)})")
    out: dict[str, str] = {}
    for key, value in block.items():
        if key in ("maxNumSeqs", "tensorParallelSize", "maxModelLen"):
            value = _int(value, f"{where}.{key}", 1)
        elif key in ("maxNumBatchedTokens", "maxPromptTokens"):
            value = _int(value, f"{where}.{key}", 0)
        if key == "kvCacheSpaceGb" and not value:
            continue  # the chart's 0: not set
        out[VLLM_SETTINGS[key]] = _text(value)
    return out


def _check_keys(entry: Mapping[str, Any], local: Sequence[str], kubernetes: Sequence[str], where: str,
                notes: list[str]) -> None:
    unknown = sorted(set(entry) - set(local) - set(kubernetes))
    if unknown:
        raise PoolsError(f"{where}: unknown key {', '.join(unknown)} (known here: {', '.join(local)}; "
                         f"Kubernetes only, ignored here: {', '.join(kubernetes)})")
    ignored = [k for k in kubernetes if k in entry]
    if ignored:
        notes.append(f"{where}: {', '.join(ignored)} {'is' if len(ignored) == 1 else 'are'} for Kubernetes only; "
                     "ignored here (every local worker runs on this machine)")


def parse_pools(doc: Any, source: str = "pools") -> tuple[list[Pool], list[str]]:
    """The pools of a document shaped like the chart's ``inference`` block (or a values file holding one under
    ``inference``), and notes on what was ignored. Raises :class:`PoolsError` naming what is wrong."""
    if isinstance(doc, Mapping) and "inference" in doc and "pools" not in doc:
        doc = doc["inference"]
    block = _mapping(doc, source)
    notes: list[str] = []
    _check_keys(block, ("pools", "model", "vllm", "env", "replicas"), KUBERNETES_ONLY + KUBERNETES_ONLY_BLOCK,
                source, notes)
    entries = block.get("pools")
    if not isinstance(entries, list) or not entries:
        raise PoolsError(f"{source}: `pools` must be a non-empty list of pools")
    base_model = _model(block.get("model"), f"{source}.model", notes)
    base_settings = _vllm(_mapping(block.get("vllm"), f"{source}.vllm"), f"{source}.vllm")
    base_env = _env(block.get("env"), f"{source}.env")
    base_replicas = _int(block.get("replicas", 1), f"{source}.replicas", 0)
    pools: list[Pool] = []
    for n, raw in enumerate(entries):
        entry = _mapping(raw, f"{source}.pools[{n}]")
        name = entry.get("name")
        if not isinstance(name, str) or not _NAME.match(name) or len(name) > 20:
            raise PoolsError(f"{source}.pools[{n}].name must be a DNS label of at most 20 characters (lower-case "
                             f"letters, digits, '-'), not {name!r}")
        where = f"pool {name}"
        if any(p.name == name for p in pools):
            raise PoolsError(f"{source}: the pool name {name!r} is used twice")
        _check_keys(entry, POOL_KEYS, KUBERNETES_ONLY, where, notes)
        classes = _strings(entry.get("classes"), f"{where}: classes", re.compile(r"^P[012]$"), "priority class")
        engine = entry.get("engine") or ""
        if engine not in ENGINES:
            raise PoolsError(f"{where}: engine must be one of vllm, triton, sim, not {engine!r}")
        model = {**base_model, **_model(entry.get("model"), f"{where}: model", notes)}
        settings = {**base_settings, **_vllm(_mapping(entry.get("vllm"), f"{where}: vllm"), f"{where}: vllm")}
        settings.update(_vllm({k: entry[k] for k in SHORTHANDS if k in entry}, where))
        if "costPerHour" in entry:  # what model "auto" weighs (POOL_COST_PER_HOUR)
            cost = entry["costPerHour"]
            if isinstance(cost, bool) or not isinstance(cost, int | float) or cost < 0:
                raise PoolsError(f"{where}: costPerHour must be a number of at least 0, not {cost!r}")
            settings["POOL_COST_PER_HOUR"] = _text(cost)
        pools.append(Pool(
            name=name, classes=tuple(c for c in POOL_CLASSES if c in classes),
            replicas=_int(entry.get("replicas", base_replicas), f"{where}: replicas", 0), engine=str(engine),
            model_path=model.get("path", ""), served_model_name=model.get("servedModelName", ""),
            aliases=_strings(entry.get("aliases"), f"{where}: aliases", _ALIAS, "model alias"),
            settings=settings, env={**base_env, **_env(entry.get("env"), f"{where}: env")}))
    if not any(p.replicas for p in pools):
        raise PoolsError(f"{source}: every pool has 0 replicas; at least one worker must run")
    return pools, notes + _alias_notes(pools)


def _model(value: Any, where: str, notes: list[str]) -> dict[str, str]:
    block = _mapping(value, where)
    _check_keys(block, MODEL_KEYS, MODEL_KUBERNETES_ONLY, where, notes)
    out = {}
    for key in MODEL_KEYS:
        if key in block:
            if not isinstance(block[key], str):
                raise PoolsError(f"{where}.{key} must be a string")
            out[key] = block[key]
    return out


def _env(value: Any, where: str) -> dict[str, str]:
    block = _mapping(value, where)
    bad = [k for k in block if not isinstance(k, str) or not _ENV_NAME.match(k)]
    if bad:
        raise PoolsError(f"{where}: {', '.join(map(repr, bad))} is not an environment variable name")
    return {k: _text(v) for k, v in block.items()}


def _alias_notes(pools: list[Pool]) -> list[str]:
    """The gateway resolves an alias only where every worker of the model declares it (a request may land on any
    of them): an alias that some pools of a model declare and others do not never resolves."""
    by_model: dict[tuple[str, str], list[Pool]] = {}
    for p in pools:
        if p.replicas:
            by_model.setdefault((p.served_model_name, p.model_path), []).append(p)
    notes = []
    for same in by_model.values():
        for alias in sorted({a for p in same for a in p.aliases}):
            missing = [p.name for p in same if alias not in p.aliases]
            if missing:
                notes.append(f"the alias {alias!r} is not declared by pool {', '.join(missing)}, which serves the "
                             "same model: the gateway resolves an alias only when every worker of the model "
                             "declares it")
    return notes


def load_pools(path: Path) -> tuple[list[Pool], list[str]]:
    """The pools of a YAML or JSON file (see :func:`parse_pools`)."""
    import yaml

    try:
        text = Path(path).read_text()
    except OSError as err:
        raise PoolsError(f"cannot read the pools file {path}: {err.strerror or err}") from None
    try:
        doc = json.loads(text) if Path(path).suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as err:
        raise PoolsError(f"{path} is not valid {'JSON' if Path(path).suffix == '.json' else 'YAML'}: {err}") from None
    return parse_pools(doc, str(path))


def default_pools() -> list[Pool]:
    """The pools `goodput up` runs when told neither --pools nor --workers (:data:`DEFAULT_POOLS_YAML`).

    >>> [(p.name, p.classes, p.settings["MAX_NUM_SEQS"]) for p in default_pools()]
    [('interactive', ('P0', 'P1'), '8'), ('batch', ('P2',), '32')]
    """
    import yaml

    return parse_pools(yaml.safe_load(DEFAULT_POOLS_YAML), "the default pools")[0]
