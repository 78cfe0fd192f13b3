#!/usr/bin/env bash
# The LiteLLM proxy venv for the overhead benchmark's --litellm (`make litellm`; the benchmark calls it too, and
# `make test` does, so that the LiteLLM smoke test runs; not part of `make install`, which `make run` needs):
#   - a venv of its own, so litellm[proxy]'s ~120 packages never touch .venv's pinned ones,
#   - requirements/litellm.txt (pinned: litellm 1.108.7 with its proxy extra), installed from the package index.
# Where: LITELLM_VENV (default .tools/litellm-venv); the interpreter: PYTHON (default python3.11). Idempotent: a stamp
# records a hash of requirements/litellm.txt and this script; when neither changed, a second run exits at once.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"
VENV="${LITELLM_VENV:-${ROOT}/.tools/litellm-venv}"
PYTHON="${PYTHON:-python3.11}"
REQUIREMENTS="requirements/litellm.txt"
STAMP="${VENV}/.goodput-litellm-stamp"

log() { printf 'install-litellm: %s\n' "$*"; }

HASH="$(cat "${REQUIREMENTS}" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [[ -f "${STAMP}" && "$(cat "${STAMP}")" == "${HASH}" && -x "${VENV}/bin/litellm" ]]; then
  log "up to date (${VENV})"
  exit 0
fi

if [[ ! -x "${VENV}/bin/python" ]]; then
  command -v "${PYTHON}" >/dev/null || { log "${PYTHON} not found (set PYTHON=/path/to/python3)"; exit 1; }
  log "creating ${VENV} with $("${PYTHON}" --version 2>&1)"
  mkdir -p "$(dirname "${VENV}")"
  "${PYTHON}" -m venv "${VENV}"
fi
rm -f "${STAMP}"

log "installing ${REQUIREMENTS} (litellm[proxy], about a minute the first time)"
if ! "${VENV}/bin/python" -m pip --disable-pip-version-check install --quiet -r "${REQUIREMENTS}" \
  >"${VENV}/pip-install.log" 2>&1; then
  grep -v "^WARNING: Location '.*' is ignored" "${VENV}/pip-install.log" | tail -20
  log "pip install failed (${VENV}/pip-install.log)"
  exit 1
fi
LITELLM_LOCAL_MODEL_COST_MAP=True "${VENV}/bin/python" -c 'import litellm.proxy.proxy_server' \
  || { log "the LiteLLM proxy does not import"; exit 1; }

echo "${HASH}" >"${STAMP}"
log "done (${VENV}; $("${VENV}/bin/python" -c 'from importlib.metadata import version; print("litellm", version("litellm"))'))"
