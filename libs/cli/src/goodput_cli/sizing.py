"""Sizing a model pool: weights and KV-cache memory, the GPUs (type and count, with tensor parallelism) that hold a
model at a context length and a concurrency, the ``max_num_seqs`` to run it with, and the pool's Helm values.

The model is an HF folder (its ``config.json``: layers, attention and KV heads, head size, context window, sliding
window; parameters counted from the safetensors headers) or a bare parameter count such as ``7B``, sized with the
Qwen2.5 family's shapes (GQA; :data:`SHAPES`): the exact parameters of the family's member when the count names one
(``7B`` is Qwen2.5-7B, 7.62e9 parameters), else the count as given with the layers and heads of the nearest member.

Memory per GPU, as vLLM divides it (0.32, ``gpu_worker.determine_available_memory``): ``usable × utilization`` is the
budget; the weights (divided by the tensor-parallel size), an activation/overhead reserve (:func:`overhead_bytes`:
CUDA graphs and library workspaces, the profile run's activations for ``max_num_batched_tokens`` tokens, the
sampler's logits) come off it, and the rest is KV cache. A pool *fits* when that cache holds ``concurrency``
sequences at the full ``context`` (prompt and output, rounded up to 16-token blocks) at once: the worst case, where
vLLM never has to preempt.

Example::

    $ goodput size --model 7B --context 8192 --concurrency 8 --gpu A10                     # 1x A10, bf16
    $ goodput size --model 14B --context 8192 --concurrency 8 --quantization awq --gpu A30  # 1x A30, AWQ 4-bit
    $ goodput size --model 72B --context 8192 --concurrency 16 --quantization int8 --gpu A100-80  # 2x, TP 2
    $ goodput size --model ~/.cache/goodput/models/smollm2-135m-instruct-* --context 2048 --concurrency 16 --json

    >>> shape = model_from_count("7B")
    >>> shape.num_hidden_layers, shape.num_key_value_heads, shape.head_dim, round(shape.parameters / 1e9, 2)
    (28, 4, 128, 7.62)
    >>> kv_bytes_per_token(shape, kv_bytes=2)  # 28 layers x 4 KV heads x 128 x (K and V) x 2 bytes
    57344
    >>> plan = size(shape, context=8192, concurrency=8, gpus=[GPUS["A10"]])
    >>> plan.recommended.gpu, plan.recommended.count, plan.recommended.max_num_seqs
    ('A10', 1, 11)
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from goodput_cli.gpus import GPUS, Gpu

__all__ = ["DTYPES", "KV_DTYPES", "QUANTIZATIONS", "SHAPES", "GpuOption", "ModelShape", "Sizing", "SizingError",
           "kv_bytes_per_token", "kv_cache_tokens", "load_model", "model_from_count", "model_from_folder",
           "overhead_bytes", "pool_values", "round_max_num_seqs", "size", "tensor_parallel_sizes",
           "weights_bytes"]

GIB = 1024**3
BLOCK_TOKENS = 16  # vLLM's KV-cache block on CUDA: a sequence holds whole blocks
TP_SIZES = (1, 2, 4, 8)  # one node
DEFAULT_CLASSES = ("P0", "P1", "P2")

DTYPES = {"float32": 4, "bfloat16": 2, "float16": 2}
_DTYPE_ALIASES = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}
KV_DTYPES = {**DTYPES, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# Bytes per quantized weight. 4-bit AWQ/GPTQ: 4 bits plus, per group of 128 weights, an fp16 scale and a 4-bit zero.
# The embeddings and an untied LM head stay in the model's dtype in every scheme vLLM serves.
QUANTIZATIONS = {"none": 0.0, "fp8": 1.0, "int8": 1.0, "awq": (4 + 20 / 128) / 8, "gptq": (4 + 20 / 128) / 8}


class SizingError(ValueError):
    """A model or request that cannot be sized (missing config keys, unknown dtype, an architecture not modelled)."""


@dataclass(frozen=True)
class ModelShape:
    """What sizing needs to know about a model."""

    name: str
    source: str  # where the numbers come from, in words
    parameters: int
    embedding_parameters: int  # input embeddings plus an untied LM head: never quantized
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    hidden_size: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    sliding_window: int = 0  # tokens; 0 = none
    sliding_window_layers: int = 0  # layers that keep only the window
    dtype: str = "bfloat16"  # the checkpoint's
    quantization: str = "none"  # the checkpoint's
    folder: str = ""  # the HF folder, when read from one


def _shape(name: str, layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int, intermediate: int,
           vocab: int, tied: bool) -> ModelShape:
    embedding = vocab * hidden * (1 if tied else 2)
    return ModelShape(name=name, source=f"assumed: {name}-like shapes", num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim, hidden_size=hidden,
                      intermediate_size=intermediate, vocab_size=vocab, max_position_embeddings=32768,
                      parameters=embedding + layers * _layer_parameters(hidden, heads, kv_heads, head_dim,
                                                                         intermediate, bias=True) + hidden,
                      embedding_parameters=embedding)


def _layer_parameters(hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int, *,
                      bias: bool = False, experts: int = 1) -> int:
    """One decoder layer of a Llama/Qwen-like model: q/k/v/o projections, a gated MLP (per expert), two norms."""
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden + ((q + 2 * kv) if bias else 0)
    mlp = 3 * hidden * intermediate * experts + (hidden * experts if experts > 1 else 0)
    return attention + mlp + 2 * hidden


# The Qwen2.5 family (config.json of each base model): GQA, 128-dim heads from 1.5B up, a 32k window.
SHAPES: dict[str, ModelShape] = {s.name.removeprefix("Qwen2.5-"): s for s in (
    _shape("Qwen2.5-0.5B", 24, 14, 2, 64, 896, 4864, 151936, tied=True),
    _shape("Qwen2.5-1.5B", 28, 12, 2, 128, 1536, 8960, 151936, tied=True),
    _shape("Qwen2.5-3B", 36, 16, 2, 128, 2048, 11008, 151936, tied=True),
    _shape("Qwen2.5-7B", 28, 28, 4, 128, 3584, 18944, 152064, tied=False),
    _shape("Qwen2.5-14B", 48, 40, 8, 128, 5120, 13824, 152064, tied=False),
    _shape("Qwen2.5-32B", 64, 40, 8, 128, 5120, 27648, 152064, tied=False),
    _shape("Qwen2.5-72B", 80, 64, 8, 128, 8192, 29568, 152064, tied=False),
)}

_COUNT = re.compile(r"^\s*(\d+(?:\.\d+)?(?:e\d+)?)\s*([kmbt]?)\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}


def parse_count(text: str) -> int:
    """A parameter count: ``7B``, ``0.5b``, ``135M``, ``7.6e9``, ``7000000000``.

    >>> parse_count("7B"), parse_count("135M"), parse_count("7.6e9")
    (7000000000, 135000000, 7600000000)
    """
    match = _COUNT.match(text)
    if not match:
        raise SizingError(f"{text!r} is neither a model folder with a config.json nor a parameter count (e.g. 7B)")
    count = int(float(match.group(1)) * _SCALE[match.group(2).lower()])
    if count < 10**6:
        raise SizingError(f"{text!r} is {count} parameters: give the count with its unit (e.g. 135M, 7B)")
    return count


def model_from_count(text: str) -> ModelShape:
    """A model known only by its parameter count, with the shapes of the nearest Qwen2.5 model.

    >>> model_from_count("14b").name
    'Qwen2.5-14B'
    >>> model_from_count("70B").source
    'assumed: Qwen2.5-72B-like shapes (80 layers, 64 heads, 8 KV heads x 128); 70.0e9 parameters as given'
    """
    label = text.strip().upper()
    if label in SHAPES:
        exact = SHAPES[label]
        return replace(exact, source=f"{exact.source} ({_describe(exact)}); {exact.parameters / 1e9:.2f}e9 parameters")
    count = parse_count(text)
    nearest = min(SHAPES.values(), key=lambda s: abs(math.log(s.parameters / count)))
    return replace(nearest, name=f"{count / 1e9:g}B", parameters=count,
                    source=f"{nearest.source} ({_describe(nearest)}); {count / 1e9:.1f}e9 parameters as given")


def _describe(s: ModelShape) -> str:
    return (f"{s.num_hidden_layers} layers, {s.num_attention_heads} heads, {s.num_key_value_heads} KV heads x "
            f"{s.head_dim}")


def model_from_folder(folder: Path) -> ModelShape:
    """A model from its HF folder: shapes from ``config.json``, parameters from the safetensors headers (counted from
    ``config.json`` when the checkpoint is quantized, its tensors being packed)."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as err:
        raise SizingError(f"cannot read {folder / 'config.json'}: {err}") from None
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    assert isinstance(text, dict)
    if "kv_lora_rank" in text:
        raise SizingError("multi-head latent attention (DeepSeek-style kv_lora_rank) is not modelled: its KV cache "
                          "is one compressed vector per token and layer, not K and V per head")

    def need(*keys: str) -> int:
        for key in keys:
            value = text.get(key, config.get(key))
            if isinstance(value, int) and value > 0:
                return value
        raise SizingError(f"{folder / 'config.json'} has no {' or '.join(keys)}")

    layers = need("num_hidden_layers", "n_layer", "num_layers")
    heads = need("num_attention_heads", "n_head")
    hidden = need("hidden_size", "n_embd", "d_model")
    kv_heads = text.get("num_key_value_heads") or (1 if text.get("multi_query") else heads)
    head_dim = text.get("head_dim") or hidden // heads
    intermediate = text.get("intermediate_size") or text.get("moe_intermediate_size") or 4 * hidden
    experts = int(text.get("num_local_experts") or text.get("num_experts") or 1)
    vocab = need("vocab_size")
    window = need("max_position_embeddings", "n_positions", "seq_length")
    tied = bool(text.get("tie_word_embeddings", config.get("tie_word_embeddings", False)))
    embedding = vocab * hidden * (1 if tied else 2)
    quantization = _checkpoint_quantization(config.get("quantization_config") or text.get("quantization_config"))
    counted = _safetensors_parameters(folder) if quantization == "none" else 0
    parameters = counted or embedding + hidden + layers * _layer_parameters(
        hidden, heads, int(kv_heads), int(head_dim), int(intermediate),
        bias=bool(text.get("attention_bias", text.get("model_type", "").startswith("qwen2"))), experts=experts)
    sliding, sliding_layers = _sliding_window(text, layers)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or text.get("torch_dtype") or "bfloat16")
    how = "parameters from the safetensors headers" if counted else "parameters counted from config.json"
    return ModelShape(name=folder.resolve().name, source=f"{folder / 'config.json'}; {how}", parameters=parameters,
                      embedding_parameters=embedding, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=int(kv_heads), head_dim=int(head_dim), hidden_size=hidden,
                      intermediate_size=int(intermediate), vocab_size=vocab, max_position_embeddings=window,
                      sliding_window=sliding, sliding_window_layers=sliding_layers, dtype=dtype,
                      quantization=quantization, folder=str(folder))


def _sliding_window(text: dict[str, Any], layers: int) -> tuple[int, int]:
    """(window, layers that use it). ``layer_types`` (Gemma 3, Qwen3-Next…) names each layer; Qwen2's
    ``use_sliding_window: false`` turns a listed window off; Gemma's ``sliding_window_pattern`` makes every n-th layer
    global; else a window applies to every layer (Mistral 7B v0.1)."""
    window = text.get("sliding_window")
    if not isinstance(window, int) or window <= 0:
        return 0, 0
    types = text.get("layer_types")
    if isinstance(types, list) and types:
        return window, sum(1 for t in types if t == "sliding_attention")
    if text.get("use_sliding_window") is False:
        return 0, 0
    pattern = text.get("sliding_window_pattern")
    if isinstance(pattern, int) and pattern > 1:
        return window, layers - layers // pattern
    return window, layers


def _checkpoint_quantization(qc: Any) -> str:
    if not isinstance(qc, dict):
        return "none"
    method = str(qc.get("quant_method", "")).lower()
    bits = qc.get("bits") or qc.get("w_bit")
    if method in ("awq", "awq_marlin"):
        return "awq"
    if method in ("gptq", "gptq_marlin"):
        return "int8" if bits == 8 else "gptq"
    if method in ("fp8", "fbgemm_fp8"):
        return "fp8"
    if method == "bitsandbytes":
        return "gptq" if qc.get("load_in_4bit") else "int8"
    if method == "compressed-tensors":
        for group in (qc.get("config_groups") or {}).values():
            weights = group.get("weights") or {}
            if weights.get("num_bits") == 4:
                return "gptq"
            if weights.get("num_bits") == 8:
                return "fp8" if weights.get("type") == "float" else "int8"
    raise SizingError(f"the checkpoint's quantization {method or qc!r} is not modelled: pass --quantization")


def _safetensors_parameters(folder: Path) -> int:
    """Elements in every tensor of the folder's safetensors files, from their headers only (no weights read)."""
    total = 0
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def load_model(model: str) -> ModelShape:
    """An HF folder (one holding a config.json) or a parameter count."""
    path = Path(model).expanduser()
    if path.is_dir():
        return model_from_folder(path)
    if path.suffix or "/" in model:
        raise SizingError(f"{model!r} is not a folder with a config.json")
    return model_from_count(model)


# ---- arithmetic ----------------------------------------------------------------------------------------------------


def dtype_name(dtype: str, shape: ModelShape) -> str:
    """The dtype the weights and activations run in: ``auto`` is the checkpoint's, except float32, which vLLM serves
    in 16 bits on a GPU."""
    name = _DTYPE_ALIASES.get(dtype.lower(), dtype.lower())
    if name == "auto":
        name = _DTYPE_ALIASES.get(shape.dtype.lower(), shape.dtype.lower())
        return name if name in ("bfloat16", "float16") else "bfloat16"
    if name not in DTYPES:
        raise SizingError(f"unknown dtype {dtype!r} (one of auto, {', '.join(DTYPES)})")
    return name


def kv_dtype_name(kv_cache_dtype: str, dtype: str) -> str:
    name = _DTYPE_ALIASES.get(kv_cache_dtype.lower(), kv_cache_dtype.lower())
    if name == "auto":
        return dtype
    if name not in KV_DTYPES:
        raise SizingError(f"unknown KV-cache dtype {kv_cache_dtype!r} (one of auto, {', '.join(KV_DTYPES)})")
    return name


def weights_bytes(shape: ModelShape, *, dtype_bytes: int, quantization: str = "none") -> int:
    """Bytes of weights: the quantized share at the scheme's width, embeddings (and an untied head) at ``dtype``.

    >>> round(weights_bytes(SHAPES["14B"], dtype_bytes=2, quantization="awq") / 1e9, 1)  # Qwen2.5-14B-AWQ: 9.99 GB
    10.0
    """
    if quantization not in QUANTIZATIONS:
        raise SizingError(f"unknown quantization {quantization!r} (one of {', '.join(QUANTIZATIONS)})")
    per_weight = QUANTIZATIONS[quantization] or dtype_bytes
    body = max(0, shape.parameters - shape.embedding_parameters)
    return int(body * per_weight + shape.embedding_parameters * dtype_bytes)


def kv_bytes_per_token(shape: ModelShape, *, kv_bytes: int, tp: int = 1) -> int:
    """KV-cache bytes one token takes on one GPU, every layer: layers x KV heads x head size x 2 (K and V) x bytes.
    With tensor parallelism each GPU holds its share of the KV heads, at least one (replicated when ``tp`` exceeds
    them)."""
    heads = max(1, shape.num_key_value_heads // tp)
    return shape.num_hidden_layers * heads * shape.head_dim * 2 * kv_bytes


def kv_bytes_per_sequence(shape: ModelShape, *, tokens: int, kv_bytes: int, tp: int = 1) -> int:
    """KV-cache bytes of one sequence of ``tokens`` on one GPU, in whole blocks; sliding-window layers keep only the
    window (and one block)."""
    blocks = math.ceil(tokens / BLOCK_TOKENS) * BLOCK_TOKENS
    per_layer = kv_bytes_per_token(shape, kv_bytes=kv_bytes, tp=tp) // shape.num_hidden_layers
    windowed = min(blocks, math.ceil(shape.sliding_window / BLOCK_TOKENS + 1) * BLOCK_TOKENS)
    full_layers = shape.num_hidden_layers - shape.sliding_window_layers
    return per_layer * (full_layers * blocks + shape.sliding_window_layers * windowed)


def kv_cache_tokens(shape: ModelShape, *, cache_bytes: int, kv_bytes: int, block_tokens: int = BLOCK_TOKENS,
                    tp: int = 1) -> int:
    """Tokens a KV cache of ``cache_bytes`` per GPU holds, in whole blocks of ``block_tokens`` (what vLLM logs as "KV
    cache size: N tokens" for a full-attention model).

    >>> dev = replace(SHAPES["0.5B"], num_hidden_layers=30, num_key_value_heads=3, head_dim=64)  # SmolLM2-135M
    >>> kv_cache_tokens(dev, cache_bytes=GIB, kv_bytes=4, block_tokens=128)  # float32, vLLM's CPU block size
    23296
    """
    per_block = kv_bytes_per_token(shape, kv_bytes=kv_bytes, tp=tp) * block_tokens
    return (cache_bytes // per_block) * block_tokens


def tensor_parallel_sizes(shape: ModelShape) -> list[int]:
    """TP sizes vLLM accepts for the model on one node: they divide the attention heads, and the KV heads divide
    them or they divide the KV heads.

    >>> tensor_parallel_sizes(SHAPES["72B"]), tensor_parallel_sizes(SHAPES["0.5B"])
    ([1, 2, 4, 8], [1, 2])
    """
    kv = shape.num_key_value_heads
    return [tp for tp in TP_SIZES if shape.num_attention_heads % tp == 0 and (kv % tp == 0 or tp % kv == 0)]


def overhead_bytes(shape: ModelShape, *, tp: int, act_bytes: int, batched_tokens: int, max_seqs: int) -> int:
    """What a GPU needs besides weights and KV cache: 0.5 GiB for CUDA graphs and the CUDA/cuBLAS workspaces (0.25
    GiB more for NCCL's buffers under tensor parallelism), the activations of a forward pass over
    ``batched_tokens`` tokens (residual stream, QKV and gated-MLP outputs, this GPU's share), and the sampler's
    float32 logits and probabilities for ``max_seqs`` sequences (vLLM's profile run does both)."""
    fixed = GIB // 2 + (GIB // 4 if tp > 1 else 0)
    qkv = (shape.num_attention_heads + 2 * shape.num_key_value_heads) * shape.head_dim
    per_token = 2 * shape.hidden_size + (qkv + 2 * shape.intermediate_size) / tp
    sampler = 2 * max_seqs * shape.vocab_size * 4
    return int(fixed + batched_tokens * per_token * act_bytes + sampler)


def round_max_num_seqs(sequences: int, *, concurrency: int, cap: int) -> int:
    """``max_num_seqs`` for a cache that holds ``sequences`` full-context sequences: that number below 16, rounded
    down to a multiple of 8 from there (vLLM's CUDA-graph batch sizes), capped at vLLM's default for the GPU, never
    below the concurrency asked for (when the cache holds it).

    >>> [round_max_num_seqs(n, concurrency=4, cap=256) for n in (2, 7, 13, 41, 1000)]
    [2, 7, 13, 40, 256]
    >>> round_max_num_seqs(300, concurrency=300, cap=256)
    300
    """
    n = min(sequences, cap)
    step = n if n < 16 else n - n % 8
    return max(min(concurrency, sequences), step)


# ---- sizing --------------------------------------------------------------------------------------------------------


@dataclass
class GpuOption:
    """One GPU type at the smallest tensor-parallel size that fits (or the largest tried, when none does)."""

    gpu: str
    memory_gib: float
    count: int  # GPUs per worker = tensor_parallel_size
    fits: bool
    reason: str  # why it does not fit; empty when it does
    weights_gib_per_gpu: float
    overhead_gib_per_gpu: float
    kv_cache_gib_per_gpu: float
    kv_cache_tokens: int  # per worker, every layer full (vLLM's "KV cache size")
    sequences: int  # full-context sequences the cache holds at once
    max_num_seqs: int
    max_num_batched_tokens: int
    cost_per_hour: float  # all the worker's GPUs
    itl_floor_ms: float  # memory-bound decode step: weights and half-full caches read once, at full bandwidth
    product: str


@dataclass
class Sizing:
    """The answer of :func:`size`: the model, the memory it needs, every GPU type's option and the cheapest fit."""

    model: ModelShape
    context: int
    concurrency: int
    dtype: str
    quantization: str
    kv_cache_dtype: str
    gpu_memory_utilization: float
    weights_gib: float
    kv_bytes_per_token: int
    kv_gib_per_sequence: float
    kv_gib_needed: float
    tensor_parallel_sizes: list[int]
    options: list[GpuOption]
    recommended: GpuOption | None
    warnings: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def size(shape: ModelShape, *, context: int, concurrency: int, dtype: str = "auto", quantization: str = "auto",
         kv_cache_dtype: str = "auto", gpu_memory_utilization: float = 0.9, overhead_gib: float | None = None,
         gpus: Iterable[Gpu] | None = None) -> Sizing:
    """Sizes ``shape`` for ``concurrency`` sequences of ``context`` tokens on each GPU type of ``gpus`` (default:
    the whole catalogue). The recommendation is the fit with the fewest GPUs per worker (no tensor-parallel traffic
    where one GPU will do; 8 L4s over PCIe are not a cheaper 2x A100), then the cheapest per hour, then the roomiest.

    ``quantization``: ``auto`` (the checkpoint's), ``none``, ``fp8``, ``int8``, ``awq`` or ``gptq`` (4-bit).
    ``overhead_gib`` replaces :func:`overhead_bytes`' estimate per GPU.
    """
    if context < 1 or concurrency < 1:
        raise SizingError("context and concurrency must be at least 1")
    if not 0 < gpu_memory_utilization <= 1:
        raise SizingError("gpu_memory_utilization must be in (0, 1]")
    run_dtype = dtype_name(dtype, shape)
    quant = shape.quantization if quantization == "auto" else quantization
    kv_dtype = kv_dtype_name(kv_cache_dtype, run_dtype)
    act, kv_width = DTYPES[run_dtype], KV_DTYPES[kv_dtype]
    weights = weights_bytes(shape, dtype_bytes=act, quantization=quant)
    per_sequence = kv_bytes_per_sequence(shape, tokens=context, kv_bytes=kv_width)
    warnings = []
    if context > shape.max_position_embeddings:
        warnings.append(f"context {context} exceeds the model's max_position_embeddings "
                        f"({shape.max_position_embeddings}): vLLM refuses such a max_model_len without RoPE scaling")
    if shape.quantization != "none" and quant != shape.quantization:
        warnings.append(f"the checkpoint is {shape.quantization}-quantized; sized as {quant}")
    if quant == "int8" and shape.quantization != "int8":
        warnings.append("int8 (W8A8) needs a checkpoint quantized ahead (e.g. llm-compressor); vLLM quantizes "
                        "online to fp8 only")
    tps = tensor_parallel_sizes(shape)
    options = [_option(shape, gpu, tps=tps, context=context, concurrency=concurrency, weights=weights, act=act,
                       kv_width=kv_width, quantization=quant, utilization=gpu_memory_utilization,
                       overhead_gib=overhead_gib)
               for gpu in (list(gpus) if gpus is not None else list(GPUS.values()))]
    fitting = [o for o in options if o.fits]
    recommended = min(fitting, key=lambda o: (o.count, round(o.cost_per_hour, 6), -o.sequences), default=None)
    return Sizing(model=shape, context=context, concurrency=concurrency, dtype=run_dtype, quantization=quant,
                  kv_cache_dtype=kv_dtype, gpu_memory_utilization=gpu_memory_utilization,
                  weights_gib=round(weights / GIB, 2), kv_bytes_per_token=kv_bytes_per_token(shape, kv_bytes=kv_width),
                  kv_gib_per_sequence=round(per_sequence / GIB, 3),
                  kv_gib_needed=round(per_sequence * concurrency / GIB, 2), tensor_parallel_sizes=tps,
                  options=options, recommended=recommended, warnings=warnings)


def _option(shape: ModelShape, gpu: Gpu, *, tps: Sequence[int], context: int, concurrency: int, weights: int,
            act: int, kv_width: int, quantization: str, utilization: float, overhead_gib: float | None) -> GpuOption:
    batched = 8192 if gpu.large_engine_defaults else 2048
    cap = 1024 if gpu.large_engine_defaults else 256
    unsupported = (f"{quantization} needs compute capability 8.0 (vLLM's fp8 Marlin kernel); {gpu.name} has "
                   f"{gpu.compute_capability:g}" if quantization == "fp8" and gpu.compute_capability < 8.0 else "")
    option: GpuOption | None = None
    for tp in tps:
        budget = gpu.usable_gib * GIB * utilization
        per_gpu_weights = weights / tp
        overhead = (overhead_gib * GIB if overhead_gib is not None else
                    overhead_bytes(shape, tp=tp, act_bytes=act, batched_tokens=batched, max_seqs=cap))
        free = budget - per_gpu_weights - overhead
        per_sequence = kv_bytes_per_sequence(shape, tokens=context, kv_bytes=kv_width, tp=tp)
        sequences = int(free // per_sequence) if free > 0 else 0
        tokens = kv_cache_tokens(shape, cache_bytes=int(free), kv_bytes=kv_width, tp=tp) if free > 0 else 0
        fits = sequences >= concurrency and not unsupported
        if unsupported:
            reason = unsupported
        elif free <= 0:
            reason = (f"weights ({per_gpu_weights / GIB:.1f} GiB per GPU) and overhead ({overhead / GIB:.1f} GiB) "
                      f"exceed {utilization:g} x {gpu.usable_gib:g} GiB")
        elif not fits:
            reason = f"KV cache holds {sequences} of {concurrency} sequences at {context} tokens"
        else:
            reason = ""
        live = per_gpu_weights + min(sequences, concurrency) * per_sequence / 2
        option = GpuOption(
            gpu=gpu.name, memory_gib=gpu.memory_gib, count=tp, fits=fits, reason=reason,
            weights_gib_per_gpu=round(per_gpu_weights / GIB, 2), overhead_gib_per_gpu=round(overhead / GIB, 2),
            kv_cache_gib_per_gpu=round(max(free, 0) / GIB, 2), kv_cache_tokens=tokens, sequences=sequences,
            max_num_seqs=round_max_num_seqs(sequences, concurrency=concurrency, cap=cap) if sequences else 0,
            max_num_batched_tokens=batched, cost_per_hour=round(gpu.cost_per_hour * tp, 4),
            itl_floor_ms=round(live / (gpu.bandwidth_gbs * 1e9) * 1e3, 1), product=gpu.product)
        if fits:
            break
    if option is None:
        raise SizingError(f"{shape.name}: no tensor-parallel size divides its {shape.num_attention_heads} heads")
    return option


# ---- output --------------------------------------------------------------------------------------------------------


_PLAIN = re.compile(r"[A-Za-z0-9_./~+-]+")


def _yaml_scalar(text: str) -> str:
    """``text`` as a YAML scalar: plain when it is a safe word or path, else double-quoted (JSON is valid YAML)."""
    plain = _PLAIN.fullmatch(text) and not re.fullmatch(r"[-+.]?\d.*|true|false|null|yes|no|on|off|~", text, re.I)
    return text if plain else json.dumps(text)


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")[:50] or "pool"


def pool_values(plan: Sizing, option: GpuOption, *, name: str | None = None, model: str = "",
                classes: Sequence[str] = DEFAULT_CLASSES, engine: str = "vllm") -> str:
    """A Helm values snippet for a pool of ``option``'s workers (one item of ``pools:``).

    >>> plan = size(SHAPES["7B"], context=8192, concurrency=8, gpus=[GPUS["A10"]])
    >>> print(pool_values(plan, plan.recommended, model="/models/Qwen2.5-7B-Instruct").split("pools:")[1])
    <BLANKLINE>
      - name: qwen2-5-7b-a10
        model:
          path: /models/Qwen2.5-7B-Instruct
        engine: vllm
        gpu:
          type: A10
          count: 1
        tensorParallelSize: 1
        maxNumSeqs: 11
        maxNumBatchedTokens: 2048
        costPerHour: 1
        classes: [P0, P1, P2]
    <BLANKLINE>
    """
    shape = plan.model
    model_ref = model or shape.folder or "CHANGE-ME"
    pool = name or _slug(f"{shape.name}-{option.gpu}")
    return (
        f"# goodput size: {shape.name} ({plan.dtype}, quantization {plan.quantization}) on {option.count}x "
        f"{option.gpu}, {plan.concurrency} sequences of {plan.context} tokens; KV cache {option.kv_cache_gib_per_gpu}"
        f" GiB per GPU ({option.kv_cache_tokens} tokens, {option.sequences} full-context sequences).\n"
        f"# Sized for vLLM with maxModelLen {plan.context}, gpuMemoryUtilization {plan.gpu_memory_utilization:g}, "
        f"kvCacheDtype {plan.kv_cache_dtype}; nodeSelector nvidia.com/gpu.product: {option.product}.\n"
        "pools:\n"
        f"  - name: {_yaml_scalar(pool)}\n"
        "    model:\n"
        f"      path: {_yaml_scalar(model_ref)}\n"
        f"    engine: {engine}\n"
        "    gpu:\n"
        f"      type: {option.gpu}\n"
        f"      count: {option.count}\n"
        f"    tensorParallelSize: {option.count}\n"
        f"    maxNumSeqs: {option.max_num_seqs}\n"
        f"    maxNumBatchedTokens: {option.max_num_batched_tokens}\n"
        f"    costPerHour: {option.cost_per_hour:g}\n"
        f"    classes: [{', '.join(classes)}]\n"
    )
