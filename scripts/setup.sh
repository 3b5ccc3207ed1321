#!/usr/bin/env bash
# Create .venv (if missing) and install k3 with its test extras. CPU machines get the CPU torch 2.13 wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
if ! python -c "import torch" >/dev/null 2>&1; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q "torch>=2.9"
  else
    python -m pip install -q "torch==2.13.0"
  fi
fi
python -m pip install -q -e ".[test]"

# The "vm" sandbox tier needs QEMU, a guest kernel and an initramfs (Debian packages; root + apt only).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if ! bash scripts/setup_vm.sh; then
    echo "setup: scripts/setup_vm.sh failed: the VM sandbox tier is unavailable" >&2
    [ "${CI:-}" = "true" ] && exit 1
  fi
fi
