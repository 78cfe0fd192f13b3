#!/usr/bin/env bash
# The third-party benchmark clients that `python -m loadtests.peers` runs unchanged against Goodput (`make peers`; not
# part of `make install` or `make test`):
#   - inference-perf (kubernetes-sigs), aiperf (NVIDIA) and guidellm (vllm-project), each in a venv of its own,
#     <PEERS_DIR>/<tool>-venv (default .tools/peers), so that none of their dependencies touch .venv or each other,
#   - requirements/peers/<tool>.txt (the tool's version pinned), installed from the package index,
#   - inference-perf needs Python >= 3.12: PYTHON312, else python3.12 on PATH if it runs, else the newest
#     $(pyenv root)/versions/3.12*/bin/python3.12; the others use PYTHON (default python3.11).
# Usage: scripts/install-peers.sh [TOOL...] (default: all three). Idempotent: a stamp in each venv records a hash of
# its requirements file and this script; when neither changed, that tool is skipped at once. Exits non-zero (with
# the tail of pip's log) when a tool cannot be installed.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"
PEERS_DIR="${PEERS_DIR:-${ROOT}/.tools/peers}"
PYTHON="${PYTHON:-python3.11}"
TOOLS=("$@")
[[ ${#TOOLS[@]} -gt 0 ]] || TOOLS=(inference-perf aiperf guidellm)

log() { printf 'install-peers: %s\n' "$*"; }

# A Python 3.12 interpreter that runs, found the way a fresh machine of this kind has one; prints its path.
python312() {
  if [[ -n "${PYTHON312:-}" ]]; then
    "${PYTHON312}" -c 'import sys' >/dev/null 2>&1 && echo "${PYTHON312}"
    return
  fi
  if command -v python3.12 >/dev/null && python3.12 -c 'import sys' >/dev/null 2>&1; then
    command -v python3.12
    return 0
  fi
  local root candidate
  root="$(pyenv root 2>/dev/null || echo "${HOME}/.pyenv")"
  candidate="$(ls -d "${root}"/versions/3.12*/bin/python3.12 2>/dev/null | sort -V | tail -1 || true)"
  if [[ -n "${candidate}" ]] && "${candidate}" -c 'import sys' >/dev/null 2>&1; then
    echo "${candidate}"
    return 0
  fi
  return 1
}

install_tool() {
  local tool="$1" module python minor
  case "${tool}" in
    inference-perf) module=inference_perf minor=12 ;;
    aiperf) module=aiperf minor=10 ;;
    guidellm) module=guidellm minor=10 ;;
    *) log "unknown tool ${tool} (inference-perf, aiperf, guidellm)"; return 1 ;;
  esac
  local venv="${PEERS_DIR}/${tool}-venv" requirements="requirements/peers/${tool}.txt"
  local stamp="${venv}/.goodput-peers-stamp" hash
  hash="$(cat "${requirements}" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
  if [[ -f "${stamp}" && "$(cat "${stamp}")" == "${hash}" && -x "${venv}/bin/${tool}" ]]; then
    log "${tool} up to date (${venv})"
    return 0
  fi

  if [[ -x "${venv}/bin/python" ]] \
    && ! "${venv}/bin/python" -c "import sys; sys.exit(sys.version_info < (3, ${minor}))" 2>/dev/null; then
    log "${venv} has a Python older than 3.${minor}; recreating it"
    rm -rf "${venv}"
  fi
  if [[ ! -x "${venv}/bin/python" ]]; then
    if [[ "${tool}" == inference-perf ]]; then
      python="$(python312)" || { log "no Python 3.12 found (set PYTHON312=/path/to/python3.12)"; return 1; }
    else
      python="${PYTHON}"
      command -v "${python}" >/dev/null || { log "${python} not found (set PYTHON=/path/to/python3)"; return 1; }
    fi
    log "creating ${venv} with $("${python}" --version 2>&1)"
    mkdir -p "${PEERS_DIR}"
    "${python}" -m venv "${venv}"
  fi
  rm -f "${stamp}"

  log "installing ${requirements} (a minute or two the first time)"
  if ! "${venv}/bin/python" -m pip --disable-pip-version-check install --quiet -r "${requirements}" \
    >"${venv}/pip-install.log" 2>&1; then
    grep -v "^WARNING: Location '.*' is ignored" "${venv}/pip-install.log" | tail -20
    log "pip install of ${tool} failed (${venv}/pip-install.log)"
    return 1
  fi
  local out
  if ! out="$("${venv}/bin/python" -c "import ${module}" 2>&1)"; then
    printf '%s\n' "${out}" | tail -20
    log "${tool} does not import"
    return 1
  fi
  [[ -x "${venv}/bin/${tool}" ]] || { log "${tool}'s command is missing from ${venv}/bin"; return 1; }

  echo "${hash}" >"${stamp}"
  log "${tool} done (${venv}; $("${venv}/bin/python" -c \
    "from importlib.metadata import version; print(version('${tool}'))"))"
}

for tool in "${TOOLS[@]}"; do
  install_tool "${tool}"
done
