#!/usr/bin/env bash
# The Triton venv for engine=triton in development and tests (make install calls this; safe to run alone):
#   - a venv made from Debian's system Python 3.11 (/usr/bin/python3, not pyenv's): the Python backend's stub embeds
#     the system's libpython3.11 and loads the packages of the first python3 on PATH, so both must be that Python,
#   - requirements/triton.txt (pinned): nvidia-pytriton, which ships tritonserver 2.51 with the Python backend (CPU),
#     torch (CPU) and transformers for the dev model's Python model,
#   - the backend stub built for Python 3.11 put where tritonserver looks for it (backends/python/, as pytriton
#     itself does when it starts a server).
# Where: TRITON_VENV (default .tools/triton-venv). Idempotent: a stamp records a hash of requirements/triton.txt and
# this script; when neither changed, a second run exits at once. Without a system Python 3.11 and its libpython the
# venv cannot exist: the script says so and exits 0 (the Triton tests then skip, saying why).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "${ROOT}"
VENV="${TRITON_VENV:-${ROOT}/.tools/triton-venv}"
SYSTEM_PYTHON="${TRITON_SYSTEM_PYTHON:-/usr/bin/python3}"
REQUIREMENTS="requirements/triton.txt"
STAMP="${VENV}/.goodput-triton-stamp"

log() { printf 'install-triton: %s\n' "$*"; }

if [[ ! -x "${SYSTEM_PYTHON}" ]] \
  || ! "${SYSTEM_PYTHON}" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' 2>/dev/null; then
  log "skipped: ${SYSTEM_PYTHON} is not a Python 3.11 (the Python backend's stub is built for the system's 3.11)"
  exit 0
fi
libdir="$("${SYSTEM_PYTHON}" -c 'import sysconfig; print(sysconfig.get_config_var("LIBDIR") or "")')"
if [[ ! -e "${libdir}/libpython3.11.so.1.0" ]] && ! ldconfig -p 2>/dev/null | grep -q 'libpython3\.11\.so\.1\.0'; then
  log "skipped: no libpython3.11.so.1.0 (Debian: apt-get install libpython3.11)"
  exit 0
fi

HASH="$(cat "${REQUIREMENTS}" "${BASH_SOURCE[0]}" | sha256sum | cut -d' ' -f1)"
if [[ -f "${STAMP}" && "$(cat "${STAMP}")" == "${HASH}" && -x "${VENV}/bin/python3" ]]; then
  log "up to date (${VENV})"
  exit 0
fi

if [[ -x "${VENV}/bin/python3" ]] && ! grep -q "^home = $(dirname "${SYSTEM_PYTHON}")\$" "${VENV}/pyvenv.cfg"; then
  log "${VENV} was not made from ${SYSTEM_PYTHON}; recreating it"
  rm -rf "${VENV}"
fi
if [[ ! -x "${VENV}/bin/python3" ]]; then
  log "creating ${VENV} with $("${SYSTEM_PYTHON}" --version 2>&1) (${SYSTEM_PYTHON})"
  mkdir -p "$(dirname "${VENV}")"
  "${SYSTEM_PYTHON}" -m venv "${VENV}"
fi
rm -f "${STAMP}"

log "installing ${REQUIREMENTS} (nvidia-pytriton, torch CPU, transformers)"
if ! "${VENV}/bin/python3" -m pip --disable-pip-version-check install --quiet -r "${REQUIREMENTS}" \
  >"${VENV}/pip-install.log" 2>&1; then
  grep -v "^WARNING: Location '.*' is ignored" "${VENV}/pip-install.log" | tail -20
  log "pip install failed (${VENV}/pip-install.log)"
  exit 1
fi
"${VENV}/bin/python3" -c 'import pytriton, torch, transformers, numpy' \
  || { log "the Triton venv's packages do not import"; exit 1; }

site="$("${VENV}/bin/python3" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
server="${site}/pytriton/tritonserver"
cp -f "${server}/python_backend_stubs/3.11/triton_python_backend_stub" "${server}/backends/python/"
# (--help exits 1; what it prints shows the binary and its libraries load)
usage="$(LD_LIBRARY_PATH="${site}/nvidia_pytriton.libs" "${server}/bin/tritonserver" --help 2>&1 || true)"
if [[ "${usage}" != *--grpc-address* ]]; then
  log "tritonserver does not run: LD_LIBRARY_PATH=${site}/nvidia_pytriton.libs ${server}/bin/tritonserver --help"
  exit 1
fi

echo "${HASH}" >"${STAMP}"
log "done (${VENV}; tritonserver ${server}/bin/tritonserver)"
