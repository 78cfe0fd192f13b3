"""`goodput size`: the seeds' GPU mapping comes out of the arithmetic, a config.json is read the way vLLM reads it,
and the command's answer is one an operator can paste into the chart."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import typer
import yaml
from typer.testing import CliRunner

from goodput_cli.gpus import GPUS, find_gpu
from goodput_cli.main import app as goodput_app
from goodput_cli.sizing import (
    GIB,
    SHAPES,
    SizingError,
    kv_bytes_per_sequence,
    kv_bytes_per_token,
    kv_cache_tokens,
    load_model,
    model_from_count,
    model_from_folder,
    size,
    tensor_parallel_sizes,
    weights_bytes,
)
from goodput_cli.sizing_cli import register

runner = CliRunner()
app = typer.Typer()
register(app)


@app.callback()
def _group() -> None:
    """A group, so that `size` is a subcommand as in `goodput`."""


def run(*args: str) -> tuple[int, str]:
    result = runner.invoke(app, ["size", *args])
    return result.exit_code, result.output


def run_json(*args: str) -> dict:
    code, output = run(*args, "--json")
    assert code == 0, output
    return json.loads(output)


def option(plan_json: dict, gpu: str) -> dict:
    return next(o for o in plan_json["options"] if o["gpu"] == gpu)


# ---- the seeds' mapping (BP-PERF-01): 7B on one A10, 14B on an A30, 72B on 2x A100-80GB ------------------------------


def test_7b_in_bf16_runs_on_one_a10():
    plan = run_json("--model", "7B", "--context", "8192", "--concurrency", "8", "--gpu", "A10")

    assert plan["dtype"] == "bfloat16" and plan["quantization"] == "none"
    assert plan["recommended"]["gpu"] == "A10" and plan["recommended"]["count"] == 1
    assert 14 < plan["weights_gib"] < 14.5  # Qwen2.5-7B's safetensors: 15.23 GB
    assert plan["recommended"]["sequences"] >= 8


def test_14b_needs_4_bit_or_8_bit_weights_for_one_a30():
    bf16 = size(model_from_count("14B"), context=8192, concurrency=4, gpus=[GPUS["A30"]])
    assert bf16.options[0].count == 2, "bf16 weights (27.5 GiB) exceed a 24 GB GPU"

    # 4-bit (the chart's AWQ checkpoint, ~10 GB) leaves room for 8k contexts; 8-bit (~16 GB) for 4k ones.
    for quantization, context in (("awq", "8192"), ("int8", "4096"), ("fp8", "4096")):
        plan = run_json("--model", "14B", "--context", context, "--concurrency", "4", "--quantization", quantization,
                        "--gpu", "A30")
        assert (plan["recommended"]["gpu"], plan["recommended"]["count"]) == ("A30", 1), quantization
        assert plan["recommended"]["max_num_seqs"] >= 4


def test_72b_runs_on_two_a100_80gb_with_8_bit_weights_and_not_on_one():
    plan = run_json("--model", "72B", "--context", "8192", "--concurrency", "16", "--quantization", "int8",
                    "--gpu", "A100-80")
    best = plan["recommended"]
    assert (best["gpu"], best["count"]) == ("A100-80", 2)
    assert best["weights_gib_per_gpu"] == pytest.approx(35.0, abs=0.1)
    assert "tensorParallelSize: 2" in plan["values"]

    one = size(model_from_count("72B"), context=1024, concurrency=1, quantization="int8", gpus=[GPUS["A100-80"]])
    assert one.options[0].count == 2, "70 GiB of 8-bit weights leave no KV cache on one 80 GB GPU"
    bf16 = size(model_from_count("72B"), context=8192, concurrency=16, gpus=[GPUS["A100-80"]])
    assert bf16.options[0].count == 4, "in bf16 two A100-80GB hold the weights but almost no KV cache"


def test_the_whole_catalogue_lists_each_gpu_type_with_its_smallest_tensor_parallel_size():
    plan = size(model_from_count("72B"), context=8192, concurrency=16, quantization="int8")

    counts = {o.gpu: o.count for o in plan.options}
    assert counts["A100-80"] == 2 and counts["H200"] == 1 and counts["A100-40"] == 4
    assert plan.recommended is not None and plan.recommended.count == min(o.count for o in plan.options if o.fits)


# ---- the arithmetic --------------------------------------------------------------------------------------------------


def test_the_shapes_table_has_the_qwen2_5_parameter_counts():
    published = {"7B": 7.62e9, "14B": 14.7e9, "32B": 32.8e9, "72B": 72.7e9}
    for label, count in published.items():
        assert SHAPES[label].parameters == pytest.approx(count, rel=0.01)
    assert weights_bytes(SHAPES["14B"], dtype_bytes=2, quantization="awq") == pytest.approx(9.99e9, rel=0.02)


def test_a_bare_count_takes_the_nearest_shapes_and_keeps_its_own_parameters():
    shape = model_from_count("13B")
    assert shape.parameters == 13 * 10**9
    assert (shape.num_hidden_layers, shape.num_key_value_heads) == (48, 8)
    with pytest.raises(SizingError):
        model_from_count("lots")


def test_kv_bytes_follow_layers_kv_heads_head_size_and_dtype():
    shape = SHAPES["72B"]
    assert kv_bytes_per_token(shape, kv_bytes=2) == 80 * 8 * 128 * 2 * 2
    assert kv_bytes_per_token(shape, kv_bytes=1) * 2 == kv_bytes_per_token(shape, kv_bytes=2)
    assert kv_bytes_per_token(shape, kv_bytes=2, tp=2) * 2 == kv_bytes_per_token(shape, kv_bytes=2)
    # More GPUs than KV heads: each holds one (replicated), not a fraction.
    assert kv_bytes_per_token(SHAPES["0.5B"], kv_bytes=2, tp=2) == kv_bytes_per_token(SHAPES["0.5B"], kv_bytes=2,
                                                                                       tp=1) // 2
    assert kv_bytes_per_token(SHAPES["72B"], kv_bytes=2, tp=8) == 80 * 1 * 128 * 2 * 2


def test_fp8_kv_cache_holds_about_twice_the_sequences():
    shape = model_from_count("7B")
    bf16 = size(shape, context=8192, concurrency=1, gpus=[GPUS["A100-80"]]).options[0]
    fp8 = size(shape, context=8192, concurrency=1, kv_cache_dtype="fp8", gpus=[GPUS["A100-80"]]).options[0]
    assert fp8.sequences in (2 * bf16.sequences, 2 * bf16.sequences + 1)


def test_less_gpu_memory_utilization_leaves_less_kv_cache():
    shape = model_from_count("7B")
    at = {u: size(shape, context=4096, concurrency=1, gpu_memory_utilization=u, gpus=[GPUS["A10"]]).options[0]
          for u in (0.8, 0.9)}
    assert at[0.9].kv_cache_gib_per_gpu - at[0.8].kv_cache_gib_per_gpu == pytest.approx(0.1 * 22.2, abs=0.02)


def test_max_num_seqs_never_exceeds_what_the_cache_holds_at_full_context():
    shape = model_from_count("14B")
    for gpu in GPUS.values():
        o = size(shape, context=4096, concurrency=2, quantization="awq", gpus=[gpu]).options[0]
        if o.fits:
            per_sequence = kv_bytes_per_sequence(shape, tokens=4096, kv_bytes=2, tp=o.count)
            assert 2 <= o.max_num_seqs <= o.sequences
            assert o.max_num_seqs * per_sequence <= o.kv_cache_gib_per_gpu * GIB * 1.001
            assert o.max_num_seqs <= (1024 if gpu.large_engine_defaults else 256)


def test_tensor_parallel_sizes_divide_the_attention_heads():
    assert tensor_parallel_sizes(SHAPES["7B"]) == [1, 2, 4]  # 28 heads
    assert tensor_parallel_sizes(SHAPES["14B"]) == [1, 2, 4, 8]  # 40 heads, 8 KV heads


def test_fp8_is_not_offered_on_a_t4():
    o = size(model_from_count("7B"), context=2048, concurrency=1, quantization="fp8", gpus=[GPUS["T4"]]).options[0]
    assert not o.fits and "compute capability" in o.reason


# ---- config.json -----------------------------------------------------------------------------------------------------


def write_model(folder: Path, config: dict, tensors: dict[str, list[int]] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    if tensors:
        header = json.dumps({name: {"dtype": "BF16", "shape": shape, "data_offsets": [0, 0]}
                             for name, shape in tensors.items()}).encode()
        (folder / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    return folder


LLAMA_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336,
            "vocab_size": 128256, "max_position_embeddings": 131072, "torch_dtype": "bfloat16",
            "tie_word_embeddings": False}


def test_a_config_json_gives_the_shapes_and_head_dim_falls_back_to_hidden_over_heads(tmp_path):
    shape = model_from_folder(write_model(tmp_path / "llama", LLAMA_8B))

    assert shape.head_dim == 128 and shape.num_key_value_heads == 8
    assert kv_bytes_per_token(shape, kv_bytes=2) == 131072  # Llama-3-8B: 128 KiB per token
    assert shape.parameters == pytest.approx(8.03e9, rel=0.01)
    assert shape.max_position_embeddings == 131072


def test_parameters_come_from_the_safetensors_headers_when_there_are_any(tmp_path):
    folder = write_model(tmp_path / "m", LLAMA_8B, {"a": [1000, 1000], "b": [10], "__metadata__": []})
    folder_config = json.loads((folder / "config.json").read_text())
    assert folder_config["num_hidden_layers"] == 32
    assert model_from_folder(folder).parameters == 1_000_010


def test_a_sliding_window_caps_the_kv_of_the_layers_that_use_it(tmp_path):
    mistral = {**LLAMA_8B, "sliding_window": 4096, "max_position_embeddings": 32768}
    qwen2 = {**LLAMA_8B, "model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": False}
    hybrid = {**LLAMA_8B, "sliding_window": 1024, "layer_types": ["sliding_attention", "full_attention"] * 16}
    per_token = kv_bytes_per_token(model_from_folder(write_model(tmp_path / "x", LLAMA_8B)), kv_bytes=2)

    windowed = model_from_folder(write_model(tmp_path / "mistral", mistral))
    assert kv_bytes_per_sequence(windowed, tokens=32768, kv_bytes=2) == per_token * (4096 + 16)
    assert model_from_folder(write_model(tmp_path / "qwen2", qwen2)).sliding_window_layers == 0
    half = model_from_folder(write_model(tmp_path / "hybrid", hybrid))
    assert kv_bytes_per_sequence(half, tokens=32768, kv_bytes=2) == per_token // 2 * (32768 + 1024 + 16)


def test_a_quantized_checkpoint_is_sized_as_quantized_by_default(tmp_path):
    awq = {**LLAMA_8B, "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}}
    shape = model_from_folder(write_model(tmp_path / "awq", awq, {"packed": [10, 10]}))

    assert shape.quantization == "awq" and shape.parameters == pytest.approx(8.03e9, rel=0.01)
    assert size(shape, context=1024, concurrency=1).quantization == "awq"


def test_what_cannot_be_sized_is_said(tmp_path):
    with pytest.raises(SizingError, match="num_attention_heads"):
        model_from_folder(write_model(tmp_path / "broken", {"num_hidden_layers": 2, "hidden_size": 8}))
    with pytest.raises(SizingError, match="latent attention"):
        model_from_folder(write_model(tmp_path / "mla", {**LLAMA_8B, "kv_lora_rank": 512}))
    with pytest.raises(SizingError):
        load_model(str(tmp_path / "missing"))


def dev_model_folder() -> Path | None:
    from goodput_inference.devmodel import default_data_dir

    done = sorted((default_data_dir() / "models").glob("smollm2-135m-instruct-*/.goodput-converted"))
    return done[-1].parent if done else None


def test_the_dev_model_kv_cache_matches_the_cpu_engines_arithmetic():
    """SmolLM2-135M in float32: 30 layers x 3 KV heads x 64 x 2 x 4 bytes = 45 KiB a token; the CPU engine's 1 GiB
    cache (VLLM_CPU_KVCACHE_SPACE) in 128-token blocks holds 182 blocks. The engine's own log line is compared in
    tests/integration/test_sizing_kv.py."""
    folder = dev_model_folder()
    if folder is None:
        pytest.skip("the dev model is not converted yet (make install)")
    shape = load_model(str(folder))

    assert shape.parameters == pytest.approx(134.5e6, rel=0.005)
    assert kv_bytes_per_token(shape, kv_bytes=4) == 46080
    assert kv_cache_tokens(shape, cache_bytes=GIB, kv_bytes=4, block_tokens=128) == 182 * 128
    assert tensor_parallel_sizes(shape) == [1]  # 9 heads


# ---- the command -----------------------------------------------------------------------------------------------------


def test_the_values_snippet_is_a_pool_the_chart_can_take():
    plan = run_json("--model", "72B", "--context", "8192", "--concurrency", "16", "--quantization", "int8", "--gpu",
                    "A100-80", "--name", "qwen-72b", "--classes", "P0,P1")
    pool = yaml.safe_load(plan["values"])["pools"][0]

    assert pool == {"name": "qwen-72b", "model": {"path": "CHANGE-ME"}, "engine": "vllm",
                    "gpu": {"type": "A100-80", "count": 2}, "tensorParallelSize": 2,
                    "maxNumSeqs": plan["recommended"]["max_num_seqs"], "maxNumBatchedTokens": 2048,
                    "costPerHour": plan["recommended"]["cost_per_hour"], "classes": ["P0", "P1"]}


def test_the_table_names_every_gpu_and_the_recommendation():
    code, output = run("--model", "7B", "--context", "8192", "--concurrency", "8")

    assert code == 0, output
    for gpu in GPUS:
        assert gpu in output
    assert "best" in output and "recommended: 1x" in output and "pools:" in output
    assert "…" not in output, "the table fits 80 columns"


def test_nothing_fits_exits_1_and_says_what_to_change():
    code, output = run("--model", "72B", "--context", "32768", "--concurrency", "64", "--gpu", "T4")

    assert code == 1
    assert "T4: weights" in output and "error: nothing considered holds 64 sequences" in output
    assert "Traceback" not in output


def test_bad_arguments_are_one_line_errors():
    for args in (("--model", "seven"), ("--model", "7B", "--gpu", "V100"), ("--model", "7B", "--cost", "A10=cheap"),
                 ("--model", "7B", "--dtype", "int3")):
        code, output = run(*args, "--context", "1024", "--concurrency", "1")
        assert code == 1 and output.startswith("error: ") and "Traceback" not in output, output


def test_your_prices_change_the_recommendation():
    default = run_json("--model", "7B", "--context", "4096", "--concurrency", "4")
    assert default["recommended"]["gpu"] == "L4"
    cheaper_a10 = run_json("--model", "7B", "--context", "4096", "--concurrency", "4", "--cost", "a10=0.5")
    assert cheaper_a10["recommended"]["gpu"] == "A10"
    assert find_gpu("h100").name == "H100-80"


def test_goodput_has_the_size_command():
    result = runner.invoke(goodput_app, ["size", "--help"])
    assert result.exit_code == 0 and "--concurrency" in result.output
